"""`make bench` / `python -m benchmarks`: the performance figures of this machine.

It is not part of the installed package: it runs from the repository and imports mjlab_hpc
like any user. Every figure is a ratio of two things measured alternately in the same run
(A B A B ...), so a busy machine slows both sides of a pair alike. Each is reported as the
median over the pairs with its spread (quartiles, min-max). The real CLIs run as subprocesses
with `--torch-threads 1`:

1. scaling efficiency: env-steps/s (collection + update) of 2 ranks / (2 x 1 rank), same envs
   per rank (`mjlab-train` vs `mjlab-submit --executor local --tasks-per-node 2`); the
   machine's limit: two independent 1-rank trainings at once, each / one alone (same repeat);
   and scaling efficiency / that limit;
2. collective share: time inside torch.distributed collectives / iteration time at 2 ranks;
3. rollout overhead: `env.step` throughput / raw MuJoCo Warp graph replay (`env.simulate()`) of
   the same worlds and substeps, for each built-in task;
4. launch cost: start of `mjlab-submit --executor local` to its first finished iteration /
   the same for a plain `mjlab-train` (warm kernel cache); and Warp kernel compilations of a
   2-rank job / a 1-rank job on a cold cache (each module compiled once per node, not per rank);
5. recovery: USR2 to the 2-rank job, stop at the next iteration boundary, checkpoint, restart by
   the local executor, resume: signal to checkpoint in iterations, restart to first resumed
   iteration / first start to first iteration, and iterations lost;
6. mjlab: env-steps/s of an mjlab task through `mjlab-train` / mjlab's own `train`, on
   mjlab's physics path (no Warp graph on CPU), and with our graph replay;
7. time to a target reward (`target`; alone: `python -m benchmarks.target`): cartpole, ant
   and Mjlab-Cartpole-Balance, 3 seeds each, as 1 rank x E envs, 1 rank x 2E envs with 2
   torch threads, and 2 ranks x E: wall-clock and env-steps to the target, and the ratios of
   2 ranks to 1 per seed; `<out>/time_to_target.png` (reward against wall-clock and
   env-steps, every run) and a table of its own after the figures;
8. GPU, only where CUDA is available (else skipped, and said so): env-steps/s and time to
   the first iteration of Mjlab-Velocity-Flat-Unitree-G1 through `mjlab-train` / mjlab's own
   `train` on the same GPU, and env.step / raw physics on `cuda:0`. The CPU figures run with
   no GPU visible, so they stay CPU figures on a GPU machine.

It also measures self-healing of a local job (`healing`), the run directory's lock under
contention (`lock`) and the cost of a rank's whole environment state (`envstate`). It writes
`<out>/bench.json`, `<out>/bench.png` and `<out>/time_to_target.png` and prints the tables
last. `--quick` is a short smoke run that checks the machinery (its figures mean nothing).

The other modules: `config` (the flags), `stats` (spreads, figures, parsing progress), `watch`
(one training job run and watched), `compile` (counting Warp compilations), `rollout`
(env.step against raw physics), `session` (the experiments and their figures), `gpu` (the GPU
section), `target` (time to a target reward), `report` (JSON, PNG, tables, entry point).
Commands of their own: `scale` (`make scale`: one job per world size on a Slurm cluster),
`fsops` (`make bench-fs`: a run's filesystem operations, real and simulated by `simranks`),
`recovery` (`make bench-recovery`: self-healing on Slurm), `gpucheck` (`make gpu-check`) and
`path` (the modules one request passes through). Nothing here is imported by the other
commands.
"""

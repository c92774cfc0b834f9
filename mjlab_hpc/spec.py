"""What to run, as frozen dataclasses of plain values.

`TrainSpec` holds the flags of `mjlab-train`, `SubmitSpec` those of `mjlab-submit`, and
`ResolvedSpec` a training spec whose task was looked up once, with the values every later
stage uses and its `RunTarget`: the run it trains, decided once in validation. Specs flow one
way, CLI -> launcher -> every rank: they are pickled to ranks and dumped as YAML and JSON
into the run directory. `mjlab_hpc.validate` checks what a value may hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

from mjlab_hpc.errors import SpecError

__all__ = [
    "KEPT_ON_CONTINUATION",
    "NOT_RUN_SETTINGS",
    "SIMULATOR_PACKAGES",
    "DeviceChoice",
    "ExecutorChoice",
    "GpuIds",
    "ResolvedSpec",
    "RunKind",
    "RunTarget",
    "SubmitSpec",
    "TrainSpec",
    "split_overrides",
    "train_cli_args",
]

DeviceChoice = Literal["auto", "cpu", "cuda"]
ExecutorChoice = Literal["slurm", "local", "allocation", "auto"]
GpuIds = tuple[int, ...] | Literal["all", "auto"] | None
RunKind = Literal["new", "continue", "restart"]


#: TrainSpec fields that a continuation keeps: its saved environments fit only the run's values
#: (like the number of ranks, the env config and the simulator's versions); another value is
#: refused before anything starts unless --fresh-envs. `task` is never changed. The other
#: fields but NOT_RUN_SETTINGS may change: applied, said on the console, recorded in run.json.
#: The rules, in one table: docs/preemption.md, "What a continuation may change".
KEPT_ON_CONTINUATION = ("num_envs", "seed")
#: The packages a task's saved environments are made of, by task source: restored only under
#: the same versions.
SIMULATOR_PACKAGES = {
    "built-in": ("mujoco", "mujoco-warp"),
    "mjlab": ("mujoco", "mujoco-warp", "mjlab"),
}
#: TrainSpec fields that name a run or say how to start it, not settings of the run.
NOT_RUN_SETTINGS = (
    "task",
    "log_root",
    "experiment_name",
    "run_name",
    "run_dir",
    "resume",
    "restart_from_scratch",
    "fresh_envs",
    "wandb_run_path",
    "wandb_checkpoint_name",
    "torchrunx_log_dir",
    "kernel_cache",
)


@dataclass(frozen=True)
class TrainSpec:
    """What to train and where to write it (the flags of `mjlab-train`)."""

    task: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TASK")] = "cartpole"
    """Task name: a built-in task (`mjlab-hpc list-tasks`) or a registered mjlab task."""
    num_envs: int | None = None
    """Parallel environments per rank (None: the task's default)."""
    max_iterations: int | None = None
    """PPO iterations in total (None: the task's default)."""
    seed: int = 42
    """Base seed; rank k uses seed + k."""
    log_root: str = "logs"
    """Root folder of all experiments."""
    experiment_name: str | None = None
    """Experiment folder under log-root (None: the task's name)."""
    run_name: str = ""
    """Suffix of the run directory name."""
    run_dir: str | None = None
    """Use this run directory instead of making a new one (launchers set it)."""
    save_interval: int = 50
    """Save a checkpoint every N iterations (and always at the end)."""
    device: DeviceChoice = "auto"
    """auto: CUDA when available, else CPU."""
    gpu_ids: GpuIds = "auto"
    """GPUs to train on, relative to CUDA_VISIBLE_DEVICES: `0 1`, `all`, or `None` (CPU).
    `auto` follows --device. Several ids start one rank per GPU."""
    num_procs: int = 1
    """Start N CPU ranks on this machine (gloo)."""
    oversubscribe: bool = False
    """Start more CPU ranks on this machine than it has cores (refused otherwise: each rank
    steps its physics on one core)."""
    torch_threads: int = 0
    """Torch threads per rank (0: SLURM_CPUS_PER_TASK, else the machine's cores / local ranks)."""
    dist_timeout_s: float = 300.0
    """Timeout of the rendezvous and of collectives in a start's first iteration; later the
    hang watchdog bounds a collective, on time the ranks ran (a suspend is no timeout)."""
    hang_timeout_s: float | None = 120.0
    """A rank whose iteration does not advance for this long (or 5x its slowest iteration,
    whichever is longer) is hung: every live rank logs its stacks and the job ends, to be
    requeued. The first iteration of each start and checkpoint writes do not count. `none`:
    no watchdog (collectives then time out after --dist-timeout-s)."""
    preflight: bool = False
    """Check every start before its first iteration: each rank's device and, on several
    nodes, its speed and the nodes' links. A node that fails or lags far behind is left out
    as a lost node (docs/preemption.md)."""
    save_every_min: float | None = None
    """Also save a checkpoint when this many minutes passed since the last one (bounds what a
    lost node costs). `none`: only every --save-interval iterations."""
    kernel_cache: str = "auto"
    """Where Warp keeps compiled kernels, code the ranks run: `auto` (a folder of yours in your
    home, warm for every log root; WARP_CACHE_PATH where that is set), `node` (Warp's own
    default) or a folder others may share (yours is `<folder>/<user>`, used while yours alone)."""
    use_graph: bool = True
    """Replay physics through a captured Warp graph (faster; bit-identical to plain stepping)."""
    normalizer_sync: Literal["iteration", "step"] = "iteration"
    """How often the ranks' observation normalizers agree (several ranks only): once per
    iteration, merging every rank's rollout before the update (one collective), or at every
    env step (exactly one process's statistics over all ranks; one collective per step)."""
    resume: bool = False
    """Continue the latest run of this experiment under --log-root from its newest valid
    checkpoint (an error when there is none). --run-dir names the run instead; a run
    directory that already holds checkpoints is always continued."""
    restart_from_scratch: bool = False
    """When every checkpoint of the run directory is damaged, train again from iteration 0
    (the damaged ones are kept as model_<n>.pt.damaged). Without it such a run is refused."""
    fresh_envs: bool = False
    """Continue a run whose saved environments do not fit this start (another --num-envs,
    --seed, number of ranks, env config or simulator version) with new environments instead
    of refusing: models, optimizer, normalizers and iteration are restored, the continuation
    is not exact; run.json records it."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    keep_env_states: int = 2
    """Keep the environment states (rank_states/) of the newest N checkpoints that verify
    (0: all); their models stay."""
    preempt_signal: str = "USR2"
    """Signal that announces the time limit (Slurm's --signal): USR2, USR1 or URG. SIGTERM
    means preemption."""
    max_restarts: int = 10
    """Requeue at most this many times; then stop with the checkpoint saved."""
    # mjlab's own train flags, with mjlab's names and defaults (docs/mjlab.md).
    video: bool = False
    """mjlab tasks: record videos of env 0 on the writer rank (rank 0) into <run>/videos/train
    (offscreen rendering: MUJOCO_GL=egl, or osmesa). mjlab's `--video True` works too."""
    video_length: int = 200
    """Frames per video."""
    video_interval: int = 2000
    """Start a video every N env steps of the writer rank."""
    enable_nan_guard: bool = False
    """mjlab tasks: mjlab's NaN guard (keep recent simulator states, dump them when a NaN or
    Inf appears); dumps go to <run>/nan_dumps/rank<k> unless --env.sim.nan-guard.output-dir
    says otherwise."""
    registry_name: str | None = None
    """Tracking tasks: W&B registry motion (entity/project/name[:alias]) fetched once before
    training when --env.commands.motion.motion-file names no file (needs network then)."""
    wandb_run_path: str | None = None
    """With --agent.resume True: start from a checkpoint of this W&B run
    (entity/project/run-id) instead of a run under --log-root."""
    wandb_checkpoint_name: str | None = None
    """With --wandb-run-path: the checkpoint to load (e.g. model_4000.pt; default: the newest)."""
    torchrunx_log_dir: str | None = None
    """Accepted for mjlab's commands; no effect (no torchrunx here: every rank logs to
    <run>/logs/rank<k>.log)."""
    overrides: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """mjlab tasks: `--env.*` / `--agent.*` arguments, as mjlab's own train takes them."""

    @property
    def device_choice(self) -> DeviceChoice:
        """The device the flags ask for: --device, but cpu for `--gpu-ids None` and CPU ranks."""
        return "cpu" if self.gpu_ids is None or self.num_procs > 1 else self.device

    def replace(self, **changes: object) -> TrainSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """Plain-value dict (for YAML and JSON)."""
        out = dataclasses.asdict(self)
        if isinstance(self.gpu_ids, tuple):
            out["gpu_ids"] = list(self.gpu_ids)
        out["overrides"] = list(self.overrides)
        return out


def split_overrides(unknown: list[str]) -> tuple[str, ...]:
    """Return the `--env.*`/`--agent.*` arguments (with their values) the CLI did not know.

    SpecError names the first unknown argument that is neither.
    """
    if unknown and not unknown[0].startswith(("--env.", "--agent.")):
        raise SpecError(unknown[0], "unknown argument (see --help)")
    return tuple(unknown)


@dataclass(frozen=True)
class RunTarget:
    """The run a command trains: whether it is new, continued or restarted, and where.

    Decided once, in validation (`mjlab_hpc.validate`); launchers and ranks receive it.
    """

    kind: RunKind = "new"
    """new: a run with no checkpoint of its own, trained from iteration 0 (a new directory,
    or a --run-dir that holds no checkpoint); continue: an existing run, trained on from its
    newest valid checkpoint (--resume, or --run-dir of a run); restart: an existing run whose
    every checkpoint is damaged, trained again from iteration 0 (--restart-from-scratch)."""
    path: str | None = None
    """The run directory. None only for a new run whose directory is not made yet: it is
    made once, when the target is realised (`mjlab_hpc.rundir.layout.realise_target`)."""


@dataclass(frozen=True)
class ResolvedSpec:
    """A TrainSpec whose task was looked up once, with the effective values.

    Every later stage uses these values instead of merging the task's defaults again
    (`mjlab_hpc.tasks.registry.resolve_task`).
    """

    train: TrainSpec
    """The spec as given."""
    source: Literal["built-in", "mjlab"]
    """Where the task comes from."""
    num_envs: int
    """Environments per rank, after the task's default, --num-envs and overrides."""
    max_iterations: int
    """PPO iterations in total."""
    experiment_name: str
    """Experiment folder under the log root."""
    start_checkpoint: str | None = None
    """Another run's checkpoint this run starts from while it has none of its own (mjlab's
    --agent.resume True, --wandb-run-path): models, optimizer and normalizers; the iteration
    count starts at 0."""
    motion_file: str | None = None
    """Tracking tasks: the motion fetched for --registry-name (None: the env config's)."""
    target: RunTarget = field(default_factory=RunTarget)
    """The run this spec trains (validation decides it; its path is `train.run_dir` too)."""

    @property
    def task(self) -> str:
        """The task's name."""
        return self.train.task

    def aimed(self, target: RunTarget) -> ResolvedSpec:
        """A copy that trains `target`: its path becomes the run directory every rank uses."""
        train = self.train.replace(run_dir=target.path) if target.path else self.train
        return dataclasses.replace(self, train=train, target=target)

    def replace_train(self, **changes: object) -> ResolvedSpec:
        """A copy with TrainSpec fields changed that do not affect the resolution.

        Such fields are the run directory, resume, and the like.
        """
        return dataclasses.replace(self, train=self.train.replace(**changes))

    def effective(self) -> dict[str, object]:
        """The effective values, for run.json and summaries."""
        out: dict[str, object] = {
            "task": self.task,
            "source": self.source,
            "num_envs": self.num_envs,
            "max_iterations": self.max_iterations,
            "experiment_name": self.experiment_name,
        }
        # Where the weights and the motion came from, when they came from elsewhere.
        for key in ("start_checkpoint", "motion_file"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class SubmitSpec:
    """A multi-node training job (the flags of `mjlab-submit`)."""

    train: Annotated[TrainSpec, tyro.conf.OmitArgPrefixes] = field(default_factory=TrainSpec)
    """What every rank trains (the flags of mjlab-train)."""
    profile: str | None = None
    """Take the flags of [profile.NAME] in mjlab-hpc.toml or ~/.config/mjlab-hpc/config.toml
    (site defaults: docs/submit.md); flags typed here win over it."""
    nodes: int = 1
    """Nodes of the job."""
    spare_nodes: int = 0
    """Nodes the job asks for beyond --nodes: the ranks run on --nodes of them, and after a
    crash, hang or lost node the next srun step, in the same allocation, leaves out the node
    that failed and runs on a spare (the same world size: the run continues exactly)."""
    min_nodes: int | None = None
    """Go on with fewer nodes, down to this many, when a node fails and no spare is left:
    the next srun step, in the same allocation, leaves it out and runs fewer ranks. Each
    remaining rank keeps its environments, those of the ranks that are gone are dropped (not
    exact: fewer environments per iteration). Default: never fewer than --nodes."""
    gpus_per_node: int = 1
    """GPUs per node; one rank (srun task) per GPU. 0 for CPU-only partitions."""
    tasks_per_node: int | None = None
    """Ranks per node (default: --gpus-per-node, or 1 without GPUs)."""
    cpus_per_task: int | None = None
    """CPU cores per rank (Slurm's --cpus-per-task)."""
    mem: str | None = None
    """Memory per node, Slurm syntax (64G, 500M)."""
    partition: str | None = None
    """Slurm partition (queue) to run in (default: the cluster's default partition)."""
    account: str | None = None
    """Slurm account charged for the job."""
    qos: str | None = None
    """Slurm quality of service."""
    time: str = "1:00:00"
    """Time limit: minutes, HH:MM:SS or D-HH:MM:SS."""
    constraint: str | None = None
    """Node features (Slurm's --constraint), e.g. a100."""
    exclusive: bool = False
    """Whole nodes for this job."""
    job_name: str | None = None
    """Name in squeue (default: mjlab-<task>)."""
    container: str | None = None
    """Apptainer/Singularity image to run every rank in (--nv on GPUs)."""
    container_image: str | None = None
    """An enroot image for pyxis (srun --container-image) to run every rank in, e.g.
    nvcr.io#nvidia/pytorch:24.05-py3 or a .sqsh file; the log root is mounted at its path."""
    setup: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A shell line to run before the ranks start (repeatable), e.g. 'module load cuda'."""
    sbatch_arg: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Any other sbatch option as KEY=VALUE (repeatable), e.g. mail-type=END."""
    executor: ExecutorChoice = "auto"
    """slurm (a new job), local (this machine, CPU ranks unless GPUs), allocation (srun in the
    Slurm allocation this shell is in: salloc, an interactive job), or auto (allocation
    inside one, else slurm if sbatch exists, else local)."""
    signal_delay_s: int = 90
    """Seconds before the time limit at which Slurm sends USR2 (checkpoint and requeue)."""
    dry_run: bool = False
    """Print the resolved spec and the exact sbatch script; submit nothing."""
    follow: bool = False
    """Stay, stream rank 0's progress, and exit with the job's outcome."""
    sweep: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """KEY=V1,V2,... (repeatable): one job array over the cartesian product of the values,
    one run directory per element, e.g. seed=0,1,2 or num_envs=512,1024."""
    array_parallelism: int | None = None
    """With --sweep: at most N elements run at once (Slurm's --array=...%N)."""
    after: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Start only once this Slurm job has ended, however it ended (repeatable; sbatch's
    --dependency=afterany:JOBID)."""
    snapshot: bool = True
    """Run this job and all its requeues from a copy, taken at submit time, of the git
    repository mjlab-submit is run from; --no-snapshot runs the code as it is when the job
    starts."""
    chain: int = 1
    """Submit N jobs of --time each, one after the other: each starts when the previous one
    ended and continues the run from its checkpoint (for clusters that forbid requeue or cap
    --time). With --sweep, N job arrays."""

    @property
    def ranks_per_node(self) -> int:
        """Ranks (srun tasks) on each node."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 1

    @property
    def world_size(self) -> int:
        """Ranks of the whole job."""
        return self.nodes * self.ranks_per_node

    @property
    def preempt_signal(self) -> str:
        """The time-limit warning signal, as Slurm names it (USR2)."""
        return self.train.preempt_signal.upper().removeprefix("SIG")

    @property
    def name(self) -> str:
        """The job's name in squeue."""
        return self.job_name or f"mjlab-{self.train.task}"

    def replace(self, **changes: object) -> SubmitSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def train_cli_args(spec: TrainSpec, every: bool = False) -> list[str]:
    """Return `mjlab-train` arguments that reproduce `spec`: its task and non-default flags.

    `every`: every flag, default or not. Ranks started with them set every setting, so a
    continuation takes none from the run: what it keeps was decided by their launcher.
    """
    args = [spec.task]
    defaults = TrainSpec()
    for f in dataclasses.fields(TrainSpec):
        if f.name in ("task", "run_dir", "gpu_ids", "num_procs", "overrides"):
            continue
        value = getattr(spec, f.name)
        if value == getattr(defaults, f.name) and not every:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{f.name.replace('_', '-')}")
        else:
            args += [flag, str(value)]
    return args + list(spec.overrides)

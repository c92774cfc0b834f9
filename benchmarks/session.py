"""One benchmark session: the experiments (training pairs, the mjlab comparison, compilations,
rollout) and the figures computed from them."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import shutil
import statistics
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compile import (
    QUICK_COLD_MODULES,
    CompileWatch,
    default_kernel_cache,
    prepare_cache,
)
from benchmarks.config import BenchConfig
from benchmarks.rollout import run_rollout
from benchmarks.stats import (
    Figure,
    collective_share,
    median_iteration_s,
    reward_text,
    share_of,
    throughput,
)
from benchmarks.watch import (
    JobTrace,
    bench_env,
    cli,
    kill_job,
    launch_parts,
    measured_records,
    recovery,
    watch_job,
)

__all__ = ["Bench"]


@dataclass
class Bench:
    """One benchmark session: its config, where it writes, and what it has measured."""

    cfg: BenchConfig
    say: Callable[[str], None]
    runs: Path = field(init=False)
    env: dict[str, str] = field(init=False)
    traces: dict[str, list[JobTrace]] = field(default_factory=dict)
    limits: list[tuple[JobTrace, ...]] = field(default_factory=list)
    """Per repeat: the two 1-rank trainings that ran at once (the machine's limit)."""
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runs = self.cfg.out / "runs"
        self.env = bench_env()

    def train_args(self, log_root: Path, iterations: int) -> list[str]:
        return [
            self.cfg.task,
            "--num-envs",
            str(self.cfg.envs),
            "--max-iterations",
            str(iterations),
            "--torch-threads",
            "1",
            "--seed",
            "7",
            "--save-interval",
            "1000",
            "--log-root",
            str(log_root),
        ]

    def mjlab_args(self, log_root: Path, iterations: int, graph: bool) -> list[str]:
        """Return our CLIs' arguments for the mjlab task.

        Without `graph` the task takes mjlab's physics path on CPU, where mjlab never
        captures Warp graphs.
        """
        return [
            self.cfg.mjlab_task,
            "--num-envs",
            str(self.cfg.mjlab_num_envs),
            "--max-iterations",
            str(iterations),
            "--torch-threads",
            "1",
            "--log-root",
            str(log_root),
            *([] if graph else ["--no-use-graph"]),
            "--agent.logger",
            "tensorboard",
        ]

    def submit_args(self, train_args: list[str], ranks: int) -> list[str]:
        return [
            cli("mjlab-submit"),
            *train_args,
            "--executor",
            "local",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            str(ranks),
            "--follow",
        ]

    def job(
        self,
        name: str,
        ranks: int,
        iterations: int,
        *,
        submit: bool,
        cache: CompileWatch | None = None,
        args: list[str] | None = None,
        **kw: Any,
    ) -> JobTrace:
        """Run one training job under `<runs>/<name>`, watched by `watch_job`.

        The job is `mjlab-train` (1 rank, in-process) or `mjlab-submit --executor local`
        (`ranks` tasks). With `cache` it runs on that kernel cache while its compilations are
        counted. `args` are the training arguments (default: the built-in task's,
        `train_args`).
        """
        root = self.runs / name
        train = args if args is not None else self.train_args(root, iterations)
        cmd = self.submit_args(train, ranks) if submit else [cli("mjlab-train"), *train]
        env = self.env
        if cache is not None:
            env = bench_env({"WARP_CACHE_PATH": str(cache.cache_dir.parent)})
        with cache if cache is not None else contextlib.nullcontext():
            trace = watch_job(
                cmd,
                label=name,
                ranks=ranks,
                log_root=root,
                env=env,
                timeout_s=self.cfg.run_timeout_s,
                **kw,
            )
        self.traces.setdefault(name.rsplit("-", 1)[0], []).append(trace)
        if cache is not None:
            self.details.setdefault("compilations", {})[name] = {
                **cache.summary(),
                "cache": "partly cold" if self.cfg.quick else "cold",
                "modules_in_cache": sum(
                    1 for p in cache.cache_dir.iterdir() if p.name.startswith("wp_")
                ),
                "launch_s": trace.launch_s,
            }
            shutil.rmtree(cache.cache_dir.parent, ignore_errors=True)
        if trace.returncode != 0:
            self.failures.append(f"{name}: exit {trace.returncode}\n{trace.output_tail[-1500:]}")
            self.say(f"  {name}: FAILED (exit {trace.returncode}), output in {root}")
        else:
            launch = f"{trace.launch_s:.1f}" if trace.launch_s is not None else "n/a"
            self.say(f"  {name}: done, first iteration after {launch} s")
        return trace

    def cold_cache(self, name: str) -> CompileWatch:
        """Make a fresh kernel cache for one job, and a watch counting its compilations.

        The cache is empty, or with --quick a copy of the warm cache less a few modules.
        """
        warm = default_kernel_cache() if self.cfg.quick else None
        cache = prepare_cache(self.runs / f"warp-cache-{name}", warm, QUICK_COLD_MODULES)
        return CompileWatch(cache)

    def rollout(self) -> None:
        self.say(f"rollout overhead: {', '.join(self.cfg.rollout_tasks)} x {self.cfg.envs} worlds")
        try:
            self.details["rollout"] = run_rollout(self.cfg, self.env)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.failures.append(f"rollout: {exc}")
            self.details["rollout"] = {}

    def concurrent(self, name: str, last: int) -> list[JobTrace]:
        """Start two independent 1-rank trainings together: what the machine allows two ranks.

        They are `mjlab-train` runs with no process group, under `<runs>/<name>-a` and `-b`,
        each watched as a 1-rank job alone is. They exchange nothing.
        """
        traces: list[JobTrace] = []

        def one(side: str) -> None:
            root = self.runs / f"{name}-{side}"
            traces.append(
                watch_job(
                    [cli("mjlab-train"), *self.train_args(root, last)],
                    label=f"{name}-{side}",
                    ranks=1,
                    log_root=root,
                    env=self.env,
                    timeout_s=self.cfg.run_timeout_s,
                    cpu_window=(1, last),
                )
            )

        threads = [threading.Thread(target=one, args=(side,)) for side in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.limits.append(tuple(traces))
        bad = [t for t in traces if t.returncode != 0]
        for t in bad:
            self.failures.append(f"{t.label}: exit {t.returncode}\n{t.output_tail[-1500:]}")
        self.say(f"  {name}: " + ("FAILED" if bad else "done (two 1-rank trainings at once)"))
        return traces

    def training_pairs(self) -> None:
        """Run the training jobs of every repeat.

        A repeat runs 1 rank (mjlab-train), 2 ranks (mjlab-submit, preempted once), two
        independent 1-rank trainings at once (the machine's limit), and 1 rank
        (mjlab-submit). The limit runs before the 2-rank job in odd repeats and after it in
        even ones, so drift hits both alike. With --quick the first two also count
        compilations on a partly cold cache (separate cold jobs would double the smoke run).
        """
        last = self.cfg.measured + 1  # iteration 1 is the warm-up
        piggyback = self.cfg.quick and self.cfg.cold_compile
        for r in range(1, self.cfg.pairs + 1):
            limit_first = r % 2 == 1
            two, limit = "2 ranks + preemption", "2 x 1 rank at once"
            order = f"{limit} | {two}" if limit_first else f"{two} | {limit}"
            self.say(f"repeat {r}/{self.cfg.pairs}: 1 rank | {order} | submit 1 rank")
            first = piggyback and r == 1
            self.job(
                f"one-{r}",
                1,
                last,
                submit=False,
                cache=self.cold_cache("one") if first else None,
                cpu_window=(1, last),
            )
            if limit_first:
                self.concurrent(f"limit-{r}", last)
            # Ends 2 iterations after the measured ones: USR2 stops the job at the next
            # boundary, the executor restarts it, and it resumes to the end.
            self.job(
                f"two-{r}",
                2,
                last + 2,
                submit=True,
                cache=self.cold_cache("two") if first else None,
                cpu_window=(1, last),
                signal_after=last,
            )
            if not limit_first:
                self.concurrent(f"limit-{r}", last)
            self.job(f"submit1-{r}", 1, 1, submit=True)

    def mjlab_pairs(self) -> None:
        """Run the mjlab comparison of every repeat, in alternating order (A B C, then C B A).

        The sides are mjlab's own `train`, our `mjlab-train` on mjlab's physics path (no
        graph), and ours with graph replay (our default). All three run alike: a plain
        subprocess, one torch thread, nothing polling them; their progress is read
        afterwards. (`mjlab-submit --executor local` runs the same rank code after a second
        import of mjlab in the submitting process.)
        """
        task, envs = self.cfg.mjlab_task, self.cfg.mjlab_num_envs
        if importlib.util.find_spec("mjlab") is None:
            self.details["mjlab"] = {"skipped": "the [mjlab] extra is not installed"}
            self.say("mjlab comparison: skipped (the [mjlab] extra is not installed)")
            return
        last = self.cfg.measured + 1
        runs: list[dict[str, Any]] = []
        self.details["mjlab"] = {"task": task, "num_envs": envs, "pairs": runs}
        sides = ("mjlab_train", "ours", "ours_graph")
        for r in range(1, self.cfg.mjlab_pairs + 1):
            order = sides if r % 2 else sides[::-1]
            self.say(f"mjlab {r}/{self.cfg.mjlab_pairs}: {task} x {envs} envs: {' | '.join(order)}")
            got: dict[str, list[dict[str, Any]]] = {}
            for side in order:
                records = self.mjlab_run(side, r, last)
                if records is None:
                    break
                got[side] = records
            if len(got) < len(sides):
                continue
            runs.append(
                {
                    **{side: throughput(got[side]) for side in sides},
                    # The same configs and seeds: the same rewards iteration by iteration show
                    # that both sides did the same work.
                    "same_rewards": [reward_text(x.get("reward")) for x in got["mjlab_train"]]
                    == [reward_text(x.get("mean_reward")) for x in got["ours"]],
                }
            )

    def mjlab_run(self, side: str, repeat: int, iterations: int) -> list[dict[str, Any]] | None:
        """Run one side of the mjlab comparison in `<runs>/mjlab-<side>-<repeat>`.

        Returns its progress records of iterations 2..`iterations`, None if it failed.
        """
        name = f"mjlab-{side.replace('_', '-')}-{repeat}"
        cwd = (self.runs / name).resolve()  # the runs start there: no relative paths
        cwd.mkdir(parents=True)
        if side == "mjlab_train":
            cmd = [
                cli("train"),
                self.cfg.mjlab_task,
                "--env.scene.num-envs",
                str(self.cfg.mjlab_num_envs),
                "--agent.max-iterations",
                str(iterations),
                "--agent.logger",
                "tensorboard",
                "--gpu-ids",
                "None",
            ]
        else:
            cmd = [
                cli("mjlab-train"),
                *self.mjlab_args(cwd / "logs", iterations, graph=side == "ours_graph"),
            ]
        out = cwd / f"{name}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                # mjlab's train has no thread flag: torch reads OMP_NUM_THREADS (both sides).
                env=bench_env({"OMP_NUM_THREADS": "1"}),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a timeout ends the whole job, ranks included
            )
            try:
                proc.wait(timeout=self.cfg.run_timeout_s)
            except subprocess.TimeoutExpired:
                kill_job(proc)
        text = out.read_text(errors="replace")
        records = measured_records(side, text, cwd, iterations)
        if proc.returncode != 0 or len(records) != iterations - 1:
            self.failures.append(f"{name}: exit {proc.returncode}\n{text[-1500:]}")
            self.say(f"  {name}: FAILED (exit {proc.returncode}), output in {out}")
            return None
        self.say(f"  {name}: {throughput(records):,.0f} env-steps/s")
        return records

    def compilations(self) -> None:
        """Kernel compilations of a 1-rank and a 2-rank job, each on an empty kernel cache."""
        self.say("kernel compilations on a cold cache: 1-rank job, then 2-rank job")
        self.job("cold-1", 1, 1, submit=False, cache=self.cold_cache("cold-1"))
        self.job("cold-2", 2, 1, submit=True, cache=self.cold_cache("cold-2"))

    def figures(self) -> list[Figure]:
        n = self.cfg.measured
        last = n + 1
        ones, twos, subs = (self.traces.get(k, []) for k in ("one", "two", "submit1"))
        eff, coll, launch, launch2, resume, stop_its, lost = [], [], [], [], [], [], []
        limit, of_limit = [], []
        pair_details = []
        for i, (a, b, c) in enumerate(zip(ones, twos, subs, strict=False)):
            ta, tb = throughput(a.window(2, last)), throughput(b.window(2, last))
            eff.append(tb / (2 * ta))
            both = self.limits[i] if i < len(self.limits) else ()
            alone = [throughput(t.window(2, last)) / ta for t in both]
            if len(alone) == 2 and all(math.isfinite(x) for x in alone):
                limit.append(statistics.mean(alone))
                of_limit.append(eff[-1] / limit[-1])
            coll.append(collective_share(b.window(2, last)))
            if a.launch_s and c.launch_s:
                launch.append(c.launch_s / a.launch_s)
            if a.launch_s and b.launch_s:
                launch2.append(b.launch_s / a.launch_s)
            rec = recovery(b)
            if rec.get("resume_ratio") is not None:
                resume.append(rec["resume_ratio"])
            if rec.get("stop_iterations") is not None:
                stop_its.append(rec["stop_iterations"])
            if rec.get("iterations_lost") is not None:
                lost.append(float(rec["iterations_lost"]))
            pair_details.append(
                {
                    "throughput_1rank": ta,
                    "throughput_2ranks": tb,
                    "iteration_s_1rank": median_iteration_s(a.window(2, last)),
                    "iteration_s_2ranks": median_iteration_s(b.window(2, last)),
                    "collect_s_share_2ranks": share_of(b.window(2, last), "collect_s"),
                    "launch": {
                        k: launch_parts(t)
                        for k, t in (("train_1", a), ("submit_2", b), ("submit_1", c))
                    },
                    "cpu_1rank": a.cpu.as_dict(),
                    "cpu_2ranks": b.cpu.as_dict(),
                    "limit_each_vs_alone": alone,
                    "cpu_limit": [t.cpu.as_dict() for t in both],
                    # Each window's other_cores counts the sibling: without it, what else ran.
                    "limit_other_cores": [
                        round(t.cpu.other_cores - sum(u.cpu.rank_cores), 3)
                        for t, u in zip(both, both[::-1], strict=True)
                    ],
                    "recovery": rec,
                }
            )
        self.details["pairs"] = pair_details
        figs = [
            Figure(
                key="scaling_efficiency",
                label="scaling efficiency (2 ranks)",
                samples=tuple(eff),
                target=None,
                direction=">=",
                definition=(
                    "env-steps/s of 2 ranks / (2 x env-steps/s of 1 rank), same envs per rank, "
                    "iterations 2.. of each run"
                ),
                section="scaling",
            ),
            Figure(
                key="machine_limit",
                label="machine limit: 2 x 1 rank at once / alone",
                samples=tuple(limit),
                target=None,
                direction=">=",
                definition=(
                    "env-steps/s of each of two independent 1-rank trainings run "
                    "at once / of the 1-rank training alone (mean of the two), same repeat"
                ),
                section="scaling",
            ),
            Figure(
                key="scaling_of_limit",
                label="scaling efficiency / machine limit",
                samples=tuple(of_limit),
                target=None,
                direction=">=",
                definition="scaling efficiency / machine limit, per repeat",
                section="scaling",
            ),
            Figure(
                key="collective_share",
                label="collective share (2 ranks)",
                samples=tuple(coll),
                target=None,
                direction="<=",
                definition="time inside all-reduce/broadcast / iteration time, rank 0, 2 ranks",
                section="scaling",
            ),
        ]
        for task, data in self.details.get("rollout", {}).items():
            figs.append(
                Figure(
                    key=f"rollout_overhead_{task}",
                    label=f"env.step / raw physics ({task})",
                    samples=tuple(data["ratios"]),
                    target=0.9,
                    direction=">=",
                    definition=(
                        "env.step throughput / raw mujoco_warp graph replay throughput, same "
                        "worlds and substeps"
                    ),
                    section="rollout",
                )
            )
        figs += [
            Figure(
                key="launch_cost",
                label="launch: submit local / mjlab-train",
                samples=tuple(launch),
                target=1.5,
                direction="<=",
                definition=(
                    "mjlab-submit --executor local (1 rank) start to first finished iteration / "
                    "mjlab-train start to first finished iteration, warm kernel cache"
                ),
                section="launch",
            ),
            Figure(
                key="launch_cost_2ranks",
                label="launch: submit local 2 ranks / mjlab-train",
                samples=tuple(launch2),
                target=1.5,
                direction="<=",
                definition="the same with the 2-rank job (ranks share the 2 cores; informative)",
                section="launch",
            ),
        ]
        mj = self.details.get("mjlab", {}).get("pairs", [])
        task = self.cfg.mjlab_task
        if "skipped" not in self.details.get("mjlab", {}):
            figs += [
                Figure(
                    key="mjlab_vs_train",
                    label=f"{task}: ours / mjlab train",
                    samples=tuple(p["ours"] / p["mjlab_train"] for p in mj),
                    target=0.97,
                    direction=">=",
                    definition=(
                        "env-steps/s of mjlab-train --no-use-graph (mjlab's own physics path on "
                        "CPU) / mjlab's own train, same envs, one torch thread, iterations 2.."
                    ),
                    section="mjlab",
                ),
                Figure(
                    key="mjlab_graph_vs_train",
                    label=f"{task}: ours (graph) / mjlab train",
                    samples=tuple(p["ours_graph"] / p["mjlab_train"] for p in mj),
                    target=0.97,
                    direction=">=",
                    definition="the same with our default, Warp graph replay on CPU",
                    section="mjlab",
                ),
            ]
        comp = self.details.get("compilations", {})
        one = comp.get("cold-1") or comp.get("one-1")
        two = comp.get("cold-2") or comp.get("two-1")
        if one and two and one["compilations"]:
            ratio = two["compilations"] / one["compilations"]
            figs.append(
                Figure(
                    key="compile_duplication",
                    label="compilations: 2-rank / 1-rank job",
                    samples=(ratio,),
                    target=1.0,
                    direction="<=",
                    definition=(
                        "Warp module compilations of a 2-rank local job / of a 1-rank job, "
                        "each on its own cold cache (1.0: once per node)"
                    ),
                    section="launch",
                )
            )
        figs += [
            Figure(
                key="recovery_stop_iterations",
                label="recovery: signal -> checkpoint (iterations)",
                samples=tuple(stop_its),
                target=1.5,
                direction="<=",
                definition=(
                    "USR2 to checkpoint on disk / the run's median iteration time (the stop waits "
                    "for the iteration in flight)"
                ),
                section="recovery",
            ),
            Figure(
                key="recovery_resume_ratio",
                label="recovery: restart / first start",
                samples=tuple(resume),
                target=1.5,
                direction="<=",
                definition=(
                    "restarted ranks' start to first resumed iteration / first ranks' "
                    "start to first iteration, same job"
                ),
                section="recovery",
            ),
            Figure(
                key="recovery_iterations_lost",
                label="recovery: iterations lost",
                samples=tuple(lost),
                target=0.0,
                direction="<=",
                definition=(
                    "iterations finished before the stop that the restart did not resume "
                    "from (a count)"
                ),
                section="recovery",
            ),
        ]
        return figs

"""Time to a target reward: what ranks buy. A section of `make bench`; alone:
`python -m benchmarks.target` (the same flags, this section only; `<out>/target.json`,
`<out>/time_to_target.png`).

Each task trains with several seeds in three configurations of the same machine:

- 1 rank x E envs on one core (`mjlab-train --num-envs E --torch-threads 1`);
- 1 rank x 2E envs with 2 torch threads (`--num-envs 2E --torch-threads 2`: the same batch as
  two ranks, one process; Warp's CPU kernels still run on one core; `OMP_WAIT_POLICY=PASSIVE`);
- 2 ranks x E envs (`mjlab-train --num-procs 2 --num-envs E --torch-threads 1`).

A run is stopped (SIGINT: the next iteration boundary, with a checkpoint) at the first
iteration whose mean episode reward (rank 0's last 100 episodes, as rsl-rl logs it) reaches
the task's target; one that has not reached it after `max_iterations` counts as not reached.
Wall-clock to the target runs from the command's start (imports, process group, environments
included) to that iteration's record in progress.jsonl; env-steps count every rank's. For
each seed the three configurations run in alternating order (A B C, then C B A), so that
load on the shared machine hits them alike; the ratios of 2 ranks to 1 are taken per seed.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.stats import Figure, read_jsonl, spread
from benchmarks.watch import bench_env, cli, find_run_dir, kill_job
from mjlab_hpc.rundir.layout import PROGRESS

__all__ = [
    "CONFIGS",
    "TARGETS",
    "Target",
    "main",
    "print_target_table",
    "run_target",
    "target_figures",
    "write_target_png",
]


@dataclass(frozen=True)
class Target:
    """One task of the section and what its runs train to."""

    task: str
    """Task name, as `mjlab-train` takes it."""
    reward: float
    """The mean episode reward to reach."""
    num_envs: int
    """E: envs per rank."""
    max_iterations: int
    """A run that has not reached the target after this many iterations did not reach it."""
    args: tuple[str, ...] = ()
    """More arguments of its command."""

    @property
    def key(self) -> str:
        return _key(self.task)


def _key(task: str) -> str:
    """A task as a figure key (`Mjlab-Cartpole-Balance` -> `mjlab_cartpole_balance`)."""
    return task.lower().replace("-", "_")


#: Targets each configuration reaches quickly on a small machine (docs/performance.md).
TARGETS = (
    Target(task="cartpole", reward=450.0, num_envs=64, max_iterations=150),
    Target(task="ant", reward=100.0, num_envs=128, max_iterations=150),
    # mjlab scales rewards by the step's duration: 50 at most over its 1000-step episodes.
    Target(
        task="Mjlab-Cartpole-Balance",
        reward=8.0,
        num_envs=64,
        max_iterations=200,
        args=("--agent.logger", "tensorboard"),
    ),
)
#: --quick: the machinery only (cartpole, a target reached in a few iterations).
QUICK_TARGET = Target(task="cartpole", reward=25.0, num_envs=32, max_iterations=20)

#: (label, ranks, envs per rank in units of E, torch threads per rank)
CONFIGS = (
    ("1 rank x E", 1, 1, 1),
    ("1 rank x 2E, 2 threads", 1, 2, 2),
    ("2 ranks x E", 2, 1, 1),
)
_POLL_S = 0.25


def _command(t: Target, ranks: int, scale: int, threads: int, seed: int, root: Path) -> list[str]:
    return [
        cli("mjlab-train"),
        t.task,
        "--num-envs",
        str(t.num_envs * scale),
        "--max-iterations",
        str(t.max_iterations),
        "--torch-threads",
        str(threads),
        "--seed",
        str(seed),
        "--save-interval",
        "100000",
        "--log-root",
        str(root),
        *(["--num-procs", str(ranks)] if ranks > 1 else []),
        *t.args,
    ]


def train_to_target(
    cmd: Sequence[str], root: Path, reward: float, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Run one training command until its mean reward reaches `reward`, or it ends.

    At the target it gets SIGINT and stops at the next iteration boundary. Returns its curve
    and when the target was reached.
    """
    shutil.rmtree(root, ignore_errors=True)  # a run of an earlier session is not this one
    root.mkdir(parents=True)
    out = root / "train.out"
    with open(out, "w") as f:
        t0 = time.time()
        # A session of its own: a timeout ends the whole job, ranks included.
        proc = subprocess.Popen(
            list(cmd), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        stopping = timed_out = False
        while proc.poll() is None:
            run = find_run_dir(root)
            if not stopping and run is not None:
                stopping = any(
                    (r.get("mean_reward") or -math.inf) >= reward
                    for r in read_jsonl(run / PROGRESS)
                )
                if stopping:
                    proc.send_signal(signal.SIGINT)  # the first stops at the boundary
            if time.monotonic() > deadline:
                timed_out = True  # not reached in time: a finding on a busy machine
                kill_job(proc)
                break
            time.sleep(_POLL_S)
    run = find_run_dir(root)
    records = read_jsonl(run / PROGRESS) if run is not None else []
    # The first iteration at the target (it may have come after the last poll).
    hit = next(
        (int(r["iteration"]) for r in records if (r.get("mean_reward") or -math.inf) >= reward),
        None,
    )
    steps = 0
    curve = []
    reached = None
    for r in records:
        steps += int(r["env_steps"])
        curve.append(
            (int(r["iteration"]), steps, round(float(r["time"]) - t0, 3), r.get("mean_reward"))
        )
        if int(r["iteration"]) == hit and reached is None:
            reached = {
                "iteration": hit,
                "env_steps": steps,
                "wall_s": curve[-1][2],
                "train_s": float(r["elapsed_s"]),
                "reward": r["mean_reward"],
            }
    ok = reached is not None or timed_out or (proc.returncode == 0 and len(records) > 0)
    return {
        "reached": reached,
        "curve": curve,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "ok": ok,
        "tail": "" if ok else out.read_text(errors="replace")[-1500:],
    }


def run_target(
    cfg: BenchConfig, env: dict[str, str], runs: Path, say: Callable[[str], None]
) -> tuple[dict[str, Any], list[str]]:
    """Every task, seed and configuration; the runs by task, and any failures."""
    targets = (
        (QUICK_TARGET,) if cfg.quick else tuple(t for t in TARGETS if t.task in cfg.target_tasks)
    )
    seeds = cfg.target_seeds or (1 if cfg.quick else 3)
    out: dict[str, Any] = {}
    failures: list[str] = []
    for t in targets:
        task = out[t.task] = {
            "target": t.reward,
            "num_envs": t.num_envs,
            "max_iterations": t.max_iterations,
            "runs": [],
        }
        for i in range(seeds):
            seed = 10 * (i + 1)  # 2 ranks use seed and seed + 1: no seed shared across runs
            order = CONFIGS if i % 2 == 0 else CONFIGS[::-1]
            say(
                f"time to target: {t.task} >= {t.reward:g}, seed {seed}: "
                + " | ".join(c[0] for c in order)
            )
            for label, ranks, scale, threads in order:
                root = runs / f"target-{t.key}-{seed}-{ranks}x{scale}"
                cmd = _command(t, ranks, scale, threads, seed, root)
                # OpenMP's idle workers spin by default: beside another busy process, 2 threads
                # run far slower than 1 (docs/performance.md), which is not what this measures.
                run_env = {**env, "OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 else env
                got = train_to_target(
                    cmd, root, reward=t.reward, env=run_env, timeout_s=cfg.run_timeout_s * 2
                )
                task["runs"].append({"config": label, "seed": seed, **got})
                r = got["reached"]
                if not got["ok"]:
                    failures.append(f"{root.name}: exit {got['returncode']}\n{got['tail']}")
                    say(f"  {label}: FAILED (exit {got['returncode']}), output in {root}")
                elif r is None:
                    within = (
                        f"{cfg.run_timeout_s * 2:.0f} s"
                        if got["timed_out"]
                        else f"{t.max_iterations} iterations"
                    )
                    say(f"  {label}: not reached within {within}")
                else:
                    say(
                        f"  {label}: {r['wall_s']:.1f} s, {r['env_steps']:,} env-steps, "
                        f"iteration {r['iteration']}"
                    )
    return out, failures


def _by_seed(runs: list[dict[str, Any]], label: str, what: str) -> dict[int, float]:
    return {
        r["seed"]: r["reached"][what]
        for r in runs
        if r["config"] == label and r["reached"] is not None
    }


def target_figures(details: dict[str, Any]) -> list[Figure]:
    """Compute the time-to-target figures of every task, each per seed.

    They are the wall-clock to the target of 2 ranks / 1 rank x E and / 1 rank x 2E, and the
    env-steps 2 ranks / 1 rank x 2E needed (the same batch: about 1 when ranks learn as one
    process). They are reported without a target (CPU ranks on one machine).
    """
    one, big, two = (c[0] for c in CONFIGS)
    figs = []
    for task, data in details.items():
        key = _key(task)
        runs = data["runs"]
        for suffix, base, what, label in (
            ("", one, "wall_s", "wall-clock, 2 ranks / 1 rank x E"),
            ("_2e", big, "wall_s", "wall-clock, 2 ranks / 1 rank x 2E"),
            ("_steps_2e", big, "env_steps", "env-steps, 2 ranks / 1 rank x 2E"),
        ):
            a, b = _by_seed(runs, two, what), _by_seed(runs, base, what)
            samples = tuple(a[s] / b[s] for s in sorted(a) if s in b and b[s] > 0)
            figs.append(
                Figure(
                    key=f"time_to_target_{key}{suffix}",
                    label=f"{task} to {data['target']:g}: {label}",
                    samples=samples,
                    target=None,
                    direction="<=",
                    definition=(
                        f"{what} to a mean reward >= {data['target']:g} of 2 ranks x "
                        f"{data['num_envs']} envs / of {base}, per seed (wall-clock from the "
                        "command's start)"
                    ),
                    section="time to target",
                )
            )
    return figs


def summary_rows(details: dict[str, Any]) -> list[dict[str, Any]]:
    """Sum up each task and configuration: the runs that reached the target, and their spread.

    The spread is of their wall-clock, training seconds, env-steps and iterations to it.
    """
    rows = []
    for task, data in details.items():
        for label, *_ in CONFIGS:
            runs = [r for r in data["runs"] if r["config"] == label]
            hit = [r["reached"] for r in runs if r["reached"] is not None]
            rows.append(
                {
                    "task": task,
                    "target": data["target"],
                    "config": label,
                    "reached": len(hit),
                    "runs": len(runs),
                    **{
                        what: spread([h[what] for h in hit])
                        for what in ("wall_s", "train_s", "env_steps", "iteration")
                    },
                }
            )
    return rows


def print_target_table(details: dict[str, Any]) -> None:
    """The time-to-target table (medians, min-max over seeds)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="time to target (median, min-max over seeds)")
    for col in (
        "task",
        "configuration",
        "reached",
        "wall-clock s",
        "training s",
        "env-steps",
        "iterations",
    ):
        table.add_column(col, justify="left" if col in ("task", "configuration") else "right")

    def cell(s: dict[str, Any], fmt: str) -> str:
        if s["median"] is None:
            return "-"
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    for row in summary_rows(details):
        table.add_row(
            f"{row['task']} >= {row['target']:g}",
            row["config"],
            f"{row['reached']}/{row['runs']}",
            cell(row["wall_s"], ".1f"),
            cell(row["train_s"], ".1f"),
            cell(row["env_steps"], ",.0f"),
            cell(row["iteration"], ".0f"),
        )
    Console(width=140).print(table)


def write_target_png(path: Path, details: dict[str, Any]) -> None:
    """Plot mean reward against wall-clock and against env-steps, one row per task.

    Every run is drawn (one colour per configuration), the target dashed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    colours = dict(
        zip((c[0] for c in CONFIGS), ("tab:blue", "tab:orange", "tab:green"), strict=True)
    )
    rows = max(1, len(details))
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.2 * rows), squeeze=False)
    for (task, data), (ax_t, ax_s) in zip(details.items(), axes, strict=False):
        for r in data["runs"]:
            pts = [(it, steps, wall, rew) for it, steps, wall, rew in r["curve"] if rew is not None]
            if not pts:
                continue
            first = all(x["config"] != r["config"] for x in data["runs"][: data["runs"].index(r)])
            style = {"color": colours[r["config"]], "alpha": 0.8, "linewidth": 1.2}
            ax_t.plot(
                [p[2] for p in pts],
                [p[3] for p in pts],
                **style,
                label=r["config"] if first else None,
            )
            ax_s.plot([p[1] for p in pts], [p[3] for p in pts], **style)
        ax_t.set_xscale("log")  # configurations can differ tenfold on a busy machine
        for ax, xlabel in (
            (ax_t, "wall-clock from the command's start (s, log)"),
            (ax_s, "env-steps (all ranks)"),
        ):
            ax.axhline(data["target"], color="black", linestyle="--", linewidth=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("mean episode reward")
            ax.set_title(f"{task} (target {data['target']:g}, E = {data['num_envs']})", fontsize=9)
            ax.grid(True, alpha=0.3)
        ax_t.legend(fontsize=7, loc="lower right")
    fig.suptitle("time to target: every seed, until the target (stopped there)")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.target`: this section alone; 0 unless a run failed."""
    import tyro

    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)

    def say(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    runs = cfg.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    details, failures = run_target(cfg, bench_env(), runs, say)
    figures = {f.key: f.summary() for f in target_figures(details)}
    doc = {
        "quick": cfg.quick,
        "duration_s": round(time.time() - t0, 1),
        "figures": figures,
        "summary": summary_rows(details),
        "details": details,
        "failures": failures,
    }
    (cfg.out / "target.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_target_png(cfg.out / "time_to_target.png", details)
    for failure in failures:
        say(f"FAILED: {failure}")
    print_target_table(details)
    for f in figures.values():
        s = f["median"]
        say(
            f"{f['label']}: "
            + ("n/a" if s is None else f"{s:.3f} ({f['min']:.3f}-{f['max']:.3f}, n={f['n']})")
        )
    say(
        f"wrote {cfg.out / 'target.json'} and {cfg.out / 'time_to_target.png'} in "
        f"{doc['duration_s']} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

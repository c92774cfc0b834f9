"""Self-healing figures: a 2-rank local job with a crash, and one with a hang.

The job is `mjlab-train --num-procs 2`. Rank 1 is killed by SIGKILL (the crash) or frozen by
SIGSTOP (the hang, with `--hang-timeout-s`), once, at a fixed iteration (MJLAB_HPC_FAULT).
Measured are the seconds from the fault to the first resumed iteration, and the iterations
computed again. No scheduler is involved, so no requeue delay is counted (the Slurm tests
measure Slurm's).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.stats import Figure
from benchmarks.watch import cli, find_run_dir
from mjlab_hpc.rundir.record import read_record

__all__ = ["HANG_TIMEOUT_S", "healing_figures", "run_healing"]

#: The hang job's --hang-timeout-s (its recovery includes it).
HANG_TIMEOUT_S = 10
_FAULT_AT = 8
_SAVE_INTERVAL = 5


def _job(
    cfg: BenchConfig, env: dict[str, str], root: Path, fault: str, extra: list[str]
) -> dict[str, Any]:
    args = [
        cli("mjlab-train"),
        cfg.task,
        "--num-procs",
        "2",
        "--num-envs",
        str(cfg.envs),
        "--max-iterations",
        str(_FAULT_AT + 4),
        "--save-interval",
        str(_SAVE_INTERVAL),
        "--torch-threads",
        "1",
        "--log-root",
        str(root),
        *extra,
    ]
    proc = subprocess.run(
        args,
        env={**env, "MJLAB_HPC_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=cfg.run_timeout_s,
    )
    run = find_run_dir(root)
    faults = read_record(run).faults if run is not None else ()
    if proc.returncode != 0 or not faults or faults[0].recovery_s is None:
        raise RuntimeError(f"exit {proc.returncode}, faults {faults}: {proc.stderr[-1500:]}")
    f = faults[0]
    return {
        "reason": f.reason,
        "recovery_s": f.recovery_s,
        "recomputed": f.recomputed,
        "fault_iteration": f.iteration,
        "resumed_from": f.resumed_from,
    }


def run_healing(
    cfg: BenchConfig, env: dict[str, str], runs: Path, say: Callable[[str], None]
) -> tuple[dict[str, Any], list[str]]:
    """Run the crash and the hang job once each; return their measurements and any failures."""
    out: dict[str, Any] = {}
    failures: list[str] = []
    for name, what, fault, extra in (
        ("crash", "killed", f"kill@{_FAULT_AT}:rank1:once", []),
        (
            "hang",
            "frozen",
            f"stop@{_FAULT_AT}:rank1:once",
            ["--hang-timeout-s", str(HANG_TIMEOUT_S)],
        ),
    ):
        say(f"self-healing: 2-rank local job, rank 1 {what} after iteration {_FAULT_AT}")
        try:
            out[name] = _job(cfg, env, runs / f"heal-{name}", fault, extra)
            say(
                f"  {name}: first resumed iteration {out[name]['recovery_s']:.1f} s after the "
                f"fault, {out[name]['recomputed']} iteration(s) recomputed"
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"healing {name}: {exc}")
    return out, failures


def healing_figures(details: dict[str, Any]) -> list[Figure]:
    """Report the seconds from the fault to the first resumed iteration, crash and hang."""
    figs = []
    for name, target, what in (
        ("crash", 60.0, "kill -9 of rank 1 (the other is ended, the job restarts)"),
        (
            "hang",
            60.0 + HANG_TIMEOUT_S,
            f"SIGSTOP of rank 1, --hang-timeout-s {HANG_TIMEOUT_S} included",
        ),
    ):
        got = details.get(name)
        figs.append(
            Figure(
                key=f"heal_{name}_s",
                label=f"fault to resumed iteration, {name} (s)",
                samples=(float(got["recovery_s"]),) if got else (),
                target=target,
                direction="<=",
                definition=(
                    f"{what}: seconds from the fault to the first resumed iteration of a 2-rank "
                    f"local job; {got['recomputed'] if got else '?'} iteration(s) recomputed"
                ),
                section="healing",
            )
        )
    return figs

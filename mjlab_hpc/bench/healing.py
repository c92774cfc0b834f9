"""Self-healing figures: a 2-rank local job (`mjlab-train --num-procs 2`) with a crash (rank 1
killed by SIGKILL) and one with a hang (rank 1 frozen by SIGSTOP, `--hang-timeout-s`), each
injected once at a fixed iteration (MJLAB_HPC_FAULT): seconds from the fault to the first
resumed iteration, and iterations computed again. No scheduler is involved, so no requeue
delay is counted (the Slurm tests measure Slurm's)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mjlab_hpc.bench.config import BenchConfig
from mjlab_hpc.bench.stats import Figure
from mjlab_hpc.bench.watch import cli, find_run_dir
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
        cli("mjlab-train"), cfg.task, "--num-procs", "2", "--num-envs", str(cfg.envs),
        "--max-iterations", str(_FAULT_AT + 4), "--save-interval", str(_SAVE_INTERVAL),
        "--torch-threads", "1", "--log-root", str(root), *extra,
    ]  # fmt: skip
    proc = subprocess.run(args, env={**env, "MJLAB_HPC_FAULT": fault}, capture_output=True,
                          text=True, timeout=cfg.run_timeout_s)  # fmt: skip
    run = find_run_dir(root)
    faults = read_record(run).get("faults", []) if run is not None else []
    if proc.returncode != 0 or not faults or "recovery_s" not in faults[0]:
        raise RuntimeError(f"exit {proc.returncode}, faults {faults}: {proc.stderr[-1500:]}")
    f = faults[0]
    return {"reason": f["reason"], "recovery_s": f["recovery_s"], "recomputed": f["recomputed"],
            "fault_iteration": f["iteration"], "resumed_from": f["resumed_from"]}  # fmt: skip


def run_healing(
    cfg: BenchConfig, env: dict[str, str], runs: Path, say: Callable[[str], None]
) -> tuple[dict[str, Any], list[str]]:
    """The crash and the hang job, once each; their measurements and any failures."""
    out: dict[str, Any] = {}
    failures: list[str] = []
    for name, what, fault, extra in (
        ("crash", "killed", f"kill@{_FAULT_AT}:rank1:once", []),
        ("hang", "frozen", f"stop@{_FAULT_AT}:rank1:once",
         ["--hang-timeout-s", str(HANG_TIMEOUT_S)]),
    ):  # fmt: skip
        say(f"self-healing: 2-rank local job, rank 1 {what} after iteration {_FAULT_AT}")
        try:
            out[name] = _job(cfg, env, runs / f"heal-{name}", fault, extra)
            say(f"  {name}: first resumed iteration {out[name]['recovery_s']:.1f} s after the "
                f"fault, {out[name]['recomputed']} iteration(s) recomputed")  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"healing {name}: {exc}")
    return out, failures


def healing_figures(details: dict[str, Any]) -> list[Figure]:
    """Seconds from the fault to the first resumed iteration, for the crash and the hang."""
    figs = []
    for name, target, what in (
        ("crash", 60.0, "kill -9 of rank 1 (the other is ended, the job restarts)"),
        ("hang", 60.0 + HANG_TIMEOUT_S,
         f"SIGSTOP of rank 1, --hang-timeout-s {HANG_TIMEOUT_S} included"),
    ):  # fmt: skip
        got = details.get(name)
        figs.append(Figure(
            f"heal_{name}_s", f"fault to resumed iteration, {name} (s)",
            (float(got["recovery_s"]),) if got else (), target, "<=",
            f"{what}: seconds from the fault to the first resumed iteration of a 2-rank local "
            f"job; {got['recomputed'] if got else '?'} iteration(s) recomputed", "healing",
        ))  # fmt: skip
    return figs

"""One training job run as a subprocess and watched.

Watched are when its ranks start, its first iteration, the CPU it uses, and (with a signal)
how it stops, restarts and resumes.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.compile import default_kernel_cache
from benchmarks.stats import median_iteration_s, parse_rsl_rl_log, read_jsonl
from mjlab_hpc import procs
from mjlab_hpc.rundir.layout import PROGRESS, RESTARTS, SUBMITIT_DIR
from mjlab_hpc.rundir.record import RunRecord, read_record

__all__ = [
    "CpuSnapshot",
    "CpuWindow",
    "JobTrace",
    "bench_env",
    "cli",
    "find_run_dir",
    "kill_job",
    "launch_parts",
    "measured_records",
    "rank_pids",
    "recovery",
    "watch_job",
]

# Launcher variables of an enclosing job: a benchmark subprocess must start as a plain process.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCH_PREFIXES = ("SLURM_", "SUBMITIT_")
_POLL_S = 0.02
# Inside the measured window nothing is timed by polling (throughput comes from the ranks'
# own records): a slower poll takes less CPU from the measured ranks. A 2-rank job pays for
# whatever takes one rank's core, since the other waits for it at the next collective.
_POLL_MEASURED_S = 0.25


def session_pids(sid: int) -> list[int]:
    """Live processes of one session (a job started with start_new_session=True)."""
    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid and procs.alive(pid):
                found.append(pid)
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads); None if it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(times.user + times.system)


def start_time(pid: int) -> float | None:
    """When a live process started (epoch seconds); None if it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine have spent busy since boot."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(getattr(t, name) for name in t._fields if name not in ("guest", "guest_nice"))
    return float(total - idle)


def bench_env(extra: dict[str, str] | None = None, gpus: bool = False) -> dict[str, str]:
    """Return the environment of a benchmark subprocess.

    It is ours without an enclosing job's launcher variables, with this interpreter's scripts
    first on PATH. Without `gpus` no GPU is visible (CUDA_VISIBLE_DEVICES empty), so that the
    CPU figures stay CPU figures on a GPU machine; with it, the GPUs this process sees.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # Warm figures on the machine's warm kernels, not a cold cache under each job's log root.
    env.setdefault("WARP_CACHE_PATH", str(default_kernel_cache().parent))
    env.update(extra or {})
    return env


def cli(name: str) -> str:
    """The path of one of our console scripts, next to this interpreter if it is there."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def rank_pids(submitit_dir: Path) -> list[int]:
    """PIDs of the rank processes a local executor job runs from `submitit_dir`."""
    # The ranks' command lines carry the absolute folder (--out may be relative).
    folder = str(Path(submitit_dir).resolve())

    def is_rank(argv: tuple[str, ...]) -> bool:
        return "submitit.core._submit" in argv and folder in argv

    return sorted(p.pid for p in procs.processes(is_rank))


def kill_job(proc: subprocess.Popen[Any]) -> None:
    """End a subprocess we started in its own session, and everything it started."""
    procs.kill_group(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far by each rank, the launcher, this benchmark and the machine."""

    at: float
    ranks: dict[int, float]
    launcher: dict[int, float]
    bench: float
    machine: float

    @classmethod
    def take(cls, rank_pids: Sequence[int], session: int) -> CpuSnapshot:
        ranks = {p: c for p in rank_pids if (c := cpu_seconds(p)) is not None}
        launcher = {
            p: c
            for p in session_pids(session)
            if p not in ranks and (c := cpu_seconds(p)) is not None
        }
        return cls(
            at=time.time(),
            ranks=ranks,
            launcher=launcher,
            bench=time.process_time(),
            machine=machine_busy_s(),
        )


@dataclass(frozen=True)
class CpuWindow:
    """CPU use between two snapshots, in cores (CPU seconds per wall second)."""

    wall_s: float = 0.0
    rank_cores: tuple[float, ...] = ()
    launcher_cores: float = math.nan
    bench_cores: float = math.nan
    machine_cores: float = math.nan

    @classmethod
    def between(cls, a: CpuSnapshot, b: CpuSnapshot) -> CpuWindow:
        wall = b.at - a.at
        if wall <= 0:
            return cls()

        def delta(x: dict[int, float], y: dict[int, float]) -> list[float]:
            # Only processes alive at both ends: one that started or ended inside the window
            # would count its whole life.
            return [(y[p] - x[p]) / wall for p in x if p in y]

        return cls(
            wall_s=wall,
            rank_cores=tuple(delta(a.ranks, b.ranks)),
            launcher_cores=sum(delta(a.launcher, b.launcher)),
            bench_cores=(b.bench - a.bench) / wall,
            machine_cores=(b.machine - a.machine) / wall,
        )

    @property
    def rank_busy(self) -> float:
        """Mean fraction of the window each rank spent on a core."""
        return statistics.mean(self.rank_cores) if self.rank_cores else math.nan

    @property
    def other_cores(self) -> float:
        """Cores used by everything that is not this job or this benchmark (other sessions)."""
        ours = sum(self.rank_cores) + self.launcher_cores + self.bench_cores
        return self.machine_cores - ours

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "rank_cores": [round(c, 3) for c in self.rank_cores],
            "launcher_cores": round(self.launcher_cores, 3),
            "bench_cores": round(self.bench_cores, 3),
            "machine_cores": round(self.machine_cores, 3),
            "other_cores": round(self.other_cores, 3),
        }


@dataclass
class JobTrace:
    """What watching one training job saw."""

    label: str
    ranks: int
    returncode: int | None = None
    submitted_at: float = 0.0
    first_rank_start: float | None = None
    first_iteration_at: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    cpu: CpuWindow = field(default_factory=CpuWindow)
    signal_sent_at: float | None = None
    restart_rank_start: float | None = None
    old_ranks_gone_at: float | None = None
    first_resumed_at: float | None = None
    stops: list[dict[str, Any]] = field(default_factory=list)
    record: RunRecord = field(default_factory=RunRecord)
    run_dir: str | None = None
    output_tail: str = ""

    @property
    def launch_s(self) -> float | None:
        """Submission (subprocess start) to the first finished iteration on disk."""
        if self.first_iteration_at is None:
            return None
        return self.first_iteration_at - self.submitted_at

    def window(self, first: int, last: int) -> list[dict[str, Any]]:
        """Progress records of iterations first..last (1-based, inclusive) of the first start."""
        seen: dict[int, dict[str, Any]] = {}
        for r in self.records:
            seen.setdefault(int(r["iteration"]), r)
        return [seen[i] for i in range(first, last + 1) if i in seen]


@dataclass
class _Watch:
    """Mutable state of the polling loop of `watch_job`."""

    pids: set[int] = field(default_factory=set)
    cpu_start: CpuSnapshot | None = None
    stop_iteration: int | None = None
    next_pid_scan: float = 0.0
    signaled: set[int] = field(default_factory=set)
    iterations: int = 0
    """Iterations on disk at the last poll."""
    iteration_s: float = 0.0
    """The last iteration's duration (0 until two are on disk)."""


def find_run_dir(log_root: Path) -> Path | None:
    runs = [p for p in log_root.glob("*/*") if p.is_dir() and not p.name.startswith(".")]
    return runs[0] if len(runs) == 1 else None


def measured_records(side: str, output: str, cwd: Path, iterations: int) -> list[dict[str, Any]]:
    """Return iterations 2..`iterations` of one side of the mjlab comparison.

    mjlab's own train (`mjlab_train`) is parsed from its console `output`; ours is read from
    its progress.jsonl.
    """
    if side == "mjlab_train":
        records = parse_rsl_rl_log(output)
    else:
        run = find_run_dir(cwd / "logs")
        records = read_jsonl(run / PROGRESS) if run is not None else []
    return [r for r in records if 2 <= r["iteration"] <= iterations]


def watch_job(
    cmd: Sequence[str],
    *,
    label: str,
    ranks: int,
    log_root: Path,
    env: dict[str, str],
    cpu_window: tuple[int, int] | None = None,
    signal_after: int | None = None,
    timeout_s: float = 300.0,
) -> JobTrace:
    """Run one training CLI to its end while polling its run directory.

    Times the first finished iteration, the CPU the ranks and the machine used between the
    iterations `cpu_window` (first, last) were written, and with `signal_after` sends USR2 to
    every rank once that many iterations are on disk, then times the restart and resume.
    """
    trace = JobTrace(label=label, ranks=ranks)
    log_root.mkdir(parents=True, exist_ok=True)
    out_path = log_root / f"{label}.out"
    state = _Watch()
    in_process = "mjlab-submit" not in Path(cmd[0]).name
    with open(out_path, "w") as out:
        trace.submitted_at = time.time()
        # A session of its own, so that a failure can end the whole job (launcher and ranks).
        proc = subprocess.Popen(
            list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                done = proc.poll() is not None
                _poll_once(trace, state, proc, log_root, in_process, cpu_window, signal_after)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: no end within {timeout_s:.0f} s")
                # Slow only well inside the window (its end and the signal after it are timed
                # by polling) and with iterations longer than a slow poll (none is skipped).
                ends = [x for x in (cpu_window and cpu_window[1], signal_after) if x]
                measuring = (
                    state.cpu_start is not None
                    and trace.cpu.wall_s == 0.0
                    and state.iteration_s > _POLL_MEASURED_S
                    and all(state.iterations < end - 1 for end in ends)
                )
                time.sleep(_POLL_MEASURED_S if measuring else _POLL_S)
        finally:
            if proc.poll() is None:
                kill_job(proc)
            trace.returncode = proc.returncode
    trace.output_tail = out_path.read_text(errors="replace")[-3000:]
    run = find_run_dir(log_root)
    if run is not None:
        trace.run_dir = str(run)
        trace.records = read_jsonl(run / PROGRESS)
        trace.stops = read_jsonl(run / RESTARTS)
        trace.record = read_record(run)
    return trace


def _poll_once(
    trace: JobTrace,
    state: _Watch,
    proc: subprocess.Popen[Any],
    log_root: Path,
    in_process: bool,
    cpu_window: tuple[int, int] | None,
    signal_after: int | None,
) -> None:
    now = time.time()
    run = find_run_dir(log_root)
    # The ranks: the CLI itself when it trains in-process, else the local executor's tasks.
    if in_process:
        pids = [proc.pid]
    elif (
        run is not None
        and now >= state.next_pid_scan
        # Scanning /proc costs the measured ranks a share of a core: only until every rank
        # of the first start is known, and again once the signal asks for a restart.
        and (len(state.pids) < trace.ranks or trace.signal_sent_at is not None)
    ):
        pids = rank_pids(run / SUBMITIT_DIR)
        state.next_pid_scan = now + 0.1
    else:
        pids = sorted(state.pids)
    new = [p for p in pids if p not in state.pids]
    if new:
        starts = [s for s in (start_time(p) for p in new) if s is not None]
        if starts and trace.first_rank_start is None:
            trace.first_rank_start = min(starts)
        elif starts and trace.signal_sent_at is not None and trace.restart_rank_start is None:
            trace.restart_rank_start = min(starts)
        state.pids.update(new)
    if run is None:
        return
    records = read_jsonl(run / PROGRESS)
    if records and trace.first_iteration_at is None:
        trace.first_iteration_at = now
    done_its = state.iterations = len(records)
    if done_its >= 2:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            state.iteration_s = float(records[-1]["time"]) - float(records[-2]["time"])
    if cpu_window is not None and state.cpu_start is None and done_its >= cpu_window[0]:
        state.cpu_start = CpuSnapshot.take(pids, proc.pid)
    if (
        cpu_window is not None
        and state.cpu_start is not None
        and trace.cpu.wall_s == 0.0
        and done_its >= cpu_window[1]
    ):
        trace.cpu = CpuWindow.between(state.cpu_start, CpuSnapshot.take(pids, proc.pid))
    if signal_after is not None and trace.signal_sent_at is None and done_its >= signal_after:
        trace.signal_sent_at = time.time()
        state.signaled = set(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
    gone = state.signaled and not any(procs.alive(p) for p in state.signaled)
    if gone and trace.old_ranks_gone_at is None:
        trace.old_ranks_gone_at = now
    if trace.signal_sent_at is not None and state.stop_iteration is None:
        stops = read_jsonl(run / RESTARTS)
        if stops:
            state.stop_iteration = int(stops[0]["iteration"])
    if (
        state.stop_iteration is not None
        and trace.restart_rank_start is not None
        and trace.first_resumed_at is None
        and any(int(r["iteration"]) > state.stop_iteration for r in records)
    ):
        trace.first_resumed_at = now


def launch_parts(trace: JobTrace) -> dict[str, float | None]:
    """Split a job's launch time into the launcher's part and the rank's.

    The launcher's runs until a rank process exists; the rank's covers its imports, process
    group, environment and first iteration.
    """
    rank_start = trace.first_rank_start
    return {
        "total_s": trace.launch_s,
        "to_rank_start_s": rank_start - trace.submitted_at if rank_start else None,
        "rank_to_first_iteration_s": (
            trace.first_iteration_at - rank_start
            if rank_start and trace.first_iteration_at
            else None
        ),
    }


def recovery(trace: JobTrace) -> dict[str, Any]:
    """Recovery figures of a job that was sent USR2 (empty when it never stopped)."""
    if not trace.stops:
        return {}
    stop = trace.stops[0]
    starts = trace.record.starts
    resumed_from = starts[1].resumed_from_iteration if len(starts) > 1 else None
    before = [
        int(r["iteration"]) for r in trace.records if int(r["iteration"]) <= stop["iteration"]
    ]
    out: dict[str, Any] = {
        "stop_iteration": stop["iteration"],
        "signal_to_checkpoint_s": stop["checkpoint_at"] - stop["signal_at"],
        "checkpoint_write_s": stop.get("checkpoint_s"),
        "resumed_from": resumed_from,
        "iterations_lost": (
            max(before) - resumed_from if before and resumed_from is not None else None
        ),
        "completed": trace.returncode == 0
        and sorted({int(r["iteration"]) for r in trace.records})
        == list(range(1, max(int(r["iteration"]) for r in trace.records) + 1)),
    }
    iter_s = median_iteration_s(trace.records)
    out["stop_iterations"] = out["signal_to_checkpoint_s"] / iter_s if iter_s > 0 else None
    first = (
        trace.first_iteration_at - trace.first_rank_start
        if trace.first_iteration_at and trace.first_rank_start
        else None
    )
    again = (
        trace.first_resumed_at - trace.restart_rank_start
        if trace.first_resumed_at and trace.restart_rank_start
        else None
    )
    out["first_start_to_iteration_s"] = first
    out["restart_to_resumed_iteration_s"] = again
    out["checkpoint_to_ranks_exited_s"] = (
        trace.old_ranks_gone_at - stop["checkpoint_at"] if trace.old_ranks_gone_at else None
    )
    out["ranks_exited_to_restart_s"] = (
        trace.restart_rank_start - trace.old_ranks_gone_at
        if trace.restart_rank_start and trace.old_ranks_gone_at
        else None
    )
    out["signal_to_resumed_iteration_s"] = (
        trace.first_resumed_at - stop["signal_at"] if trace.first_resumed_at else None
    )
    out["resume_ratio"] = again / first if first and again else None
    return out

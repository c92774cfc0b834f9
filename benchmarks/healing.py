"""Self-healing figures: a 2-rank local job (`mjlab-train --num-procs 2`) with a crash (rank 1
killed by SIGKILL) and one with a hang (rank 1 frozen by SIGSTOP, `--hang-timeout-s`), each
injected once at a fixed iteration (MJLAB_HPC_FAULT): seconds from the fault to the first
resumed iteration, and iterations computed again. No scheduler is involved, so no requeue
delay is counted (the Slurm tests measure Slurm's).

And the run directory's writer lock under contention (`lock_contention`): 128 processes wait
for one run's lock while its holder is killed by SIGKILL; one takes it over once the lease
has expired, then every other gets it in turn, one at a time."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.stats import Figure
from benchmarks.watch import cli, find_run_dir
from mjlab_hpc.rundir.lock import LeaseLock, OwnerInfo
from mjlab_hpc.rundir.state import read_record

__all__ = [
    "HANG_TIMEOUT_S",
    "LOCK_CONTENDERS",
    "LOCK_LEASE_S",
    "healing_figures",
    "lock_contention",
    "lock_figures",
    "lock_summary",
    "run_healing",
    "run_lock",
]

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


# --- the writer lock with many contenders ---------------------------------------------------

#: Processes contending for one run directory's lock (a 128-rank job's restart, or many
#: launches of the same run at once).
LOCK_CONTENDERS = 128
#: Lease of the measured lock: short, so a takeover is measured in seconds (runs use 30 s).
LOCK_LEASE_S = 2.0


def _lock_holder(path: str, lease_s: float, ready: str) -> None:
    # As on another node (a lost one): nobody here can ask for its process, so a takeover
    # waits for a lease of unchanged heartbeat (on this machine it would follow the kill).
    owner = dataclasses.replace(OwnerInfo.from_env(rank=0), machine="another node")
    lock = LeaseLock(path, owner=owner, lease_s=lease_s)
    Path(ready).write_text(str(lock.acquire(timeout_s=60)))
    while True:  # heartbeats until SIGKILL
        time.sleep(1)


def _lock_contender(path: str, record: str, rank: int, lease_s: float, hold_s: float,
                    start: Any) -> None:  # fmt: skip
    lock = LeaseLock(path, owner=OwnerInfo.from_env(rank=rank), lease_s=lease_s)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start.wait()
    token = lock.acquire(timeout_s=300)
    entered = time.time()
    time.sleep(hold_s)
    # One write() per line on an O_APPEND fd: lines of several processes never interleave.
    os.write(fd, f"{token} {os.getpid()} {entered:.6f} {time.time():.6f} "
                 f"{int(lock.displaced is not None)}\n".encode())  # fmt: skip
    lock.release()
    os.close(fd)


def lock_contention(work: Path, contenders: int = LOCK_CONTENDERS, lease_s: float = LOCK_LEASE_S,
                    hold_s: float = 0.002) -> dict[str, Any]:  # fmt: skip
    """`contenders` forked processes wait (the lock's default polling) for a lock held by a
    live holder, which is then killed by SIGKILL. Each records one line when it holds the
    lock: token, pid, time it got it, time it let go, whether it displaced a stale holder.
    Returns those rows (by the time they got the lock), the kill and the dead holder's last
    heartbeat; no process is left behind."""
    ctx = mp.get_context("fork")
    work.mkdir(parents=True, exist_ok=True)
    path, record, ready = work / "writer.lock", work / "record.log", work / "ready"
    holder = ctx.Process(target=_lock_holder, args=(str(path), lease_s, str(ready)))
    start = ctx.Event()
    procs = [
        ctx.Process(target=_lock_contender,
                    args=(str(path), str(record), i + 1, lease_s, hold_s, start))
        for i in range(contenders)
    ]  # fmt: skip
    try:
        holder.start()
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in procs:
            p.start()
        started = time.time()
        start.set()
        time.sleep(min(1.0, lease_s / 2))  # every contender polls a live, heartbeating lock
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.time()
        holder.join(10)
        dead = LeaseLock(path).holder()
        for p in procs:
            p.join(300)
        codes = [p.exitcode for p in procs]
    finally:
        for p in (holder, *procs):
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    rows = []
    for line in record.read_text().splitlines() if record.exists() else []:
        token, pid, got, left, displaced = line.split()
        rows.append((int(token), int(pid), float(got), float(left), bool(int(displaced))))
    rows.sort(key=lambda r: r[2])
    return {
        "contenders": contenders,
        "lease_s": lease_s,
        "hold_s": hold_s,
        "started_at": started,
        "killed_at": killed,
        "dead_token": dead.token if dead else None,
        "dead_heartbeat_at": dead.heartbeat_at if dead else None,
        "exit_codes": codes,
        "rows": rows,
        "lock_left": path.exists(),
    }


def lock_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Figures of a `lock_contention` run: takeover delay, handovers, overlaps."""
    rows = raw["rows"]
    if not rows:
        return {"contenders": raw["contenders"], "acquired": 0}
    gaps = [b[2] - a[3] for a, b in itertools.pairwise(rows)]
    overlaps = sum(1 for g in gaps if g < 0)
    ordered = sorted(rows, key=lambda r: r[0])
    heartbeat = raw["dead_heartbeat_at"] or raw["killed_at"]
    q = statistics.quantiles(gaps, n=20) if len(gaps) >= 2 else [0.0] * 19
    return {
        "contenders": raw["contenders"],
        "acquired": len(rows),
        "overlaps": overlaps,
        "tokens_in_time_order": [r[0] for r in rows] == [r[0] for r in ordered],
        "takeover_after_heartbeat_s": round(rows[0][2] - heartbeat, 3),
        "takeover_after_kill_s": round(rows[0][2] - raw["killed_at"], 3),
        "lease_s": raw["lease_s"],
        "handover_ms_median": round(1000 * statistics.median(gaps), 2) if gaps else None,
        "handover_ms_p95": round(1000 * q[18], 2),
        "handover_ms_max": round(1000 * max(gaps), 2) if gaps else None,
        "all_acquired_after_takeover_s": round(rows[-1][3] - rows[0][2], 2),
        "longest_wait_s": round(rows[-1][2] - raw["started_at"], 2),
    }


def run_lock(
    cfg: BenchConfig, say: Callable[[str], None], runs: Path
) -> tuple[dict[str, Any], list[str]]:
    """The lock contention, once per repeat (32 contenders with --quick); every run's summary
    and failures as lines."""
    n = 32 if cfg.quick else LOCK_CONTENDERS
    say(f"writer lock: {n} processes contend, the holder is killed by SIGKILL ({cfg.pairs}x)")
    done, failures = [], []
    for i in range(cfg.pairs):
        summary = lock_summary(lock_contention(runs / f"lock-{i}", contenders=n))
        if summary.get("acquired") != n or summary.get("overlaps"):
            failures.append(f"lock contention: {summary}")
            continue
        done.append(summary)
        say(f"  takeover {summary['takeover_after_heartbeat_s']:.2f} s after the dead holder's "
            f"last heartbeat (lease {summary['lease_s']:g} s); handover median "
            f"{summary['handover_ms_median']:.1f} ms, p95 {summary['handover_ms_p95']:.1f} ms; "
            f"all in {summary['all_acquired_after_takeover_s']:.1f} s")  # fmt: skip
    return {"contenders": n, "lease_s": LOCK_LEASE_S, "runs": done}, failures


def lock_figures(lock: dict[str, Any]) -> list[Figure]:
    """Takeover delay after the holder's death, and the median handover between contenders
    (one sample per repeat)."""
    runs, n, lease = lock.get("runs", []), lock.get("contenders"), float(lock["lease_s"])
    p95 = ", ".join(str(r["handover_ms_p95"]) for r in runs)
    return [
        Figure(
            "lock_takeover_s", f"lock takeover, lease {lease:g} s (s)",
            tuple(r["takeover_after_heartbeat_s"] for r in runs), lease + 1.0, "<=",
            f"{n} processes wait for a run's lock; its holder is killed by SIGKILL: seconds "
            f"from its last heartbeat to the first takeover (never before the lease, "
            f"{lease:g} s)", "lock",
        ),
        Figure(
            "lock_handover_ms", f"lock handover, {n} contenders (ms)",
            tuple(r["handover_ms_median"] for r in runs), 100.0, "<=",
            f"median ms from one holder's release to the next holder's acquisition while {n} "
            f"processes wait (default polling: 10 ms backing off to 0.5 s); p95 per repeat: "
            f"{p95} ms", "lock",
        ),
    ]  # fmt: skip

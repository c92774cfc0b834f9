"""The run directory's writer lock under contention, measured.

Many processes wait for one run's lock while its holder is killed by SIGKILL. One takes it
over once the lease has expired, then every other gets it in turn, one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.stats import Figure
from mjlab_hpc.rundir.lock import LeaseLock, OwnerInfo

__all__ = [
    "LOCK_CONTENDERS",
    "LOCK_LEASE_S",
    "lock_contention",
    "lock_figures",
    "lock_summary",
    "run_lock",
]

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


def _lock_contender(
    path: str, record: str, rank: int, lease_s: float, hold_s: float, start: Any
) -> None:
    lock = LeaseLock(path, owner=OwnerInfo.from_env(rank=rank), lease_s=lease_s)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start.wait()
    token = lock.acquire(timeout_s=300)
    entered = time.time()
    time.sleep(hold_s)
    # One write() per line on an O_APPEND fd: lines of several processes never interleave.
    os.write(
        fd,
        f"{token} {os.getpid()} {entered:.6f} {time.time():.6f} "
        f"{int(lock.displaced is not None)}\n".encode(),
    )
    lock.release()
    os.close(fd)


def lock_contention(
    work: Path,
    contenders: int = LOCK_CONTENDERS,
    lease_s: float = LOCK_LEASE_S,
    hold_s: float = 0.002,
) -> dict[str, Any]:
    """Kill a lock's live holder while `contenders` forked processes wait for the lock.

    The contenders poll as the lock does by default. Each records one line when it holds the
    lock: token, pid, time it got it, time it let go, whether it displaced a stale holder.
    Returns those rows (by the time they got the lock), the kill and the dead holder's last
    heartbeat; no process is left behind.
    """
    ctx = mp.get_context("fork")
    work.mkdir(parents=True, exist_ok=True)
    path, record, ready = work / "writer.lock", work / "record.log", work / "ready"
    holder = ctx.Process(target=_lock_holder, args=(str(path), lease_s, str(ready)))
    start = ctx.Event()
    procs = [
        ctx.Process(
            target=_lock_contender, args=(str(path), str(record), i + 1, lease_s, hold_s, start)
        )
        for i in range(contenders)
    ]
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
    """Sum up a `lock_contention` run: takeover delay, handovers, overlaps."""
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
    """Run the lock contention once per repeat (fewer contenders with --quick).

    Returns every run's summary, and failures as lines.
    """
    n = 32 if cfg.quick else LOCK_CONTENDERS
    say(f"writer lock: {n} processes contend, the holder is killed by SIGKILL ({cfg.pairs}x)")
    done, failures = [], []
    for i in range(cfg.pairs):
        summary = lock_summary(lock_contention(runs / f"lock-{i}", contenders=n))
        if summary.get("acquired") != n or summary.get("overlaps"):
            failures.append(f"lock contention: {summary}")
            continue
        done.append(summary)
        say(
            f"  takeover {summary['takeover_after_heartbeat_s']:.2f} s after the dead holder's "
            f"last heartbeat (lease {summary['lease_s']:g} s); handover median "
            f"{summary['handover_ms_median']:.1f} ms, p95 {summary['handover_ms_p95']:.1f} ms; "
            f"all in {summary['all_acquired_after_takeover_s']:.1f} s"
        )
    return {"contenders": n, "lease_s": LOCK_LEASE_S, "runs": done}, failures


def lock_figures(lock: dict[str, Any]) -> list[Figure]:
    """Report the takeover delay after the holder's death and the median handover.

    Each repeat gives one sample.
    """
    runs, n, lease = lock.get("runs", []), lock.get("contenders"), float(lock["lease_s"])
    p95 = ", ".join(str(r["handover_ms_p95"]) for r in runs)
    return [
        Figure(
            key="lock_takeover_s",
            label=f"lock takeover, lease {lease:g} s (s)",
            samples=tuple(r["takeover_after_heartbeat_s"] for r in runs),
            target=lease + 1.0,
            direction="<=",
            definition=(
                f"{n} processes wait for a run's lock; its holder is killed by SIGKILL: seconds "
                f"from its last heartbeat to the first takeover (never before the lease, "
                f"{lease:g} s)"
            ),
            section="lock",
        ),
        Figure(
            key="lock_handover_ms",
            label=f"lock handover, {n} contenders (ms)",
            samples=tuple(r["handover_ms_median"] for r in runs),
            target=100.0,
            direction="<=",
            definition=(
                f"median ms from one holder's release to the next holder's acquisition while {n} "
                f"processes wait (default polling: 10 ms backing off to 0.5 s); p95 per repeat: "
                f"{p95} ms"
            ),
            section="lock",
        ),
    ]

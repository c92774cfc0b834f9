"""The run record `run.json`: what ran, where, with which code, and every restart and why.

Kept by the writer of the run directory: created at the first start, updated at every
(re)start, stop and end. Tools (`mjlab-hpc status`, plots, people) read it instead of parsing
logs.
"""

from __future__ import annotations

import copy
import datetime as dt
import importlib.metadata
import json
import time
from pathlib import Path
from typing import Any

from mjlab_hpc.procs import run_command
from mjlab_hpc.rundir.layout import CANCEL_RECORD, RUN_RECORD

__all__ = [
    "cancel_marker",
    "git_commit",
    "interruptions",
    "now_iso",
    "on_end",
    "on_fault",
    "on_recovered",
    "on_start",
    "on_stop",
    "read_record",
    "versions",
]

_PACKAGES = ("torch", "warp-lang", "mujoco", "mujoco-warp", "rsl-rl-lib", "mjlab", "mjlab-hpc")


def now_iso(at: float | None = None) -> str:
    """The current time (or the epoch time `at`), ISO 8601 with the UTC offset."""
    when = dt.datetime.now(dt.timezone.utc) if at is None else dt.datetime.fromtimestamp(
        at, dt.timezone.utc)  # fmt: skip
    return when.astimezone().isoformat(timespec="seconds")


def versions() -> dict[str, str | None]:
    """Installed versions of the stack (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(path: Path) -> str | None:
    """The commit of the git checkout holding `path` (None outside a checkout)."""
    proc = run_command(["git", "-C", str(path), "rev-parse", "HEAD"], timeout_s=10)
    if proc is None or proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run record, or an empty dict when there is none yet."""
    path = run_dir / RUN_RECORD
    if not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text()))
    except json.JSONDecodeError:
        return {}


def on_start(
    record: dict[str, Any],
    *,
    spec: dict[str, Any],
    effective: dict[str, Any],
    job_id: str | None,
    restart_count: int,
    launch_mode: str,
    world_size: int,
    num_nodes: int,
    device: str,
    resumed_from: int,
    code_dir: Path,
    checkpoint: str | None = None,
    skipped: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The record after a (re)start of the run."""
    record = dict(record)
    record.setdefault("started_at", now_iso())
    record.setdefault("spec", spec)
    # What the task resolved to (envs per rank, total iterations, experiment): tools read these
    # instead of looking the task up again.
    record["effective"] = effective
    record.setdefault("restarts", [])
    record["state"] = "running"
    record["world_size"] = world_size
    record["num_nodes"] = num_nodes
    record["device"] = device
    record["launch_mode"] = launch_mode
    record["versions"] = versions()
    record["git_commit"] = git_commit(code_dir)
    starts = list(record.get("starts", []))
    starts.append(
        {
            "job_id": job_id,
            "restart_count": restart_count,
            "at": now_iso(),
            "resumed_from_iteration": resumed_from,
            "checkpoint": checkpoint,
            "skipped_checkpoints": list(skipped or []),
        }
    )
    if skipped:
        record["skipped_checkpoints"] = [*record.get("skipped_checkpoints", []), *skipped]
    record.pop("failure", None)
    record["starts"] = starts
    record["job_ids"] = sorted({s["job_id"] for s in starts if s["job_id"]})
    return record


def on_stop(record: dict[str, Any], stop: dict[str, Any]) -> dict[str, Any]:
    """The record after a stop with a checkpoint (for a requeue, or for good)."""
    record = dict(record)
    record["restarts"] = [*record.get("restarts", []), stop]
    record["state"] = "stopped"
    record["stopped_at"] = now_iso()
    return record


def on_fault(record: dict[str, Any], fault: dict[str, Any], requeued: bool) -> dict[str, Any]:
    """The record after a crash or hang of a start (`faults`): requeued, or the run failed."""
    record = dict(record)
    record["faults"] = [*record.get("faults", []), fault]
    record["state"] = "requeued" if requeued else "failed"
    record["ended_at" if not requeued else "stopped_at"] = now_iso()
    return record


def interruptions(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stop (`restarts`) and fault (`faults`) of the run, oldest first; each has a
    `reason` (time-limit, preemption, node-lost, crash, hang, interrupt, ...)."""

    def when(entry: dict[str, Any]) -> float:
        return float(entry.get("at_s") or entry.get("signal_at") or entry.get("checkpoint_at") or 0)

    return sorted([*record.get("restarts", []), *record.get("faults", [])], key=when)


def on_recovered(record: dict[str, Any], resumed_from: int) -> dict[str, Any]:
    """The record once the first iteration after a requeue-type interruption completed: the
    interruption gets the time from fault (or stop signal) to that iteration and how many
    iterations were computed again."""
    record = copy.deepcopy(record)
    pending = [e for e in interruptions(record)
               if e.get("kind") == "requeue" and "recovered_at" not in e]  # fmt: skip
    if not pending:
        return record
    entry = pending[-1]
    began = float(entry.get("at_s") or entry.get("signal_at") or 0)
    entry["recovered_at"] = now_iso()
    if began:
        entry["recovery_s"] = round(time.time() - began, 2)
    entry["resumed_from"] = resumed_from
    entry["recomputed"] = max(0, int(entry.get("iteration") or 0) - resumed_from)
    return record


def on_end(record: dict[str, Any], iterations: int, state: str = "completed") -> dict[str, Any]:
    """The record at the end of the run (completed), or of this start (failed, interrupted)."""
    record = dict(record)
    record["state"] = state
    record["ended_at"] = now_iso()
    record["iterations"] = iterations
    return record


def cancel_marker(run_dir: Path, record: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The record `mjlab-hpc cancel` left (`cancelled.json`), if it came after the run's
    latest start (a cancel before a resume is over); `record`: run.json, if already read."""
    try:
        marker = dict(json.loads((run_dir / CANCEL_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    starts = (read_record(run_dir) if record is None else record).get("starts") or [{}]
    # ISO 8601 with the same offset sorts as text; a start after the cancel wins.
    return marker if str(marker.get("at", "")) >= str(starts[-1].get("at", "")) else None

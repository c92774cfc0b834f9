"""What state a run is in: from Slurm (squeue, sacct) for Slurm jobs, from this machine's
processes for local jobs, else from the run's own files (run.json, the writer's lease lock,
`cancelled.json`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.ops.runs import RunJobs
from mjlab_hpc.rundir.layout import CANCEL_RECORD, WRITER_LOCK
from mjlab_hpc.rundir.lock import LeaseLock, LockError
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.slurm.client import SlurmClient

__all__ = ["JobState", "cancel_marker", "job_states", "record_state", "writer_alive"]


@dataclass(frozen=True)
class JobState:
    """A run's state and where it was read."""

    state: str
    """Slurm's state names (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...), STOPPED
    (stopped at a checkpoint for a requeue that has not come), LOST (the record says running
    but nothing runs it), UNKNOWN."""
    source: Literal["squeue", "sacct", "process", "record", "lock", "none"]
    active: bool
    nodes: int | None = None
    gpus_per_node: int | None = None


def cancel_marker(run_dir: Path) -> dict[str, Any] | None:
    """The cancel record, if the run was cancelled after its last start."""
    try:
        marker = dict(json.loads((run_dir / CANCEL_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    starts = read_record(run_dir).get("starts", [])
    last_start = str(starts[-1].get("at", "")) if starts else ""
    # ISO 8601 with the same offset sorts as text; a start after the cancel wins.
    return marker if str(marker.get("at", "")) >= last_start else None


def writer_alive(run_dir: Path) -> bool:
    """Whether the run's writer heartbeats its lease lock (whatever launched it)."""
    path = run_dir / WRITER_LOCK
    if not path.exists():
        return False
    try:
        holder = LeaseLock(path).holder()
    except LockError:
        return False
    if holder is None or holder.owner is None or holder.lease_s is None:
        return False
    return holder.age_s() < holder.lease_s


def record_state(run_dir: Path) -> JobState:
    """The state the run's own files tell: run.json, the cancel record and the writer lock."""
    record = read_record(run_dir)
    state = str(record.get("state", ""))
    if state == "running" and writer_alive(run_dir):
        return JobState("RUNNING", "lock", True, record.get("num_nodes"))
    if cancel_marker(run_dir) is not None:
        return JobState("CANCELLED", "record", False, record.get("num_nodes"))
    mapped = {
        "completed": "COMPLETED",
        "failed": "FAILED",
        "stopped": "STOPPED",
        "interrupted": "INTERRUPTED",
        "running": "LOST",
    }.get(state)
    if mapped is None:
        return JobState("UNKNOWN", "none", False)
    return JobState(mapped, "record", False, record.get("num_nodes"))


def job_states(
    runs: Sequence[RunJobs], slurm: SlurmClient | None = None
) -> tuple[dict[Path, JobState], bool | None]:
    """Every run's state (one squeue and one sacct call for all Slurm runs), and whether
    accounting answered (None: no Slurm run asked)."""
    slurm = slurm or SlurmClient()
    slurm_ids = [r.current for r in runs if r.kind == "slurm" and r.current]
    rows, accounting = slurm.query(slurm_ids) if slurm_ids else ({}, None)
    out: dict[Path, JobState] = {}
    for run in runs:
        row = rows.get(run.current or "") if run.kind == "slurm" else None
        if row is not None:
            active = not row.final
            out[run.run_dir] = JobState(row.state, row.source, active, row.nodes, row.gpus_per_node)
        elif run.kind == "local" and local_processes(run.run_dir):
            out[run.run_dir] = JobState("RUNNING", "process", True, 1)
        else:
            out[run.run_dir] = record_state(run.run_dir)
    return out, accounting if slurm_ids else None

"""What state a run is in: from Slurm (squeue, sacct) for Slurm jobs, from this machine's
processes for local jobs, else from the run's own files (run.json, the writer's lease lock,
`cancelled.json`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.ops.runs import RunJobs
from mjlab_hpc.rundir.layout import WRITER_LOCK
from mjlab_hpc.rundir.lock import LeaseLock, LockError
from mjlab_hpc.rundir.record import cancel_marker, read_record
from mjlab_hpc.slurm.client import SlurmAnswer, SlurmClient, SlurmRow

__all__ = ["JobState", "job_states", "record_state", "writer_alive"]


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


def _current_row(run: RunJobs, rows: dict[str, SlurmRow]) -> SlurmRow | None:
    """The row of the run's job that runs or waits (the first of a chain that has not
    ended), else of its last job."""
    known = [rows[j] for j in run.job_ids if j in rows]
    return next((r for r in known if not r.final), rows.get(run.current or ""))


def job_states(
    runs: Sequence[RunJobs], slurm: SlurmClient | None = None
) -> tuple[dict[Path, JobState], SlurmAnswer | None]:
    """Every run's state, and what Slurm answered (None: no Slurm run asked). One squeue and
    one sacct call for all Slurm runs together, however many runs and array elements."""
    slurm = slurm or SlurmClient()
    # Every job of a run: in a --chain the current one is the first that has not ended.
    slurm_ids = [j for r in runs if r.kind == "slurm" for j in r.job_ids]
    answer = slurm.answer(slurm_ids) if slurm_ids else None
    rows = answer.rows if answer else {}
    out: dict[Path, JobState] = {}
    for run in runs:
        row = _current_row(run, rows) if run.kind == "slurm" else None
        if row is not None:
            active = not row.final
            out[run.run_dir] = JobState(row.state, row.source, active, row.nodes, row.gpus_per_node)
        elif run.kind == "local" and local_processes(run.run_dir):
            out[run.run_dir] = JobState("RUNNING", "process", True, 1)
        else:
            out[run.run_dir] = record_state(run.run_dir)
    return out, answer

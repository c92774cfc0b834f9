"""What a run is doing, from its own files.

The run record `run.json` (`rundir.record`), the writer's lease lock and `cancelled.json`
tell the run's state without Slurm (`record_state`). How each rank's latest start ended is
`ends`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.convert import Count
from mjlab_hpc.rundir.durable import write_json_atomic
from mjlab_hpc.rundir.layout import CANCEL_RECORD, WRITER_LOCK
from mjlab_hpc.rundir.lock import LeaseLock, LockError
from mjlab_hpc.rundir.record import RunRecord, RunState, read_record
from mjlab_hpc.rundir.typed import plain, read_optional

__all__ = [
    "CancelRecord",
    "JobState",
    "cancel_marker",
    "record_state",
    "write_cancel_record",
    "writer_alive",
]


@dataclass(frozen=True)
class CancelRecord:
    """`cancelled.json`: the user cancelled the run's jobs (`mjlab-hpc cancel`)."""

    at: str = ""
    """When, ISO 8601."""
    by: str = ""
    """Who: `user@host`."""
    job_ids: tuple[str, ...] = ()
    """The jobs cancelled."""
    starts: Count | None = None
    """How many starts the run had then: a later one (a resume) is not cancelled (None:
    older records, compared by time)."""


def write_cancel_record(run_dir: Path, record: CancelRecord) -> None:
    """Write the cancel record (OSError when the run is not writable by this user)."""
    write_json_atomic(run_dir / CANCEL_RECORD, plain(record))


def cancel_marker(
    run_dir: Path, record: RunRecord | None = None, unread: list[str] | None = None
) -> CancelRecord | None:
    """Return the record `mjlab-hpc cancel` left (`cancelled.json`), if it still holds.

    It holds when it came after the run's latest start: a resume ends an earlier cancel.
    `record` is run.json, if already read. A damaged one is named in `unread`: no cancel.
    """
    if (marker := read_optional(CancelRecord, run_dir / CANCEL_RECORD, run_dir, unread)) is None:
        return None
    starts = (read_record(run_dir) if record is None else record).starts
    if marker.starts is not None:  # a start after the cancel (a resume) wins
        return marker if max(1, len(starts)) <= marker.starts else None
    # Older records: ISO 8601 with the same offset sorts as text.
    last = starts[-1].at if starts else ""
    return marker if marker.at >= last else None


@dataclass(frozen=True)
class JobState:
    """A run's state and where it was read."""

    state: str
    """Slurm's state names (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...), or what the
    record's `RunState` shows as (`RunState.status_name`: STOPPED, INTERRUPTED, LOST: the
    record says running but nothing runs it), UNKNOWN, DAMAGED."""
    source: Literal["squeue", "sacct", "process", "record", "lock", "none"]
    active: bool
    nodes: int | None = None
    gpus_per_node: int | None = None
    reason: str | None = None
    """Slurm's reason: why the job pends, or why it ended without running."""
    disagrees: str | None = None
    """What Slurm says, where the run's own record says otherwise and wins."""


def writer_alive(run_dir: Path) -> bool:
    """Whether the run's writer lives (whatever launched it): `LeaseLock.live_holder`."""
    path = run_dir / WRITER_LOCK
    if not path.exists():
        return False
    try:
        return LeaseLock(path).live_holder() is not None
    except LockError:
        return False


def record_state(run_dir: Path) -> JobState:
    """The state the run's own files tell: run.json, the cancel record and the writer lock."""
    record = read_record(run_dir)
    nodes = record.num_nodes
    alive = record.state == RunState.RUNNING and writer_alive(run_dir)
    if alive:
        return JobState("RUNNING", "lock", active=True, nodes=nodes)
    if cancel_marker(run_dir, record) is not None:
        return JobState("CANCELLED", "record", active=False, nodes=nodes)
    mapped = record.state.status_name(alive) if record.state is not None else None
    if mapped is None:
        return JobState("UNKNOWN", "none", active=False)
    return JobState(mapped, "record", active=False, nodes=nodes)

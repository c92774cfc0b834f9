"""What a run is doing, from its own files.

The run record `run.json` says what ran, where, with which code, and every start, stop and
fault; the writer of the run directory keeps it, and one reader checks its shape. With the
writer's lease lock and `cancelled.json` it tells the run's state without Slurm
(`record_state`). How each rank's latest start ended is `ends`'s.
"""

from __future__ import annotations

import copy
import datetime as dt
import importlib.metadata
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.procs import run_command
from mjlab_hpc.rundir.durable import read_regular
from mjlab_hpc.rundir.layout import (
    CANCEL_RECORD,
    RUN_RECORD,
    WRITER_LOCK,
)
from mjlab_hpc.rundir.lock import LeaseLock, LockError
from mjlab_hpc.spec import NOT_RUN_SETTINGS

__all__ = [
    "IN_ALLOCATION",
    "RESTARTED",
    "JobState",
    "cancel_marker",
    "changed_settings",
    "git_commit",
    "interruptions",
    "now_iso",
    "on_end",
    "on_fault",
    "on_node_failed",
    "on_preempted",
    "on_recovered",
    "on_start",
    "on_stop",
    "read_record",
    "record_state",
    "requeues_so_far",
    "resized_by_healer",
    "versions",
    "writer_alive",
]

log = logging.getLogger("mjlab_hpc")

#: A fault's `kind` when the run started again in the same allocation (a new srun step, or
#: the local controller's new ranks); RESTARTED: every kind that started the run again.
IN_ALLOCATION = "in-allocation"
RESTARTED = ("requeue", IN_ALLOCATION)

_PACKAGES = ("torch", "warp-lang", "mujoco", "mujoco-warp", "rsl-rl-lib", "mjlab", "mjlab-hpc")


def now_iso(at: float | None = None) -> str:
    """The current time (or the epoch time `at`), ISO 8601 with the UTC offset."""
    when = (
        dt.datetime.now(dt.timezone.utc)
        if at is None
        else dt.datetime.fromtimestamp(at, dt.timezone.utc)
    )
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


# run.json's fields and the JSON type every reader relies on; entries of the lists are objects.
_SHAPE = {
    "state": str,
    "spec": dict,
    "effective": dict,
    "failure": dict,
    "code": dict,
    "starts": list,
    "restarts": list,
    "faults": list,
    "job_ids": list,
    "stragglers": list,
}


def _shape_problem(value: object) -> str | None:
    if not isinstance(value, dict):
        return f"it holds {json.dumps(value)[:40]}, not a JSON object"
    wrong = [
        k
        for k, kind in _SHAPE.items()
        if value.get(k) is not None and not isinstance(value[k], kind)
    ]
    lists = ("starts", "restarts", "faults", "stragglers")
    if not wrong and any(not isinstance(e, dict) for k in lists for e in value.get(k) or []):
        return "an entry of its starts, restarts, faults or stragglers is not a JSON object"
    return f"its {wrong[0]!r} is {json.dumps(value[wrong[0]])[:40]}" if wrong else None


def read_record(run_dir: Path, strict: bool = False, set_aside: bool = False) -> dict[str, Any]:
    """Read the run record, {} when there is none yet; the one reader of run.json.

    It checks the record's shape as well as its syntax. A damaged record reads as {} (no
    command ends in a traceback), or with `strict` raises DamagedRecord naming it. With
    `set_aside` (a writer about to write anew) it is kept as `run.json.damaged-<time>`,
    named in `damaged_records`.
    """
    path = run_dir / RUN_RECORD
    value: Any = None
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # a directory, a device, far too large: no record
        problem = str(exc).removeprefix(f"{RUN_RECORD} ")
    else:
        try:
            value = json.loads(data)
            problem = _shape_problem(value)
        except (ValueError, UnicodeDecodeError):
            problem = "it is not JSON"
    if problem is None:
        return dict(value)
    if strict:
        raise DamagedRecord(
            path,
            problem,
            f"move it aside (a resume keeps it as {RUN_RECORD}"
            ".damaged-<time> and begins a new record)",
        )
    if not set_aside:
        return {}
    kept = path.with_name(f"{RUN_RECORD}.damaged-{dt.datetime.now():%Y%m%d-%H%M%S}")
    os.replace(path, kept)
    log.warning("%s was damaged (%s): kept as %s, a new record begins", path, problem, kept.name)
    return {"damaged_records": [kept.name]}


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
    environments: str = "new",
    skipped: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Return the record after a (re)start of the run.

    `spec` is the run's settings from now on. The start says what changed (`changed`:
    {field: [before, now]}) and whether its environments were `restored`, `fresh`
    (--fresh-envs) or `new`.
    """
    record = dict(record)
    record.setdefault("started_at", now_iso())
    changed = changed_settings(record.get("spec") or {}, spec)
    if record.get("world_size") not in (None, world_size):
        changed["world_size"] = [record["world_size"], world_size]
    record["spec"] = spec
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
            "environments": environments,
            "changed": changed,
            "skipped_checkpoints": list(skipped or []),
        }
    )
    if skipped:
        record["skipped_checkpoints"] = [*record.get("skipped_checkpoints", []), *skipped]
    record.pop("failure", None)
    record.pop("stragglers", None)  # measured afresh in every start
    record["starts"] = starts
    record["job_ids"] = sorted({s["job_id"] for s in starts if s["job_id"]})
    return record


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> dict[str, list[Any]]:
    """Return the run's settings (TrainSpec fields, as dicts) that differ: {field: [before, now]}.

    --num-procs is not one: the number of ranks is (`world_size`), whatever flag gave it.
    """
    return {
        key: [before[key], value]
        for key, value in now.items()
        if key in before
        and key not in NOT_RUN_SETTINGS
        and key != "num_procs"
        and before[key] != value
    }


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
    """Return every stop (`restarts`) and fault (`faults`) of the run, oldest first.

    Each has a `reason` (time-limit, preemption, node-lost, crash, hang, interrupt, ...).
    """

    def when(entry: dict[str, Any]) -> float:
        return float(entry.get("at_s") or entry.get("signal_at") or entry.get("checkpoint_at") or 0)

    return sorted([*record.get("restarts", []), *record.get("faults", [])], key=when)


def on_recovered(record: dict[str, Any], resumed_from: int) -> dict[str, Any]:
    """Return the record once the first iteration after a requeue-type interruption completed.

    The interruption gets the time from the fault (or stop signal) to that iteration, and how
    many iterations were computed again.
    """
    record = copy.deepcopy(record)
    pending = [
        e for e in interruptions(record) if e.get("kind") in RESTARTED and "recovered_at" not in e
    ]
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
    """Return the record `mjlab-hpc cancel` left (`cancelled.json`), if it still holds.

    It holds when it came after the run's latest start: a resume ends an earlier cancel.
    `record` is run.json, if already read.
    """
    try:
        marker = dict(json.loads(read_regular(run_dir / CANCEL_RECORD)))
    except (OSError, ValueError, TypeError):
        return None
    starts = (read_record(run_dir) if record is None else record).get("starts") or [{}]
    if isinstance(marker.get("starts"), int):  # a start after the cancel (a resume) wins
        return marker if len(starts) <= marker["starts"] else None
    # Older records: ISO 8601 with the same offset sorts as text.
    return marker if str(marker.get("at", "")) >= str(starts[-1].get("at", "")) else None


def requeues_so_far(record: dict[str, Any]) -> dict[str, int]:
    """Requeues of the run so far, by reason (time-limit, preemption, node-lost, crash, ...)."""
    counts: dict[str, int] = {}
    for entry in interruptions(record):
        if entry.get("kind", "requeue") in RESTARTED:
            reason = str(entry.get("reason"))
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def on_node_failed(
    record: dict[str, Any],
    job_id: str,
    restart_count: int,
    iteration: int,
    nodes: str,
    ended: str,
) -> dict[str, Any]:
    """Return the record when a job that Slurm requeued because a node failed starts again.

    sacct says NODE_FAIL, on `nodes`, at `ended`. The stop its ranks recorded (SIGTERM, taken
    for a preemption) becomes `node-lost`; when the node died before they could record
    anything, a `node-lost` fault is added.
    """
    record = copy.deepcopy(record)
    mine = _previous_start(record, job_id, restart_count)
    if mine:
        if mine[-1].get("reason") in ("preemption", "requeue"):
            mine[-1]["reason"] = "node-lost"
            mine[-1].setdefault("nodes", [nodes])
        return record
    try:
        at_s = dt.datetime.fromisoformat(ended).timestamp()  # sacct: local time
    except ValueError:
        at_s = time.time()
    record["faults"] = [
        *record.get("faults", []),
        {
            "reason": "node-lost",
            "kind": "requeue",
            "nodes": [nodes],
            "job_id": job_id,
            "restart_count": restart_count - 1,
            "iteration": iteration,
            "at": ended,
            "at_s": at_s,
            "action": "requeued by Slurm (NODE_FAIL)",
        },
    ]
    return record


def _previous_start(record: dict[str, Any], job_id: str, restart_count: int) -> list[Any]:
    """The stops and faults of the job's run before this restart."""
    return [
        e
        for e in interruptions(record)
        if e.get("job_id") == job_id
        and e.get("restart_count", restart_count - 1) == restart_count - 1
    ]


def on_preempted(record: dict[str, Any], job_id: str, restart_count: int) -> dict[str, Any]:
    """Return the record when a job whose previous run was preempted starts again.

    sacct says PREEMPTED. The stop its ranks took for a requeue by Slurm (PreemptMode=REQUEUE
    without GraceTime looks like one to them) becomes `preemption`.
    """
    record = copy.deepcopy(record)
    mine = _previous_start(record, job_id, restart_count)
    if mine and mine[-1].get("reason") == "requeue":
        mine[-1]["reason"] = "preemption"
        mine[-1].pop("why", None)
    return record


def resized_by_healer(record: dict[str, Any], world_size: int) -> bool:
    """Whether the healer changed the run's world size to or from `world_size`.

    That is a restart on fewer nodes (--min-nodes), or a later start of the job back on all
    of them. The ranks then take what the checkpoint holds of theirs.
    """
    sizes = [f.get("world_size") for f in record.get("faults") or []]
    return any(isinstance(s, list) and world_size in s for s in sizes)


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
    state = str(record.get("state", ""))
    nodes = record.get("num_nodes")
    if state == "running" and writer_alive(run_dir):
        return JobState("RUNNING", "lock", active=True, nodes=nodes)
    if cancel_marker(run_dir) is not None:
        return JobState("CANCELLED", "record", active=False, nodes=nodes)
    mapped = {
        "completed": "COMPLETED",
        "failed": "FAILED",
        "stopped": "STOPPED",
        "interrupted": "INTERRUPTED",
        "running": "LOST",
    }.get(state)
    if mapped is None:
        return JobState("UNKNOWN", "none", active=False)
    return JobState(mapped, "record", active=False, nodes=nodes)

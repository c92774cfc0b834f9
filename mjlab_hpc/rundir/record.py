"""The run record `run.json`: one typed, versioned record, read and written here only.

It says what ran, where, with which code, and every start, stop and fault. The run's writer
keeps it (`RunWriter.write_json(run.record, record.to_json())`); every reader gets a
`RunRecord` from `read_record`, checked field by field against the types below, and uses its
fields. Updates are immutable: each `on_*` returns a new record.

On disk it is the JSON object of `to_json` (the same keys as before the record had a type,
plus `"schema"`), read by the one converter (`mjlab_hpc.convert`). Records without `"schema"`
(written before it) read as they are; a null reads as the field's default, and keys this code
does not know are not kept. A record of a newer schema than ours is refused (`NewerRecord`),
never read as ours nor rewritten.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mjlab_hpc.convert import (
    Count,
    EpochS,
    Mismatch,
    NonNegative,
    Positive,
    Seconds,
    load,
    parse_json,
)
from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.procs import run_command
from mjlab_hpc.rundir.durable import read_regular
from mjlab_hpc.rundir.layout import RUN_RECORD, RunDir
from mjlab_hpc.rundir.typed import plain, read_json
from mjlab_hpc.spec import NOT_RUN_SETTINGS, TrainSpec

__all__ = [
    "IN_ALLOCATION",
    "RESTARTED",
    "SCHEMA",
    "Effective",
    "Failure",
    "Interruption",
    "NewerRecord",
    "RunRecord",
    "RunState",
    "RunSummary",
    "Skipped",
    "Start",
    "StopEntry",
    "Straggler",
    "changed_settings",
    "git_commit",
    "now_iso",
    "on_end",
    "on_fault",
    "on_node_failed",
    "on_preempted",
    "on_recovered",
    "on_start",
    "on_stop",
    "on_stop_answered",
    "on_stragglers",
    "read_record",
    "read_summary",
    "versions",
]

log = logging.getLogger("mjlab_hpc")

#: The version of run.json's layout that this code writes (records without one: before 1).
SCHEMA = 1

#: A fault's `kind` when the run started again in the same allocation (a new srun step, or
#: the local controller's new ranks); RESTARTED: every kind that started the run again.
IN_ALLOCATION = "in-allocation"
RESTARTED = ("requeue", IN_ALLOCATION)

_PACKAGES = ("torch", "warp-lang", "mujoco", "mujoco-warp", "rsl-rl-lib", "mjlab", "mjlab-hpc")


class RunState(enum.StrEnum):
    """A run's state in its own words: run.json's `state`, and how a start ended.

    The one vocabulary of `record_state`, `RunOutcome.state` and `status`: `status_name` maps
    each to the name status shows beside Slurm's (upper case).
    """

    RUNNING = "running"
    STOPPED = "stopped"
    """Stopped at a checkpoint (for a requeue that has not come, or for good)."""
    REQUEUED = "requeued"
    """Healed by a requeue after a fault; the next start has not begun."""
    FAILED = "failed"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    """A second Ctrl-C: ended at once, nothing saved since the last checkpoint."""
    REFUSED = "refused"
    """The ranks refused to start (a refused resume): an outcome, never in run.json."""
    UNKNOWN = "unknown"
    """No record says: an outcome, never in run.json."""

    def status_name(self, writer_alive: bool = False) -> str | None:
        """The state status shows for a run whose record says this (None: unknown).

        A record that says running while no writer holds the run is LOST.
        """
        if self is RunState.RUNNING:
            return "RUNNING" if writer_alive else "LOST"
        return _STATUS_NAMES.get(self)


_STATUS_NAMES = {
    RunState.COMPLETED: "COMPLETED",
    RunState.FAILED: "FAILED",
    RunState.STOPPED: "STOPPED",
    RunState.INTERRUPTED: "INTERRUPTED",
}


class _Entry:
    """JSON of a record's dataclass: its fields, without those still at their empty default."""

    _KEEP: ClassVar[frozenset[str]] = frozenset()
    """Fields written even when None or empty (tools find the key)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object for run.json."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name in self._KEEP or not _empty(value):
                out[f.name] = _dump(value)
        return out


def _empty(value: object) -> bool:
    if isinstance(value, _Entry):
        return not value.to_json()
    return value is None or (isinstance(value, tuple | Mapping) and not value)


def _dump(value: Any) -> Any:
    if isinstance(value, _Entry):
        return value.to_json()
    if isinstance(value, TrainSpec):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_dump(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


@dataclass(frozen=True)
class Skipped(_Entry):
    """A damaged checkpoint that a start skipped (and set aside)."""

    name: str
    """The checkpoint's file name."""
    why: str
    """What was wrong with it."""


@dataclass(frozen=True)
class Start(_Entry):
    """One (re)start of the run (`starts`)."""

    _KEEP = frozenset({"job_id", "checkpoint", "changed", "skipped_checkpoints"})

    job_id: str | None = None
    """The Slurm job, torchrun's run id, or None (a plain process)."""
    restart_count: Count = 0
    """SLURM_RESTART_COUNT (0: the job's first run)."""
    at: str = ""
    """When it started, ISO 8601."""
    resumed_from_iteration: Count = 0
    """The checkpoint's iteration (0: from scratch)."""
    checkpoint: str | None = None
    """The checkpoint it resumed from (a file name)."""
    environments: str = "new"
    """restored, fresh (--fresh-envs) or new."""
    changed: Mapping[str, Any] = field(default_factory=dict)
    """The settings it changed: {field: [before, now]}."""
    skipped_checkpoints: tuple[Skipped, ...] = ()
    """Damaged checkpoints it skipped."""


@dataclass(frozen=True)
class Interruption(_Entry):
    """A stop with a checkpoint (`restarts`) or a crash or hang (`faults`)."""

    _KEEP = frozenset({"job_id"})

    reason: str | None = None
    """time-limit, preemption, node-lost, requeue, interrupt, crash, hang, out-of-memory, ..."""
    error: str | None = None
    """A fault's error, for people."""
    ranks: tuple[Count, ...] = ()
    """A fault's ranks."""
    hosts: tuple[str, ...] = ()
    """Their hosts."""
    kind: str | None = None
    """requeue, stop (for good), failed, in-allocation (None: older records, a requeue)."""
    signal: str | None = None
    """A stop's signal (None: asked for by a file or the time limit)."""
    iteration: Count | None = None
    """The iteration of the stop's checkpoint, or the last before the fault."""
    job_id: str | None = None
    """The job whose start it ended."""
    restart_count: Count | None = None
    """That start's SLURM_RESTART_COUNT."""
    signal_at: EpochS | None = None
    """When the stop was asked for (epoch s)."""
    checkpoint_at: EpochS | None = None
    """When the stop's checkpoint was written (epoch s)."""
    checkpoint_s: Seconds | None = None
    """How long that took."""
    why: str | None = None
    """What asked for the stop, in words."""
    start: str | None = None
    """The srun step the stop ended (the batch script's name for it)."""
    nodes: tuple[str, ...] = ()
    """The nodes lost (node-lost)."""
    at: str | None = None
    """When the fault happened, ISO 8601."""
    at_s: EpochS | None = None
    """The same in epoch s."""
    healed_at: str | None = None
    """When the healer decided."""
    signature: str | None = None
    """Records before `failure`: the fault's error with its numbers blanked (equal for a
    repeat)."""
    failure_kind: str | None = None
    """What the rank that caused the fault said ended it (exception, peer-lost, environment,
    ...; `rundir.ends.FailureKind`), decided by the rank from the exception's type."""
    error_type: str | None = None
    """That rank's exception's type name (None: it ended without a word, or a hang)."""
    action: str | None = None
    """What was done about it, for people."""
    excluded_nodes: tuple[str, ...] = ()
    """The nodes the restart in the allocation left out."""
    straggler_nodes: tuple[str, ...] = ()
    """Of those, stragglers' nodes (slow, not broken)."""
    not_excluded: str | None = None
    """Why a suspect node was not left out."""
    world_size: tuple[Positive, Positive] | None = None
    """[before, now] when the restart ran on fewer nodes (--min-nodes)."""
    recovered_at: str | None = None
    """When the first iteration after it completed."""
    recovery_s: float | None = None
    """Seconds from it to that iteration (by two hosts' clocks: main wrote them below 0 when
    they disagree; this code writes None then)."""
    resumed_from: Count | None = None
    """The iteration the run resumed from."""
    recomputed: Count | None = None
    """Iterations computed again."""

    @property
    def when_s(self) -> float:
        """When it happened (epoch s; 0: not said)."""
        return float(self.at_s or self.signal_at or self.checkpoint_at or 0)

    @property
    def restarted(self) -> bool:
        """Whether the run started again after it (a requeue, or in the allocation)."""
        return (self.kind or "requeue") in RESTARTED


@dataclass(frozen=True)
class StopEntry(Interruption):
    """A stop with a checkpoint (`restarts`, and a line of restarts.jsonl)."""

    _KEEP = frozenset({"job_id", "signal", "signal_at"})


@dataclass(frozen=True)
class Failure(_Entry):
    """Why the run failed: the rank that failed first."""

    _KEEP = frozenset({"rank", "host"})

    kind: str | None = None
    """exception, peer-lost, out-of-memory, environment, crash, hang, ..."""
    error: str | None = None
    """Its error."""
    rank: Count | None = None
    """The rank."""
    host: str | None = None
    """Its host."""
    at: str | None = None
    """When, ISO 8601."""


@dataclass(frozen=True)
class Straggler(_Entry):
    """A rank consistently slower than the others (written by rank 0 while it trains)."""

    rank: Count | None = None
    """The rank."""
    host: str | None = None
    """Its host."""
    busy_s: Seconds | None = None
    """Its seconds of work per iteration."""
    others_s: Seconds | None = None
    """The others' (median)."""
    ratio: NonNegative | None = None
    """busy_s / others_s."""
    since: Count | None = None
    """The iteration since which it is slow."""
    text: str | None = None
    """For people."""


@dataclass(frozen=True)
class Effective(_Entry):
    """What the task resolved to: tools read these instead of looking the task up again."""

    task: str | None = None
    """The task."""
    source: str | None = None
    """Where it comes from (mjlab, builtin, ...)."""
    num_envs: Positive | None = None
    """Environments per rank."""
    max_iterations: Count | None = None
    """The run's total iterations."""
    experiment_name: str | None = None
    """The experiment (the folder under the log root)."""
    start_checkpoint: str | None = None
    """Weights it started from, when from elsewhere."""
    motion_file: str | None = None
    """The motion, for tracking tasks."""


@dataclass(frozen=True)
class RunRecord(_Entry):
    """run.json. An empty record (no file yet) has every field at its default."""

    _KEEP = frozenset({"git_commit", "restarts", "starts", "job_ids"})

    schema: int | None = None
    """The layout's version (SCHEMA when written; None: a record from before it had one)."""
    state: RunState | None = None
    """running, stopped, requeued, failed, completed or interrupted (None: no record)."""
    started_at: str | None = None
    """When the run first started, ISO 8601."""
    stopped_at: str | None = None
    """When it last stopped (or was requeued after a fault)."""
    ended_at: str | None = None
    """When it (or its latest start) ended."""
    spec: TrainSpec | None = None
    """The run's settings as of its latest start (a field older records lack: its default)."""
    effective: Effective = field(default_factory=Effective)
    """What the task resolved to."""
    world_size: Positive | None = None
    """Ranks of the latest start."""
    num_nodes: Positive | None = None
    """Its nodes."""
    device: str | None = None
    """Rank 0's device (cuda:0, cpu)."""
    launch_mode: str | None = None
    """slurm, submitit-local, single, torchrun."""
    versions: Mapping[str, str | None] = field(default_factory=dict)
    """The stack's installed versions (None: not installed)."""
    git_commit: str | None = None
    """The commit of the checkout it ran from (None: not a checkout)."""
    code: Mapping[str, Any] = field(default_factory=dict)
    """The submission's code record, and where the ranks imported from."""
    starts: tuple[Start, ...] = ()
    """Every (re)start, oldest first."""
    job_ids: tuple[str, ...] = ()
    """The jobs of the starts, sorted."""
    restarts: tuple[StopEntry, ...] = ()
    """Every stop with a checkpoint."""
    faults: tuple[Interruption, ...] = ()
    """Every crash or hang, and what the healer did."""
    skipped_checkpoints: tuple[Skipped, ...] = ()
    """Every damaged checkpoint skipped so far."""
    failure: Failure | None = None
    """Why the run failed (until it starts again)."""
    stragglers: tuple[Straggler, ...] = ()
    """Slow ranks now (measured afresh in every start)."""
    iterations: Count | None = None
    """Iterations done when it (or its latest start) ended."""
    damaged_records: tuple[str, ...] = ()
    """Damaged run.json files set aside (`run.json.damaged-<time>`) when this one began."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object for run.json, with the schema this code writes."""
        return {**super().to_json(), "schema": SCHEMA}

    @property
    def interruptions(self) -> tuple[Interruption, ...]:
        """Every stop (`restarts`) and fault (`faults`) of the run, oldest first."""
        return tuple(sorted((*self.restarts, *self.faults), key=lambda e: e.when_s))

    def requeues_so_far(self) -> dict[str, int]:
        """Requeues of the run so far, by reason (time-limit, preemption, node-lost, ...)."""
        counts: dict[str, int] = {}
        for entry in self.interruptions:
            if entry.restarted:
                counts[str(entry.reason)] = counts.get(str(entry.reason), 0) + 1
        return counts

    def restarts_told(self) -> tuple[int, tuple[str, ...]]:
        """How often the run started again, and after what (oldest first).

        Every start but the first, or every restart recorded when more (a restarted start
        that failed before its writer recorded it still restarted the run). The one count
        of summary.json and `mjlab-hpc status`; Slurm's SLURM_RESTART_COUNT counts requeues
        of one job only, not restarts in its allocation or across a chain's jobs.
        """
        requeues = [e for e in self.interruptions if e.restarted]
        count = max(0, len(self.starts) - 1, len(requeues))
        return count, tuple(str(r.reason) for r in requeues[:count])

    def resized_by_healer(self, world_size: int) -> bool:
        """Whether the healer changed the run's world size to or from `world_size`.

        That is a restart on fewer nodes (--min-nodes), or a later start of the job back on
        all of them. The ranks then take what the checkpoint holds of theirs.
        """
        return any(f.world_size is not None and world_size in f.world_size for f in self.faults)

    @property
    def last_start(self) -> Start:
        """The latest start (an empty one when none)."""
        return self.starts[-1] if self.starts else Start()


# Reading: JSON values checked against the dataclasses' type hints (`mjlab_hpc.convert`).


class NewerRecord(DamagedRecord):
    """A run.json written by a newer mjlab-hpc (a higher schema): not ours to read or write."""


def _newer(path: Path, schema: object) -> NewerRecord:
    return NewerRecord(
        path,
        f"written by a newer mjlab-hpc, its schema {schema}; this one reads up to {SCHEMA}",
        "use that version of mjlab-hpc for this run (nothing of it was changed)",
    )


def read_record(run_dir: Path, strict: bool = False, set_aside: bool = False) -> RunRecord:
    """Read the run record, empty when there is none yet; the one reader of run.json.

    Every field is checked against its type. A damaged record reads as empty (no command
    ends in a traceback), or with `strict` raises DamagedRecord naming the field. With
    `set_aside` (a writer about to write anew) it is kept as `run.json.damaged-<time>`,
    named in `damaged_records`. A record of a newer schema raises NewerRecord with `strict`
    or `set_aside` (it is never set aside or rewritten), and reads as empty otherwise.
    """
    path = run_dir / RUN_RECORD
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return RunRecord()
    except ValueError as exc:  # a directory, a device, far too large: no record
        problem = str(exc).removeprefix(f"{RUN_RECORD} ")
    else:
        try:
            value = parse_json(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            problem = "it is not JSON"
        else:
            if not isinstance(value, dict):
                problem = f"it holds {json.dumps(value)[:40]}, not a JSON object"
            elif type(value.get("schema")) is int and value["schema"] > SCHEMA:
                if strict or set_aside:
                    raise _newer(path, value["schema"])
                return RunRecord()
            else:
                try:
                    return load(RunRecord, value, "record")  # type: ignore[no-any-return]
                except Mismatch as exc:
                    problem = str(exc).replace("'record.", "'", 1)
    if strict:
        raise DamagedRecord(
            path,
            problem,
            f"move it aside (a resume keeps it as {RUN_RECORD}"
            ".damaged-<time> and begins a new record)",
        )
    if not set_aside:
        return RunRecord()
    kept = path.with_name(f"{RUN_RECORD}.damaged-{dt.datetime.now():%Y%m%d-%H%M%S}")
    os.replace(path, kept)
    log.warning("%s was damaged (%s): kept as %s, a new record begins", path, problem, kept.name)
    return RunRecord(damaged_records=(kept.name,))


@dataclass(frozen=True)
class RunSummary:
    """`summary.json`: how a completed run ended, written once by its writer."""

    iterations: Count
    """Iterations done."""
    resumed_from: Count = 0
    """The iteration its last start resumed from."""
    world_size: Positive | None = None
    device: str | None = None
    launch_mode: str | None = None
    job_id: str | None = None
    restart_count: Count = 0
    """How often the run started again (`RunRecord.restarts_told`)."""
    restart_reasons: tuple[str, ...] = ()
    """After what, oldest first."""
    param_digest_per_rank: tuple[str, ...] = ()
    """Every rank's digest of its parameters at the end (equal: the ranks were in sync)."""
    ranks_in_sync: bool | None = None
    first_obs_digest_per_rank: tuple[str, ...] = ()
    """Every rank's digest of its first observations (different seeds: different)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object for summary.json."""
        return plain(self)  # type: ignore[no-any-return]


def read_summary(run_dir: Path) -> RunSummary | None:
    """The run's summary.json (None: none yet); Unread naming it when it is damaged."""
    try:
        return read_json(RunSummary, RunDir(run_dir).summary, run_dir)
    except FileNotFoundError:
        return None


# Writing: each event of the run, as a new record.


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


def changed_settings(before: TrainSpec | None, now: TrainSpec) -> dict[str, list[Any]]:
    """Return the run's settings that differ: {field: [before, now]}, as plain values.

    --num-procs is not one: the number of ranks is (`world_size`), whatever flag gave it.
    """
    if before is None:
        return {}
    theirs, ours = before.to_dict(), now.to_dict()
    return {
        key: [theirs[key], value]
        for key, value in ours.items()
        if key in theirs
        and key not in NOT_RUN_SETTINGS
        and key != "num_procs"
        and theirs[key] != value
    }


def on_start(
    record: RunRecord,
    start: Start,
    *,
    spec: TrainSpec,
    effective: Mapping[str, Any],
    launch_mode: str,
    world_size: int,
    num_nodes: int,
    device: str,
    code: Mapping[str, Any],
    code_dir: Path,
) -> RunRecord:
    """Return the record after a (re)start of the run (`start`; its time and changes added).

    `spec` is the run's settings from now on, `effective` what the task resolved to, `code`
    the code record. The start says what changed (`changed`: {field: [before, now]}).
    """
    changed = changed_settings(record.spec, spec)
    if record.world_size not in (None, world_size):
        changed["world_size"] = [record.world_size, world_size]
    start = dataclasses.replace(start, at=now_iso(), changed=changed)
    starts = (*record.starts, start)
    return dataclasses.replace(
        record,
        state=RunState.RUNNING,
        started_at=record.started_at or now_iso(),
        spec=spec,
        effective=load(Effective, dict(effective), "effective"),
        world_size=world_size,
        num_nodes=num_nodes,
        device=device,
        launch_mode=launch_mode,
        versions=versions(),
        git_commit=git_commit(code_dir),
        code=dict(code),
        starts=starts,
        job_ids=tuple(sorted({s.job_id for s in starts if s.job_id})),
        skipped_checkpoints=(*record.skipped_checkpoints, *start.skipped_checkpoints),
        failure=None,
        stragglers=(),  # measured afresh in every start
    )


def on_stop(record: RunRecord, stop: StopEntry) -> RunRecord:
    """The record after a stop with a checkpoint (for a requeue, or for good)."""
    return dataclasses.replace(
        record, restarts=(*record.restarts, stop), state=RunState.STOPPED, stopped_at=now_iso()
    )


def on_stop_answered(record: RunRecord, asked: StopEntry, answered: StopEntry) -> RunRecord:
    """The record once Slurm said what a stop recorded as `asked` (its last equal one) is."""
    mine = [e for e in record.restarts if e == asked]
    return _replaced(record, mine[-1], answered) if mine else record


def on_fault(
    record: RunRecord, fault: Interruption, requeued: bool, failure: Failure | None = None
) -> RunRecord:
    """The record after a crash or hang of a start (`faults`): requeued, or the run failed.

    `failure`: the cause, when the run failed.
    """
    faults = (*record.faults, fault)
    if requeued:
        return dataclasses.replace(
            record, faults=faults, state=RunState.REQUEUED, stopped_at=now_iso()
        )
    return dataclasses.replace(
        record,
        faults=faults,
        state=RunState.FAILED,
        ended_at=now_iso(),
        failure=failure or record.failure,
    )


def on_recovered(record: RunRecord, resumed_from: int) -> RunRecord:
    """Return the record once the first iteration after a requeue-type interruption completed.

    The interruption gets the time from the fault (or stop signal) to that iteration, and how
    many iterations were computed again.
    """
    pending = [
        e
        for e in record.interruptions
        if e.kind is not None and e.restarted and e.recovered_at is None
    ]
    if not pending:
        return record
    entry = pending[-1]
    began = float(entry.at_s or entry.signal_at or 0)
    took = round(time.time() - began, 2) if began else None
    done = dataclasses.replace(
        entry,
        recovered_at=now_iso(),
        # (this rank's clock behind the one that recorded the fault: not known)
        recovery_s=took if took is not None and took >= 0 else entry.recovery_s,
        resumed_from=resumed_from,
        recomputed=max(0, int(entry.iteration or 0) - resumed_from),
    )
    return _replaced(record, entry, done)


def _replaced(record: RunRecord, old: Interruption, new: Interruption) -> RunRecord:
    """The record with the stop or fault `old` (itself, not an equal one) replaced by `new`."""

    def swap(entries: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(new if e is old else e for e in entries)

    return dataclasses.replace(record, restarts=swap(record.restarts), faults=swap(record.faults))


def on_end(
    record: RunRecord,
    iterations: int,
    state: str = RunState.COMPLETED,
    *,
    failure: Failure | None = None,
    spec: TrainSpec | None = None,
    effective: Mapping[str, Any] | None = None,
) -> RunRecord:
    """The record at the end of the run (completed), or of this start (failed, interrupted).

    `failure`: why it failed. `spec` and `effective`: what the run was to train, kept where
    the record has none (the start failed before its start record).
    """
    return dataclasses.replace(
        record,
        state=RunState(state),
        ended_at=now_iso(),
        iterations=iterations,
        failure=failure or record.failure,
        spec=record.spec or spec,
        effective=(
            record.effective
            if record.effective != Effective() or effective is None
            else load(Effective, dict(effective), "effective")
        ),
    )


def _previous_start(record: RunRecord, job_id: str, restart_count: int) -> list[Interruption]:
    """The stops and faults of the job's run before this restart."""
    return [
        e
        for e in record.interruptions
        if e.job_id == job_id
        and (e.restart_count if e.restart_count is not None else restart_count - 1)
        == restart_count - 1
    ]


def on_node_failed(
    record: RunRecord,
    job_id: str,
    restart_count: int,
    iteration: int,
    nodes: Sequence[str],
    ended: str,
) -> RunRecord:
    """Return the record when a job that Slurm requeued because a node failed starts again.

    sacct says NODE_FAIL at `ended`; `nodes` are the lost ones (those Slurm set DOWN, else
    the allocation's). The stop its ranks recorded (SIGTERM, taken for a preemption or a
    requeue) becomes `node-lost`; when the node died before they could record anything, a
    `node-lost` fault is added.
    """
    mine = _previous_start(record, job_id, restart_count)
    if mine:
        last = mine[-1]
        if last.reason not in ("preemption", "requeue"):
            return record
        named = last.nodes or tuple(nodes)
        lost = dataclasses.replace(
            last, reason="node-lost", nodes=named, why=f"node(s) {', '.join(named)}"
        )
        return _replaced(record, last, lost)
    try:
        at_s = dt.datetime.fromisoformat(ended).timestamp()  # sacct: local time
    except ValueError:
        at_s = time.time()
    fault = Interruption(
        reason="node-lost",
        kind="requeue",
        nodes=tuple(nodes),
        job_id=job_id,
        restart_count=restart_count - 1,
        iteration=iteration,
        at=ended,
        at_s=at_s,
        action="requeued by Slurm (NODE_FAIL)",
    )
    return dataclasses.replace(record, faults=(*record.faults, fault))


def on_preempted(record: RunRecord, job_id: str, restart_count: int) -> RunRecord:
    """Return the record when a job whose previous run was preempted starts again.

    sacct says PREEMPTED. The stop its ranks took for a requeue by Slurm (PreemptMode=REQUEUE
    without GraceTime looks like one to them) becomes `preemption`.
    """
    mine = _previous_start(record, job_id, restart_count)
    if mine and mine[-1].reason == "requeue":
        preempted = dataclasses.replace(mine[-1], reason="preemption", why=None)
        return _replaced(record, mine[-1], preempted)
    return record


def on_stragglers(record: RunRecord, now: list[dict[str, Any]]) -> RunRecord:
    """The record with the stragglers measured now (`Straggler` fields, as dicts)."""
    return dataclasses.replace(record, stragglers=load(tuple[Straggler, ...], now, "stragglers"))

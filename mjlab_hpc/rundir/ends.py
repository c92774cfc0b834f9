"""How each rank's latest start of a run ended, and who failed first.

Every rank writes a start record as it starts and an end record as its start ends
(`logs/ranks/`, written by `mjlab_hpc.rank.train`): decisions read these, never the rank logs,
which are for people (a rank may print anything). The rank decides what ended it where it
caught the exception, from its type (`rank/failures.py`), and writes that kind into its end
record; nothing downstream reads an error's text. The other sources are what the run record
says and, for a rank that ended without an end record, what the kernel says: its memory
cgroup's count of OOM kills, in its start record, read again under the same kernel.

A start without an end record ended abruptly (SIGKILL, out of memory, a segfault, a lost
node). A peer that went away (its connection closed, a collective timed out) is a
consequence: the cause is the first rank that failed otherwise, or else the rank that ended
without a word. A record that does not fit its type (a forged or torn one) is named and left
out, never a traceback.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.convert import Count, EpochS, Positive
from mjlab_hpc.procs import OomCount
from mjlab_hpc.rundir.durable import create_exclusive, write_json_atomic
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.progress import progress_summary
from mjlab_hpc.rundir.record import Interruption, RunRecord, RunState, read_record
from mjlab_hpc.rundir.typed import plain, read_optional

__all__ = [
    "FAULT_ENDS",
    "Exit",
    "FailureKind",
    "RankEnd",
    "RankExit",
    "RankStart",
    "RunOutcome",
    "first_failure",
    "latest_world_size",
    "memory_advice",
    "rank_ends",
    "rank_starts",
    "read_end",
    "record_end",
    "record_start",
    "recorded_cause",
    "run_outcome",
    "start_faults",
    "start_hosts",
]


def memory_advice(record: RunRecord, num_envs: int | None = None) -> str:
    """Say what to change after a run ran out of memory (a restart as it is would again).

    `num_envs` is the request's, for a start that ran out before the writer recorded its own.
    """
    envs = record.effective.num_envs or num_envs
    now = f" (now {envs} per rank)" if envs else ""
    return (
        f"lower --num-envs{now}, or give each rank more memory (--mem, fewer ranks per "
        "node), and resume"
    )


#: How a rank's start ended: a `RunState` (the run's vocabulary), or hung (its watchdog fired)
#: or no-exit (it ended without an end record).
How = (
    Literal[
        RunState.COMPLETED,
        RunState.STOPPED,
        RunState.FAILED,
        RunState.REFUSED,
        RunState.INTERRUPTED,
    ]
    | Literal["hung", "no-exit"]
)
#: How a rank's end record says its start ended (preflight: its node failed the check before
#: training, `rank/preflight.py`).
Exit = Literal[
    "completed", "stopped", "failed", "refused", "interrupted", "hung", "out-of-memory", "preflight"
]
#: The ends that are a fault of the start (the batch script's watcher ends srun after one).
FAULT_ENDS: tuple[Exit, ...] = ("failed", "hung", "out-of-memory", "preflight")
#: What ended a failed start, as the rank decided from the exception's type: its own error
#: (exception), another rank that went away (peer-lost: a consequence), an allocation that
#: failed, numbers no longer finite, the filesystem (environment: a full disk, a quota,
#: permissions), its node's preflight check.
FailureKind = Literal[
    "exception", "peer-lost", "out-of-memory", "diverged", "environment", "preflight"
]


@dataclass(frozen=True)
class RankStart:
    """A rank's start record: `logs/ranks/rank<k>.<n>.start.json`, written as it starts."""

    run: str
    """The run directory's name."""
    rank: Count
    world_size: Positive
    node: str
    """The Slurm node (SLURMD_NODENAME), else the host name."""
    pid: Positive
    device: str
    at: EpochS
    """When it started (epoch s)."""
    start_id: str | None = None
    """The batch script's name for the srun step of this start (None: not in a batch
    script's loop)."""
    oom: OomCount | None = None
    """The OOM kills counted so far in its memory cgroup: a reader under the same kernel
    tells an OOM kill from another SIGKILL."""
    number: int = 0
    """Which start of this rank it is, from 1 (0: not yet recorded; not in the file)."""


@dataclass(frozen=True)
class RankExit:
    """A rank's end record: `logs/ranks/rank<k>.<n>.end.json`, written as its start ends."""

    how: Exit
    detail: str
    """One line for people: what ended it (for a failure, the exception's line)."""
    at: EpochS
    """When it ended (epoch s)."""
    error_type: str | None = None
    """The exception's type name, for a failure."""
    message: str | None = None
    """The exception's message, for a failure (at most 2000 characters)."""
    peer_lost: bool = False
    """A failure that says another rank went away (a consequence): `kind` is peer-lost."""
    kind: FailureKind | None = None
    """What ended a failed start, decided by the rank from the exception's type (None: not a
    failure, or a record written before ranks said)."""

    @property
    def failure(self) -> FailureKind | None:
        """What ended a failed start (records without `kind`: from how they ended)."""
        if self.kind is not None or self.how not in FAULT_ENDS or self.how == "hung":
            return self.kind
        if self.how in ("out-of-memory", "preflight"):
            return self.how
        return "peer-lost" if self.peer_lost else "exception"


def _records_dir(run: RunDir) -> Path:
    """The folder of the rank records, made; OSError when it or `logs/` is not a real folder
    of the run (a link out of it is never written through)."""
    folder = run.rank_records
    folder.mkdir(parents=True, exist_ok=True)
    for path in (run.logs, folder):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(f"{path} is not a folder of the run")
    return folder


def record_start(run: RunDir, start: RankStart) -> RankStart:
    """Write `start` as the next start record of its rank; return it with its number."""
    _records_dir(run)
    number = max(run.rank_numbers().get(start.rank, [0])) + 1
    data = {k: v for k, v in plain(start).items() if k != "number"}
    payload = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    while not create_exclusive(run.rank_start(start.rank, number), payload):
        number += 1  # (a rank of the same number that starts at once: never ours to share)
    return dataclasses.replace(start, number=number)


def record_end(run: RunDir, start: RankStart, end: RankExit) -> None:
    """Write how the start `start` (as `record_start` returned it) ended.

    A fault of the start (`FAULT_ENDS`) also leaves the empty marker `rank<k>.<n>.fault`: the
    batch script's watcher finds it by its name, and reads no record.
    """
    _records_dir(run)
    data = plain(end)
    data["peer_lost"] = end.failure == "peer-lost"  # (what readers before `kind` read)
    write_json_atomic(run.rank_end(start.rank, start.number), data)
    if end.how in FAULT_ENDS:
        create_exclusive(run.rank_fault(start.rank, start.number), b"")


def _start_of(path: Path, run: RunDir, number: int, unread: list[str] | None) -> RankStart | None:
    start = read_optional(RankStart, path, run.path, unread, 1 << 20)
    return None if start is None else dataclasses.replace(start, number=number)


def rank_starts(run_dir: Path, rank: int, unread: list[str] | None = None) -> list[RankStart]:
    """Every start record of `rank`, oldest first (one that is damaged is named in `unread`
    and left out)."""
    run = RunDir(run_dir)
    found = []
    for number in run.rank_numbers().get(rank, []):
        start = _start_of(run.rank_start(rank, number), run, number, unread)
        if start is not None and start.rank == rank:
            found.append(start)
    return found


def read_end(run_dir: Path, start: RankStart, unread: list[str] | None = None) -> RankExit | None:
    """How the start `start` ended (None: it ended without a word, or it still runs; or its
    record is damaged, named in `unread`)."""
    run = RunDir(run_dir)
    end = run.rank_end(start.rank, start.number)
    return read_optional(RankExit, end, run.path, unread, 1 << 20)


@dataclass(frozen=True)
class RankEnd:
    """How one rank's latest start ended."""

    rank: int
    host: str | None
    how: How
    at: dt.datetime | None
    """When it ended (no-exit: its log's last write, else its start)."""
    detail: str
    """How it ended, for a failure the exception's line."""
    peer_lost: bool = False
    """A failure that says another rank went away (a consequence)."""
    started: dt.datetime | None = None
    """When this start of the rank began."""
    oom: bool = False
    """It ran out of memory: an allocation failed, or the kernel's OOM killer ended it."""
    world_size: int | None = None
    """The world size of this start."""
    start_id: str | None = None
    """The batch script's name for the srun step of this start (None: not in a batch
    script's loop)."""
    preflight: bool = False
    """Its node failed the preflight check (`detail` says which check, with the figures)."""
    kind: FailureKind | None = None
    """What ended a failed start, as the rank decided (None: not a failure, or no word)."""
    error_type: str | None = None
    """The exception's type name, for a failure."""

    def describe(self) -> str:
        """One line for people."""
        where = f"rank {self.rank} on {self.host or 'an unknown host'}"
        if self.oom:
            if self.detail.startswith(where):  # as the healer recorded it
                return self.detail
            how = "killed by the kernel's OOM killer" if self.how == "no-exit" else self.detail
            return f"{where} ran out of memory ({how})"
        if self.how == "no-exit":
            return (
                f"{where} ended without an exit record (killed by a signal: SIGKILL, out of "
                "memory, a segfault or a lost node)"
            )
        if self.preflight:
            return f"{where} failed the preflight check: {self.detail}"
        if self.how == "failed":
            return f"{where} failed: {self.detail}"
        if self.how == "hung":
            return f"{where} {self.detail} (its stacks are in its log)"
        return f"{where}: {self.detail}"


def _when(epoch: float | None) -> dt.datetime | None:
    try:  # (a log's mtime may be anything its owner set)
        return dt.datetime.fromtimestamp(epoch) if epoch is not None else None
    except (OverflowError, ValueError, OSError):
        return None


def _rank_end(run: RunDir, start: RankStart, unread: list[str] | None) -> RankEnd:
    end = read_end(run.path, start, unread)
    common = {
        "rank": start.rank,
        "host": start.node,
        "started": _when(start.at),
        "world_size": start.world_size,
        "start_id": start.start_id,
    }
    if end is None:
        try:  # the rank log's last write: about when it died
            last = max(run.rank_log(start.rank).stat().st_mtime, start.at)
        except OSError:
            last = start.at
        rose = start.oom.rose() if start.oom is not None else None
        return RankEnd(
            how="no-exit", at=_when(last), detail="no exit record", oom=bool(rose), **common
        )
    kind = end.failure
    return RankEnd(
        how="failed" if kind in ("out-of-memory", "preflight") else end.how,
        at=_when(end.at),
        detail=end.detail,
        peer_lost=kind == "peer-lost",
        oom=kind == "out-of-memory",
        preflight=kind == "preflight",
        kind=kind,
        error_type=end.error_type,
        **common,
    )


def rank_ends(run_dir: Path, unread: list[str] | None = None) -> list[RankEnd]:
    """Return how each rank's latest start ended, by rank, from their records.

    Ranks that never started are left out, and so are ranks past the world size of the
    newest start: those of a start before the run went on with fewer ranks (--min-nodes).
    A damaged record is named in `unread` and left out (an end record: the start reads as
    ended without a word).
    """
    run = RunDir(run_dir)
    found = []
    for rank in run.rank_numbers():
        starts = rank_starts(run_dir, rank, unread)
        if starts:
            found.append(_rank_end(run, starts[-1], unread))
    size = latest_world_size(found)
    return [e for e in found if size is None or e.rank < size]


def start_hosts(run_dir: Path, rank: int) -> list[str]:
    """The host of each start of `rank`, in order (its start records)."""
    return [s.node for s in rank_starts(run_dir, rank)]


def latest_world_size(ends: list[RankEnd]) -> int | None:
    """The world size of the newest start among `ends` (None: none says)."""
    started = [(e.started, e.world_size) for e in ends if e.started is not None]
    return max(started, key=lambda pair: pair[0])[1] if started else None


def first_failure(ends: list[RankEnd]) -> RankEnd | None:
    """Return the cause of a failed start.

    It is the earliest failure that is not a consequence, else the earliest rank that ended
    without a word, else the earliest consequence.
    """
    never = dt.datetime.max

    def earliest(candidates: list[RankEnd]) -> RankEnd | None:
        return min(candidates, key=lambda e: (e.at or never, e.rank)) if candidates else None

    return (
        earliest([e for e in ends if e.how == "failed" and not e.peer_lost])
        or earliest([e for e in ends if e.how == "no-exit"])
        or earliest([e for e in ends if e.how in ("failed", "hung")])
    )


def start_faults(ends: list[RankEnd]) -> list[RankEnd]:
    """Return every rank's own fault in a failed start, the cause (`first_failure`) first.

    The others, by rank: every other failure that is not a consequence, and every rank that
    ended without a word (killed by a signal of its own: the ranks srun ends record theirs).
    """
    cause = first_failure(ends)
    if cause is None:
        return []
    own = [e for e in ends if e.how == "no-exit" or (e.how == "failed" and not e.peer_lost)]
    return [cause, *(e for e in own if e is not cause)]


def recorded_cause(record: RunRecord, ends: list[RankEnd]) -> RankEnd | None:
    """Return who failed first: from the run record where it knows better, else the logs.

    It knows better on a full disk (the log may have had no room for its exit line) and out
    of memory (the healer read the kernel's count where the rank ran).
    """
    failure = record.failure
    if (
        record.state == RunState.FAILED
        and failure is not None
        and failure.kind in ("environment", "out-of-memory", "diverged")
    ):
        return RankEnd(
            rank=failure.rank or 0,
            host=failure.host,
            how="failed",
            at=None,
            detail=str(failure.error),
            oom=failure.kind == "out-of-memory",
        )
    return first_failure(ends)


@dataclass(frozen=True)
class RunOutcome:
    """How a run's latest start ended, for the closing line of a command."""

    state: RunState
    """run.json's state (completed, stopped, failed, interrupted, running, unknown), or what
    the ranks' logs say of a start that ended before run.json knew (failed, refused)."""
    launch_mode: str | None
    """How the latest start was launched (slurm, submitit-local, single, torchrun)."""
    refusal: str | None
    """Why the ranks refused to start (a refused resume), when refused."""
    iteration: int | None
    """The last iteration in progress.jsonl."""
    stop: Interruption | None
    """The last stop (reason, kind, signal, iteration), when stopped."""
    cause: RankEnd | None
    """The rank that failed first, when failed."""
    env_steps_per_s: float | None
    mean_reward: float | None
    recent_rewards: tuple[float, ...] = ()
    """The mean rewards of the last (up to 10) iterations."""


def run_outcome(run_dir: Path) -> RunOutcome:
    """How the run's latest start ended (call it once the job has ended)."""
    record = read_record(run_dir)
    state = record.state or RunState.UNKNOWN
    summary = progress_summary(RunDir(run_dir))
    stops = record.restarts
    ends = rank_ends(run_dir)
    # The ranks' logs are newer than run.json when a start ended before its writer recorded
    # it (a refused resume, a failure while building): they say how this start ended. Not
    # after this start's stop checkpoint: a rank killed then (the scheduler's KillWait) lost
    # nothing.
    last = stops[-1] if stops else Interruption()
    if last.start:  # the srun step the stop was in: no clocks compared
        stopped = state == RunState.STOPPED and all(e.start_id == last.start for e in ends)
    else:  # (this machine's processes)
        saved = float(last.checkpoint_at or 0)
        stopped = state == RunState.STOPPED and all(
            e.started is None or e.started.timestamp() < saved for e in ends
        )
    if ends and all(e.how == RunState.REFUSED for e in ends):
        state = RunState.REFUSED
    elif not stopped and any(e.how in ("failed", "hung", "no-exit") for e in ends):
        state = RunState.FAILED
    cause = recorded_cause(record, ends) if state == RunState.FAILED else None
    return RunOutcome(
        state=state,
        # Read from the latest start, which never held one: None, as ever. The record's own
        # `launch_mode` would turn on follow's "not restarted" branch for a chain's stop.
        launch_mode=None,
        refusal=ends[0].detail.removeprefix("refused: ") if state == RunState.REFUSED else None,
        iteration=summary.iteration,
        stop=stops[-1] if state == RunState.STOPPED and stops else None,
        cause=cause,
        env_steps_per_s=summary.env_steps_per_s,
        mean_reward=summary.mean_reward,
        recent_rewards=summary.recent_rewards,
    )

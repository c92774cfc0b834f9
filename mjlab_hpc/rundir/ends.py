"""How each rank's latest start of a run ended, and who failed first.

The sources are the `exit:` line every rank writes last into its log (`mjlab_hpc.rank.train`),
what the run record says, and, for a rank that ended without one, what the kernel says: its
memory cgroup's count of OOM kills, noted in the rank's first log line and read again under
the same kernel.

A rank log whose latest start has no exit line ended abruptly (SIGKILL, out of memory, a
segfault, a lost node). Errors that say a peer went away (connection closed or reset, a
collective timed out) are consequences: the cause is the first rank that failed otherwise, or
else the rank that ended without a word.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.procs import OomCount
from mjlab_hpc.rundir.layout import LOGS_DIR, RunDir, progress_summary
from mjlab_hpc.rundir.record import Interruption, RunRecord, RunState, read_record

__all__ = [
    "RankEnd",
    "RunOutcome",
    "failure_kind",
    "first_failure",
    "latest_world_size",
    "memory_advice",
    "rank_ends",
    "recorded_cause",
    "run_outcome",
    "start_hosts",
]

# Errors of a rank whose peer died or hung: consequences, not causes.
_PEER_LOST_ERROR = re.compile(
    r"closed by peer|reset by peer|peer lost|remote worker|broken pipe|connection refused|"
    r"timed out|timeout|DistBackendError|NCCL communicator",
    re.IGNORECASE,
)


# An allocation that failed: Python's, torch's (CPU, CUDA), Warp's, the kernel's ENOMEM.
_MEMORY_ERROR = re.compile(
    r"out of memory|failed to allocate|can't allocate memory|cannot allocate memory|"
    r"OutOfMemoryError",
    re.IGNORECASE,
)


def failure_kind(exc: BaseException) -> str:
    """Classify a rank's error: `out-of-memory`, `peer-lost` or `exception`.

    `out-of-memory` is an allocation that failed; `peer-lost` an error that says another
    rank died or hung (a consequence).
    """
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or _MEMORY_ERROR.search(text):
        return "out-of-memory"
    return "peer-lost" if _PEER_LOST_ERROR.search(text) else "exception"


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
#: or no-exit (it ended without an exit line).
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

_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3}) rank(\d+) (.*)$")
_START = re.compile(r"^rank \d+/(\d+) \(local ")
_HOST = re.compile(r"\bhost (\S+?),")
_START_ID = re.compile(r", start (\S+?)(?:,|$)")
_RANK_LOG = re.compile(r"^rank(\d+)\.log$")
_PEER_LOST = re.compile(r"\(peer-lost\)")
_OUT_OF_MEMORY = re.compile(r"\(out-of-memory\)")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Refused)\b.*:")


@dataclass(frozen=True)
class RankEnd:
    """How one rank's latest start ended."""

    rank: int
    host: str | None
    how: How
    at: dt.datetime | None
    """The exit line's time (no-exit: the last line's)."""
    detail: str
    """The exit line, or for a failure the exception's last line."""
    peer_lost: bool = False
    """A failure that says another rank went away (a consequence)."""
    started: dt.datetime | None = None
    """When this start of the rank logged its first line."""
    oom: bool = False
    """It ran out of memory: an allocation failed, or the kernel's OOM killer ended it."""
    world_size: int | None = None
    """The world size of this start (its first line)."""
    start_id: str | None = None
    """The batch script's name for the srun step of this start (None: not in a batch
    script's loop)."""

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
        if self.how == "failed":
            return f"{where} failed: {self.detail}"
        if self.how == "hung":
            return f"{where} {self.detail} (its stacks are in its log)"
        return f"{where}: {self.detail}"


def _stamp(match: re.Match[str]) -> dt.datetime:
    when = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
    return when.replace(microsecond=int(match.group(2)) * 1000)


def _rank_end(rank: int, path: Path) -> RankEnd | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    start, size = None, None
    for i, line in enumerate(lines):
        m = _STAMP.match(line)
        if m and (begun := _START.match(m.group(4))):
            start, size = i, int(begun.group(1))
    if start is None:
        return None
    head = _STAMP.match(lines[start])
    host_match = _HOST.search(lines[start])
    host = host_match.group(1) if host_match else None
    start_match = _START_ID.search(lines[start])
    start_id = start_match.group(1) if start_match else None
    last_at = _stamp(head) if head else None
    for i in range(start + 1, len(lines)):
        m = _STAMP.match(lines[i])
        if not m:
            continue
        last_at = _stamp(m)
        message = m.group(4)
        if not message.startswith("exit: "):
            continue
        body = message.removeprefix("exit: ")
        how: How = "failed"
        for word in ("completed", "stopped", "refused", "interrupted", "hung"):
            if body.startswith(word):
                how = word  # type: ignore[assignment]
        detail = body
        if how == "failed":
            block = []
            for line in lines[i + 1 :]:
                if _STAMP.match(line):
                    break
                block.append(line)
            error = [line.strip() for line in block if line.strip()]
            # The exception's own line (`ValueError: ...`), not what some libraries print
            # after it (pydantic's "For further information visit ...").
            named = [line for line in error if _EXCEPTION_LINE.match(line)]
            detail = named[-1] if named else error[-1] if error else body
        started = _stamp(head) if head else None
        return RankEnd(
            rank=rank,
            host=host,
            how=how,
            at=last_at,
            detail=detail,
            peer_lost=bool(_PEER_LOST.search(message)),
            started=started,
            oom=bool(_OUT_OF_MEMORY.search(message)),
            world_size=size,
            start_id=start_id,
        )
    count = OomCount.parse(lines[start])
    return RankEnd(
        rank=rank,
        host=host,
        how="no-exit",
        at=last_at,
        detail="no exit record",
        started=_stamp(head) if head else None,
        oom=count is not None and bool(count.rose()),
        world_size=size,
        start_id=start_id,
    )


def rank_ends(run_dir: Path) -> list[RankEnd]:
    """Return how each rank's latest start ended, by rank.

    Ranks that never started are left out, and so are ranks past the world size of the
    newest start: those of a start before the run went on with fewer ranks (--min-nodes).
    """
    logs = run_dir / LOGS_DIR
    found = []
    if logs.is_dir():
        for entry in sorted(logs.iterdir()):
            m = _RANK_LOG.match(entry.name)
            if m and (end := _rank_end(int(m.group(1)), entry)) is not None:
                found.append(end)
    size = latest_world_size(found)
    return sorted((e for e in found if size is None or e.rank < size), key=lambda e: e.rank)


def start_hosts(run_dir: Path, rank: int) -> list[str]:
    """The host of each start of `rank`, in order (its log's first lines)."""
    try:
        lines = (run_dir / LOGS_DIR / f"rank{rank}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    starts = [
        m.group(4) for line in lines if (m := _STAMP.match(line)) and _START.match(m.group(4))
    ]
    return [h.group(1) if (h := _HOST.search(line)) else "?" for line in starts]


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


def recorded_cause(record: RunRecord, ends: list[RankEnd]) -> RankEnd | None:
    """Return who failed first: from the run record where it knows better, else the logs.

    It knows better on a full disk (the log may have had no room for its exit line) and out
    of memory (the healer read the kernel's count where the rank ran).
    """
    failure = record.failure
    if (
        record.state == RunState.FAILED
        and failure is not None
        and failure.kind in ("environment", "out-of-memory")
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

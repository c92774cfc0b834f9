"""What a run is doing and how it ended, from its own files: the run record `run.json`
(what ran, where, with which code, every start, stop and fault: kept by the writer of the run
directory), how each rank's latest start ended (the `exit:` line every rank writes last into its
log, `mjlab_hpc.rank.entry`), and the state these files tell without Slurm (with the writer's
lease lock and `cancelled.json`).

A rank log whose latest start has no exit line ended abruptly (SIGKILL, out of memory, a
segfault, a lost node). Errors that say a peer went away (connection closed or reset, a
collective timed out) are consequences: the cause is the first rank that failed otherwise, or
else the rank that ended without a word.
"""

from __future__ import annotations

import copy
import datetime as dt
import importlib.metadata
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.procs import run_command
from mjlab_hpc.rundir.layout import (
    CANCEL_RECORD,
    LOGS_DIR,
    RUN_RECORD,
    WRITER_LOCK,
    RunDir,
    progress_summary,
)
from mjlab_hpc.rundir.lock import LeaseLock, LockError

__all__ = [
    "JobState",
    "RankEnd",
    "RunOutcome",
    "cancel_marker",
    "failure_kind",
    "first_failure",
    "git_commit",
    "interruptions",
    "now_iso",
    "on_end",
    "on_fault",
    "on_node_failed",
    "on_recovered",
    "on_start",
    "on_stop",
    "rank_ends",
    "read_record",
    "record_state",
    "requeues_so_far",
    "run_outcome",
    "versions",
    "writer_alive",
]

# --- the run record -----------------------------------------------------------------------

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


def requeues_so_far(record: dict[str, Any]) -> dict[str, int]:
    """Requeues of the run so far, by reason (time-limit, preemption, node-lost, crash, ...)."""
    counts: dict[str, int] = {}
    for entry in interruptions(record):
        if entry.get("kind", "requeue") == "requeue":
            reason = str(entry.get("reason"))
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def on_node_failed(
    record: dict[str, Any], job_id: str, restart_count: int, iteration: int, nodes: str,
    ended: str,
) -> dict[str, Any]:  # fmt: skip
    """The record once a Slurm job requeued because a node failed (sacct: NODE_FAIL, on
    `nodes`, at `ended`) starts again: the stop its ranks recorded (SIGTERM, taken for a
    preemption) becomes `node-lost`, or, when the node died before they could record
    anything, a `node-lost` fault is added."""
    record = copy.deepcopy(record)
    mine = [e for e in interruptions(record)
            if e.get("job_id") == job_id and e.get("restart_count", restart_count - 1)
            == restart_count - 1]  # fmt: skip
    if mine:
        if mine[-1].get("reason") == "preemption":
            mine[-1]["reason"] = "node-lost"
            mine[-1].setdefault("nodes", [nodes])
        return record
    try:
        at_s = dt.datetime.fromisoformat(ended).timestamp()  # sacct: local time
    except ValueError:
        at_s = time.time()
    record["faults"] = [*record.get("faults", []), {
        "reason": "node-lost", "kind": "requeue", "nodes": [nodes], "job_id": job_id,
        "restart_count": restart_count - 1, "iteration": iteration, "at": ended,
        "at_s": at_s, "action": "requeued by Slurm (NODE_FAIL)",
    }]  # fmt: skip
    return record


# --- how the latest start ended ---------------------------------------------------------

# Errors of a rank whose peer died or hung: consequences, not causes.
_PEER_LOST_ERROR = re.compile(
    r"closed by peer|reset by peer|peer lost|remote worker|broken pipe|connection refused|"
    r"timed out|timeout|DistBackendError|NCCL communicator",
    re.IGNORECASE,
)


def failure_kind(exc: BaseException) -> str:
    """`peer-lost` for an error that says another rank died or hung (a consequence), else
    `exception`."""
    text = f"{type(exc).__name__}: {exc}"
    return "peer-lost" if _PEER_LOST_ERROR.search(text) else "exception"


How = Literal["completed", "stopped", "failed", "refused", "interrupted", "hung", "no-exit"]

_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3}) rank(\d+) (.*)$")
_START = re.compile(r"^rank \d+/\d+ \(local ")
_HOST = re.compile(r"\bhost (\S+?),")
_RANK_LOG = re.compile(r"^rank(\d+)\.log$")
_PEER_LOST = re.compile(r"\(peer-lost\)")
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

    def describe(self) -> str:
        """One line for people."""
        where = f"rank {self.rank} on {self.host or 'an unknown host'}"
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
    start = None
    for i, line in enumerate(lines):
        m = _STAMP.match(line)
        if m and _START.match(m.group(4)):
            start = i
    if start is None:
        return None
    head = _STAMP.match(lines[start])
    host_match = _HOST.search(lines[start])
    host = host_match.group(1) if host_match else None
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
        return RankEnd(rank, host, how, last_at, detail, bool(_PEER_LOST.search(message)), started)
    return RankEnd(rank, host, "no-exit", last_at, "no exit record",
                   started=_stamp(head) if head else None)  # fmt: skip


def rank_ends(run_dir: Path) -> list[RankEnd]:
    """How each rank's latest start ended, by rank (ranks that never started are left out)."""
    logs = run_dir / LOGS_DIR
    found = []
    if logs.is_dir():
        for entry in sorted(logs.iterdir()):
            m = _RANK_LOG.match(entry.name)
            if m:
                end = _rank_end(int(m.group(1)), entry)
                if end is not None:
                    found.append(end)
    return sorted(found, key=lambda e: e.rank)


def first_failure(ends: list[RankEnd]) -> RankEnd | None:
    """The cause of a failed start: the earliest failure that is not a consequence, else the
    earliest rank that ended without a word, else the earliest consequence."""
    never = dt.datetime.max

    def earliest(candidates: list[RankEnd]) -> RankEnd | None:
        return min(candidates, key=lambda e: (e.at or never, e.rank)) if candidates else None

    return (
        earliest([e for e in ends if e.how == "failed" and not e.peer_lost])
        or earliest([e for e in ends if e.how == "no-exit"])
        or earliest([e for e in ends if e.how in ("failed", "hung")])
    )


@dataclass(frozen=True)
class RunOutcome:
    """How a run's latest start ended, for the closing line of a command."""

    state: str
    """run.json's state (completed, stopped, failed, interrupted, running, unknown), or what
    the ranks' logs say of a start that ended before run.json knew (failed, refused)."""
    launch_mode: str | None
    """How the latest start was launched (slurm, submitit-local, single, torchrun)."""
    refusal: str | None
    """Why the ranks refused to start (a refused resume), when refused."""
    iteration: int | None
    """The last iteration in progress.jsonl."""
    stop: dict[str, object] | None
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
    state = str(record.get("state") or "unknown")
    summary = progress_summary(RunDir(run_dir))
    stops = record.get("restarts") or []
    ends = rank_ends(run_dir)
    # The ranks' logs are newer than run.json when a start ended before its writer recorded
    # it (a refused resume, a failure while building): they say how this start ended.
    if ends and all(e.how == "refused" for e in ends):
        state = "refused"
    elif any(e.how in ("failed", "hung", "no-exit") for e in ends):
        state = "failed"
    cause = first_failure(ends) if state == "failed" else None
    failure = record.get("failure") or {}
    if state == "failed" and failure.get("kind") == "environment":
        # The writer recorded it; the rank log may have had no room for its exit line.
        cause = RankEnd(
            int(failure.get("rank", 0)), failure.get("host"), "failed", None,
            str(failure.get("error")),
        )  # fmt: skip
    starts = record.get("starts") or [{}]
    return RunOutcome(
        state=state,
        launch_mode=starts[-1].get("launch_mode"),
        refusal=ends[0].detail.removeprefix("refused: ") if state == "refused" else None,
        iteration=summary.iteration,
        stop=stops[-1] if state == "stopped" and stops else None,
        cause=cause,
        env_steps_per_s=summary.env_steps_per_s,
        mean_reward=summary.mean_reward,
        recent_rewards=summary.recent_rewards,
    )


# --- the state the run's files tell -------------------------------------------------------


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

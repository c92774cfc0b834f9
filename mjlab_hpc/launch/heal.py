"""Deciding a heal: what ended a start, whether the ranks start again, and on which nodes.

The Slurm batch script's heal step (`launch/heal_slurm`) and the local controller
(`launch/executors`) act on the decision, after it is written into run.json (`faults`). A
decision reads run.json once (`decide`) and passes it on; only the writer's update reads it
again, under the writer's lease (`record_healing`). What ended the start is what its ranks
said in their end records (`rundir.ends`), never an error's text.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.rundir.ends import RankEnd, memory_advice, rank_ends, start_faults
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import Hang, clear_hang, read_hang
from mjlab_hpc.rundir.progress import progress_summary
from mjlab_hpc.rundir.record import (
    IN_ALLOCATION,
    RESTARTED,
    Failure,
    Interruption,
    NewerRecord,
    RunRecord,
    now_iso,
    on_fault,
    read_record,
)
from mjlab_hpc.rundir.state import cancel_marker
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.slurm.client import SlurmClient, own_job

__all__ = [
    "Fault",
    "Healing",
    "Step",
    "decide",
    "find_fault",
    "next_step",
    "place_restart",
    "record_healing",
    "restart_here",
    "usable_without",
]

log = logging.getLogger("mjlab_hpc")
# Node states in which a node takes no job.
_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "MAINT", "NOT_RESPONDING", "POWER", "REBOOT", "INVAL")


@dataclass(frozen=True)
class Fault:
    """What ended a start: a crash or a hang, where, and at which iteration."""

    reason: str
    """crash, hang, out-of-memory, diverged or preflight (a node failed the check)."""
    error: str
    """What happened, for people (the failing rank's exception, or the hang's findings)."""
    ranks: tuple[int, ...]
    """The ranks it is attributed to (empty: none in particular)."""
    hosts: tuple[str, ...]
    """Their hosts."""
    iteration: int
    """The last iteration completed before the fault."""
    suspect_nodes: tuple[str, ...] = ()
    """Nodes the fault is attributed to (a rank killed by a signal, a frozen rank)."""
    at_s: float | None = None
    """When it happened: the failing rank's end (its log's last write if it ended without a
    word), a hang's last progress."""
    failure_kind: str | None = None
    """What the first failing rank said ended it (`rundir.ends.FailureKind`; None: it
    ended without a word, or a hang)."""
    error_type: str | None = None
    """That rank's exception's type name."""

    def repeats(self, last: Interruption) -> bool:
        """Whether this fault is `last` again: the same kind, exception type, ranks and
        iteration (what an older record does not hold is not compared)."""
        same = (
            last.reason == self.reason
            and tuple(last.ranks) == self.ranks
            and (last.iteration if last.iteration is not None else -1) == self.iteration
        )
        if last.failure_kind is not None or last.error_type is not None:
            same = same and (last.failure_kind, last.error_type) == (
                self.failure_kind,
                self.error_type,
            )
        # A node that failed the preflight check: another node failing it is no repeat.
        return same and (self.reason != "preflight" or tuple(last.hosts) == self.hosts)


@dataclass
class Healing:
    """The decision about one failed start, refined while it is placed and recorded."""

    fault: Fault | None
    """None: nothing to heal (the start completed, stopped or was refused)."""
    requeue: bool = False
    """Whether the ranks start again (by a requeue, or in the allocation)."""
    why: str = ""
    """Why not (or how) it is requeued, for people."""
    exclude: list[str] = field(default_factory=list)
    """The nodes a requeue excludes."""
    entry: Interruption = field(default_factory=Interruption)
    """The run.json `faults` entry."""
    record: RunRecord | None = None
    """run.json as the decision read it (None: read where needed)."""

    def describe(self) -> str:
        """Return one line for people: the fault and what is done about it."""
        assert self.fault is not None
        fault = self.fault
        return f"{fault.reason} after iteration {fault.iteration}: {fault.error}; {self.why}"


def find_fault(
    run_dir: Path,
    since: float | None = None,
    slurm_oom: bool = False,
    start: str | None = None,
    record: RunRecord | None = None,
) -> Fault | None:
    """Find the crash, hang or out-of-memory that ended the latest start (None: none did).

    The latest start's ranks are those whose start record names `start`, the batch script's
    name for its srun step; else those that started after `since` (epoch s, this machine's
    clock: the local controller's ranks run beside it). A rank with no start record of it
    failed before it could write one (a broken node, the process group never formed); its
    older records are not this start's. `slurm_oom`: Slurm says a step ran out of memory (its
    cgroup's OOM killer), so a rank that ended without a word was killed for memory.

    Every fault of the start is named, the first one first: each rank that failed other than
    as a consequence, and each rank that ended without a word, whose node is suspected (the
    others record their end: srun's --kill-on-bad-exit sends them SIGTERM first). When no
    rank of a start on several nodes recorded its end, the whole start was killed from
    outside: no node is suspected. `record`: run.json, if read already. A damaged record of
    the run is named in the job's output and left out.
    """
    run = RunDir(run_dir)
    progress = progress_summary(run)
    iteration = progress.iteration or 0
    hang = read_hang(run)
    # A hang record of an earlier start (one no heal read) is not this start's ending.
    if hang is not None and start is not None and hang.start and hang.start != start:
        hang = None
    if hang is not None and since is not None and hang.at < since - 2:
        hang = None
    if hang is not None:
        return _hang(hang, iteration)
    unread = [progress.unread] if progress.unread else []
    ends = rank_ends(run_dir, unread)
    for why in unread:
        log.warning("%s: left out", why)
    if start is not None:
        ends = [e for e in ends if e.start_id == start]
    elif since is not None:
        limit = dt.datetime.fromtimestamp(since - 2)  # (this machine's clock, a little slack)
        ends = [e for e in ends if e.started is not None and e.started >= limit]
    if (start is not None or since is not None) and not ends:
        return Fault(
            reason="crash",
            error="no rank started (it failed before training: see the job's output in submitit/)",
            ranks=(),
            hosts=(),
            iteration=iteration,
            at_s=time.time(),
        )
    if not any(e.how in ("failed", "hung", "no-exit") for e in ends):
        return None
    cause, *others = start_faults(ends)
    host = cause.host or "?"
    killed = cause.how == "no-exit"
    if killed and slurm_oom and not cause.oom:
        cause = dataclasses.replace(cause, oom=True)
    failure = (record if record is not None else read_record(run_dir)).failure or Failure()
    error = cause.describe()
    if failure.kind in ("environment", "out-of-memory", "diverged") and failure.error:
        error = failure.error.splitlines()[0]
    at_s = cause.at.timestamp() if cause.at is not None else None  # rank logs: local time
    oom = cause.oom or failure.kind == "out-of-memory"  # the settings, not the node
    if killed and not oom:
        return _killed(ends, iteration, error, at_s)  # (no other rank failed on its own)
    said = {"failure_kind": cause.kind, "error_type": cause.error_type}
    if cause.preflight:  # its node is left out, as a lost node
        bad = [e for e in ends if e.preflight]
        hosts = tuple(dict.fromkeys(e.host or "?" for e in bad))
        return Fault(
            reason="preflight",
            error="; ".join(e.describe() for e in bad),
            ranks=tuple(e.rank for e in bad),
            hosts=hosts,
            iteration=iteration,
            suspect_nodes=tuple(h for h in hosts if h != "?"),
            at_s=at_s,
            **said,
        )
    # Ranks killed at about the same time by a signal of their own: their nodes are suspect
    # (not for a step that ran out of memory: the settings, not the node).
    dead = [e for e in others if e.how == "no-exit" and not e.oom and not slurm_oom]
    return Fault(
        reason="out-of-memory"
        if oom
        else "diverged"
        if "diverged" in (cause.kind, failure.kind)
        else "crash",
        error="; ".join([error, *(e.describe() for e in others)]),
        ranks=(cause.rank, *(e.rank for e in others)),
        hosts=tuple(dict.fromkeys([host, *(e.host or "?" for e in others)])),
        iteration=iteration,
        suspect_nodes=tuple(dict.fromkeys(e.host for e in dead if e.host)),
        at_s=at_s,
        **said,
    )


def _hang(hang: Hang, iteration: int) -> Fault:
    """Return the hang that the watchdog's record reports."""
    stalled = tuple(sorted(hang.stalled))
    who = "every rank alike"
    if stalled:
        who = f"rank(s) {', '.join(map(str, stalled))} on {', '.join(hang.hosts)}"
    # Only a rank whose process stopped heartbeating points at its node; one that lags
    # behind (a deadlock, a stuck read) is the code's or the filesystem's.
    during = f", {hang.during}" if hang.during else ""
    error = (
        f"no progress for {round(hang.waited_s, 1)} s after iteration "
        f"{hang.iteration}{during} (limit {round(hang.limit_s, 1)} s): {who}"
    )
    return Fault(
        reason="hang",
        error=error,
        ranks=stalled,
        hosts=hang.hosts,
        iteration=iteration,
        suspect_nodes=hang.frozen_hosts,
        at_s=max(0.0, hang.at - hang.waited_s),
    )


def _killed(ends: list[RankEnd], iteration: int, error: str, at_s: float | None) -> Fault:
    """Return the crash of ranks that ended without an exit record (killed by a signal)."""
    dead = [e for e in ends if e.how == "no-exit"]
    ranks = tuple(e.rank for e in dead)
    hosts = tuple(dict.fromkeys(e.host or "?" for e in dead))
    suspects = tuple(h for h in hosts if h != "?")
    if len(dead) == len(ends) and len(hosts) > 1:
        # Nobody lived on to tell, on several nodes: no node ends ranks on another, so the
        # start was killed from outside the ranks (a signal to the whole job).
        error = (
            f"every rank ({len(dead)}) ended without an exit record, on {len(hosts)} "
            "nodes: killed from outside the ranks; no node suspected"
        )
        suspects = ()
    elif len(dead) > 1:
        who = ", ".join(f"rank {e.rank} on {e.host or '?'}" for e in dead)
        error = (
            f"{who} ended without an exit record (killed by a signal: SIGKILL, out of "
            "memory, a segfault or a lost node)"
        )
    return Fault(
        reason="crash",
        error=error,
        ranks=ranks,
        hosts=hosts,
        iteration=iteration,
        suspect_nodes=suspects,
        at_s=at_s,
    )


def _node_lost(fault: Fault, lost: Sequence[str]) -> Fault:
    """Return the fault as the loss of the nodes Slurm set DOWN (or FAIL) under the start.

    Slurm ends the start's tasks itself: on a job with spare nodes (--no-kill) it kills the
    step at once (SIGKILL, no time to checkpoint), so every rank ends without a word.
    """
    error = f"node(s) {', '.join(lost)} lost: Slurm set them DOWN while the start ran"
    return dataclasses.replace(fault, reason="node-lost", error=error, suspect_nodes=tuple(lost))


def decide(
    run_dir: Path,
    max_restarts: int,
    job_id: str | None = None,
    since: float | None = None,
    slurm_oom: bool = False,
    start: str | None = None,
    lost: Callable[[], Sequence[str]] | None = None,
) -> Healing:
    """Decide whether the ranks start again after the latest start of the run ended.

    Nothing is healed after a start that completed, stopped, was refused or cancelled, nor in
    a run whose run.json a newer mjlab-hpc wrote. Nor after running out of memory (the same
    settings run out again), the same failure as the start before (a crash loop: its kind,
    exception type, ranks and iteration), or `max_restarts` restarts after this kind of fault.
    `since`, `slurm_oom` and `start` find the fault (see `find_fault`); `job_id` goes into
    the record. `lost` asks for the start's nodes that Slurm set DOWN or
    FAIL while it ran, when the ranks point at no node: a crash or hang is then their loss
    (`node-lost`), and they are excluded.
    """
    try:  # the one read of this decision, passed on
        record = read_record(run_dir, strict=True)
    except NewerRecord as exc:  # not ours to write: the run ends as it is
        return Healing(None, why=f"not healed: {exc}")
    except DamagedRecord:
        record = RunRecord()  # (the writer's update sets it aside)
    fault = find_fault(run_dir, since=since, slurm_oom=slurm_oom, start=start, record=record)
    if fault is not None and lost and fault.reason in ("crash", "hang") and not fault.suspect_nodes:
        nodes = lost()
        fault = _node_lost(fault, nodes) if nodes else fault
    if fault is None:
        return Healing(None, why="nothing to heal", record=record)
    earlier = [f for f in record.faults if f.reason == fault.reason]
    restarts = sum(1 for f in earlier if f.kind in RESTARTED)
    entry = Interruption(
        reason=fault.reason,
        error=fault.error[:2000],
        ranks=fault.ranks,
        hosts=fault.hosts,
        nodes=fault.suspect_nodes if fault.reason == "node-lost" else (),
        iteration=fault.iteration,
        job_id=job_id,
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        at=now_iso(fault.at_s),
        at_s=fault.at_s or time.time(),
        healed_at=now_iso(),
        failure_kind=fault.failure_kind,
        error_type=fault.error_type,
    )
    heal = Healing(fault, record=record)
    last = record.faults[-1] if record.faults else None
    if cancel_marker(run_dir, record) is not None:
        heal.why = "the run was cancelled (mjlab-hpc cancel)"
    elif fault.reason == "out-of-memory":
        heal.why = f"not restarted (the same settings run out again): {memory_advice(record)}"
    elif fault.reason == "diverged":  # from its last checkpoint it diverges again
        heal.why = f"not restarted: {fault.error}"
    elif last and fault.repeats(last):
        heal.why = (
            f"the same failure at iteration {fault.iteration} as the previous start: not "
            "retried (a crash loop: a bug, a NaN or a bad node; fix it and resume)"
        )
    elif restarts >= max_restarts:
        heal.why = (
            f"--max-restarts {max_restarts}: the run already restarted {restarts} "
            f"time(s) after a {fault.reason}"
        )
    else:
        heal.requeue = True
        heal.exclude = list(fault.suspect_nodes)
        heal.why = f"requeued after a {fault.reason} ({restarts + 1} of {max_restarts})"
    heal.entry = dataclasses.replace(
        entry, kind="requeue" if heal.requeue else "failed", action=heal.why
    )
    return heal


def record_healing(
    run_dir: Path, heal: Healing, lease_wait_s: float = 60.0, replace_last: bool = False
) -> None:
    """Write the decision into run.json as the run's writer.

    It waits up to `lease_wait_s` for a crashed writer's lease to run out. `replace_last`:
    the decision corrects the fault recorded last.
    """
    try:
        writer = RunWriter.acquire(RunDir(run_dir), rank=0, timeout_s=lease_wait_s)
        try:
            record = read_record(run_dir, set_aside=True)
            if replace_last and record.faults:
                record = dataclasses.replace(record, faults=record.faults[:-1])
            entry = heal.entry
            # The cause, not a consequence the writer may have recorded.
            failure = Failure(
                kind=entry.reason,
                error=entry.error,
                rank=entry.ranks[0] if entry.ranks else None,
                host=entry.hosts[0] if entry.hosts else None,
                at=entry.at,
            )
            updated = on_fault(record, entry, heal.requeue, failure)
            writer.write_record(updated)
        finally:
            writer.release()
    finally:  # read now: never taken for a later start's
        clear_hang(RunDir(run_dir))


def _hostlist(client: SlurmClient, value: str | None) -> list[str]:
    """Expand a node list of `scontrol show job` (none for `(null)`)."""
    return [] if value in (None, "", "(null)") else client.hostnames(value) or []


def _satisfies(constraint: str, features: set[str]) -> bool | None:
    """Tell whether a node with `features` satisfies a --constraint.

    Names joined by `&` or `,` must all be there, names joined by `|` any of them. None for
    Slurm's other forms (counts, brackets).
    """
    if not re.fullmatch(r"[\w.+@:-]+([&,|][\w.+@:-]+)*", constraint):
        return None
    if "|" in constraint:
        if re.search("[&,]", constraint):
            return None
        return bool(set(constraint.split("|")) & features)
    return set(re.split("[&,]", constraint)) <= features


def usable_without(client: SlurmClient, job_id: str, exclude: Sequence[str]) -> tuple[bool, str]:
    """Tell whether the job can still run without `exclude` and the nodes it excluded before.

    It can when no node the job requires (--sbatch-arg nodelist) is excluded and enough
    usable nodes of its partition with its --constraint's features remain. The second value
    says why not.
    """
    fields = client.job_fields(job_id) or {}
    partition = fields.get("Partition", "")
    needed = int(fields.get("NumNodes", "1").split("-")[0] or 1)
    already = _hostlist(client, fields.get("ExcNodeList"))
    required = set(_hostlist(client, fields.get("ReqNodeList")))
    if required & set(exclude):
        clash = ", ".join(sorted(required & set(exclude)))
        return False, f"the job requires {clash} (--sbatch-arg nodelist): it cannot run without"
    proc = client.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N|%T|%f"])
    if proc is None or proc.returncode != 0:
        return False, "sinfo did not answer: the partition's size is unknown"
    constraint = fields.get("Features", "(null)")
    usable = set()
    for line in proc.stdout.splitlines():
        node, _, rest = line.partition("|")
        state, _, features = rest.partition("|")
        if not rest or any(s in state.upper() for s in _UNUSABLE):
            continue
        fits = True
        if constraint not in ("", "(null)"):
            fits = _satisfies(constraint, set(features.split(",")))
        if fits is None:
            return False, f"which nodes satisfy --constraint {constraint} is not known here"
        if fits:
            usable.add(node)
    remaining = usable - set(exclude) - set(already)
    if len(remaining) < needed:
        return False, (
            f"partition {partition} would have {len(remaining)} usable node(s) for a "
            f"{needed}-node job"
            + (f" with --constraint {constraint}" if constraint not in ("", "(null)") else "")
        )
    return True, ""


def restart_here(heal: Healing, excluded: Sequence[str] = ()) -> None:
    """Turn a requeue decision into a restart without the queue.

    On Slurm that is a new srun step in the same allocation that leaves out `excluded`;
    locally, new ranks under the same controller.
    """
    heal.why = "restarted without the queue " + heal.why.removeprefix("requeued ")
    heal.entry = dataclasses.replace(
        heal.entry, kind=IN_ALLOCATION, excluded_nodes=tuple(excluded), action=heal.why
    )
    heal.exclude = []


@dataclass(frozen=True)
class Step:
    """The next srun step in the job's allocation."""

    excluded: tuple[str, ...]
    """The nodes it leaves out: those the faults so far point at, and stragglers' nodes while
    spares take their place."""
    nodes: int | None = None
    """The nodes it runs on when fewer than the job's (--min-nodes), else None."""


def next_step(
    client: SlurmClient,
    run_dir: Path,
    heal: Healing,
    step_nodes: int | None,
    min_nodes: int | None = None,
) -> Step | None:
    """Choose the next srun step in this job's allocation, or None for a requeue instead.

    The step leaves out the suspect nodes while `step_nodes` others remain (None: all of the
    allocation's), or with `min_nodes` at least that many (a step on fewer nodes); it leaves
    out stragglers' nodes too while spares remain. A requeue instead: when the last restart
    in this allocation made no progress, or a suspect node has no spare to take its place
    but the partition has.
    """
    assert heal.fault is not None
    alloc = client.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or []
    record = heal.record if heal.record is not None else read_record(run_dir)
    job, count = heal.entry.job_id, heal.entry.restart_count
    healed_here = [
        f
        for f in record.faults
        if f.kind == IN_ALLOCATION and f.job_id == job and f.restart_count == count
    ]
    last_here = healed_here[-1] if healed_here else None
    # A node that failed the preflight check never lets a start progress: not a loop.
    checked = heal.fault.reason == "preflight"
    if not alloc or (
        last_here
        and not checked
        and (last_here.iteration if last_here.iteration is not None else -1) >= heal.fault.iteration
    ):
        return None
    # Stragglers' nodes left out before are slow, not broken: they count as spares again.
    slow_before = [n for f in healed_here for n in f.straggler_nodes]
    last_out = last_here.excluded_nodes if last_here else ()
    faulty = [n for n in last_out if n not in slow_before]
    excluded = list(dict.fromkeys([*faulty, *heal.exclude]))
    need = step_nodes or len(alloc)
    usable = len(set(alloc) - set(excluded))
    if usable >= (min_nodes or need):  # spares first: the same world size while they last
        # Stragglers' nodes too (those left out before first), while spares take their place:
        # never fewer nodes or a requeue for one.
        slow_now = [str(s.host) for s in record.stragglers]
        candidates = dict.fromkeys([*slow_before, *slow_now])
        slow = [h for h in candidates if h in alloc and h not in excluded]
        slow = slow[: max(0, usable - need)]
        if slow:
            heal.entry = dataclasses.replace(heal.entry, straggler_nodes=tuple(slow))
            heal.why += f"; straggler node(s) {', '.join(slow)} left out for a spare"
        nodes = usable - len(slow)
        return Step((*excluded, *slow), nodes if nodes < need else None)
    if heal.exclude and job:
        ok, why = usable_without(client, job, heal.exclude)
        if ok:
            return None  # a fresh allocation without the suspect node
        not_excluded = f"{', '.join(heal.exclude)} not excluded: no spare; {why}"
        heal.entry = dataclasses.replace(heal.entry, not_excluded=not_excluded)
    nodes = len(set(alloc) - set(faulty))
    return Step(tuple(faulty), nodes if nodes < need else None)


def _fewer_nodes(
    heal: Healing, run_dir: Path, nodes: int, tasks_per_node: int, min_nodes: int | None
) -> None:
    """Record that the next step runs on `nodes` nodes, with fewer ranks.

    The remaining ranks keep their numbers and environments; they read `world_size` to
    accept the change.
    """
    record = heal.record if heal.record is not None else read_record(run_dir)
    old_size = record.world_size or 0
    new_size = nodes * tasks_per_node
    if old_size <= new_size:  # fewer already (an earlier restart in this allocation)
        return
    gone = ", ".join(map(str, range(new_size, old_size)))
    heal.why = (
        f"{heal.why} on {nodes} node(s), {new_size} rank(s) (--min-nodes {min_nodes}; no spare "
        f"left): the environments of rank(s) {gone} dropped"
    )
    heal.entry = dataclasses.replace(heal.entry, world_size=(old_size, new_size), action=heal.why)


def place_restart(
    client: SlurmClient,
    run_dir: Path,
    heal: Healing,
    step_nodes: int | None = None,
    min_nodes: int | None = None,
    tasks_per_node: int = 1,
) -> Step | None:
    """Decide where a restart on Slurm runs: the next srun step here, or None for a requeue.

    The step is `next_step`'s (`min_nodes`: on fewer nodes, `tasks_per_node` ranks each). A
    requeue excludes the suspect nodes only while the partition still fits the job without
    them; the record says why not otherwise.
    """
    job_id = heal.entry.job_id
    if not (heal.requeue and job_id):
        return None
    step = next_step(client, run_dir, heal, step_nodes=step_nodes, min_nodes=min_nodes)
    if step is not None:
        restart_here(heal, step.excluded)
        if step.nodes is not None:
            _fewer_nodes(
                heal,
                run_dir,
                nodes=step.nodes,
                tasks_per_node=tasks_per_node,
                min_nodes=min_nodes,
            )
        return step
    if heal.exclude:
        ok, why = usable_without(client, own_job(os.environ) or job_id, heal.exclude)
        not_excluded = f"{', '.join(heal.exclude)} not excluded: {why}"
        not_excluded = heal.entry.not_excluded if ok else not_excluded
        excluded = tuple(heal.exclude) if ok else ()
        heal.entry = dataclasses.replace(
            heal.entry, excluded_nodes=excluded, not_excluded=not_excluded
        )
        if not ok:
            heal.exclude = []
    return None

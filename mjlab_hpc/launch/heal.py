"""Self-healing: after a start of a job ended because a rank crashed or hung, record the fault
and start the job again from its newest valid checkpoint, without a person.

Runs in what outlives the ranks: the Slurm batch script after srun (`mjlab-hpc heal`) and our
local controller (`mjlab_hpc.launch.executors`). From what the ranks left (`exit:` lines, the
hang watchdog's files) it decides: nothing to heal (completed, stopped, refused, cancelled);
not again (out of memory: the same settings run out again; the same failure at the same
iteration as before: a crash loop; or --max-restarts reached, counting restarts of both kinds);
else start again: in the same allocation (a new srun step, leaving out the nodes the fault
points at, and stragglers' nodes, while spare nodes of the allocation take their place), or
by a requeue when the allocation cannot run it (a suspect node and no spare, or a restart in
it that made no progress), on Slurm excluding a node the fault points at while the partition
still fits the job. The decision goes into run.json (`faults`), as the writer, before acting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import EXIT_FAILED, EXIT_OK, EXIT_REQUEUE, EXIT_RESTART
from mjlab_hpc.rank.context import START_ENV
from mjlab_hpc.rundir.ends import first_failure, memory_advice, rank_ends
from mjlab_hpc.rundir.layout import (
    SUBMITIT_DIR,
    SWEEP_ELEMENTS,
    RunDir,
    progress_summary,
    read_hangs,
    read_sweep,
)
from mjlab_hpc.rundir.state import (
    IN_ALLOCATION,
    RESTARTED,
    cancel_marker,
    now_iso,
    on_fault,
    read_record,
)
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.slurm.client import SlurmClient

__all__ = [
    "Fault",
    "Healing",
    "Step",
    "apply_slurm",
    "decide",
    "find_fault",
    "heal_job",
    "heal_slurm",
    "job_run_dir",
    "next_step",
    "record_healing",
    "restart_here",
    "usable_without",
]

log = logging.getLogger("mjlab_hpc")

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
# Node states in which a node takes no job.
_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "MAINT", "NOT_RESPONDING", "POWER", "REBOOT", "INVAL")


@dataclass(frozen=True)
class Fault:
    """What ended a start: a crash or a hang, where, and at which iteration."""

    reason: str
    """crash, hang or out-of-memory."""
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
    """When it happened (a crash: the failing rank's last log line; a hang: its last
    progress)."""

    def signature(self) -> str:
        """The fault with its numbers blanked (pids, addresses): equal for a repeat."""
        return f"{self.reason}|{_NUMBERS.sub('#', self.error)}"


@dataclass
class Healing:
    """The decision about one failed start."""

    fault: Fault | None
    """None: nothing to heal (the start completed, stopped or was refused)."""
    requeue: bool = False
    why: str = ""
    """Why not (or how) it is requeued, for people."""
    exclude: list[str] = field(default_factory=list)
    entry: dict[str, Any] = field(default_factory=dict)
    """The run.json `faults` entry."""


def find_fault(
    run_dir: Path, since: float | None = None, slurm_oom: bool = False, start: str | None = None
) -> Fault | None:  # fmt: skip
    """The crash, hang or out-of-memory that ended the latest start (None: it ended
    otherwise). `start`: the batch script's name for that srun step, which its ranks log, or
    else `since`: when that start began (epoch s, this machine's clock: the local controller's
    ranks run beside it); a rank without a start line of it failed before it could log (a
    broken node, the process group never formed), and its older lines are not this start's.
    `slurm_oom`: Slurm says a step ran out of memory (its cgroup's OOM killer): a rank ended
    without a word by it was killed for memory.

    Every rank that ended without a word is named, and its node suspected: ranks dying at
    once on two nodes are both reported (the others record their end: srun's
    --kill-on-bad-exit sends them SIGTERM first). When no rank of a start on several nodes
    recorded its end, the whole start was killed from outside: no node is suspected."""
    run = RunDir(run_dir)
    iteration = progress_summary(run).iteration or 0
    hangs = read_hangs(run)
    if hangs:
        stalled = tuple(sorted({int(r) for h in hangs for r in h.get("stalled_ranks", [])}))
        hosts = tuple(dict.fromkeys(str(x) for h in hangs for x in h.get("stalled_hosts", [])))
        first = hangs[0]
        who = f"rank(s) {', '.join(map(str, stalled))} on {', '.join(hosts)}" if stalled else (
            "every rank alike")  # fmt: skip
        # Only a rank whose process stopped heartbeating points at its node; one that lags
        # behind (a deadlock, a stuck read) is the code's or the filesystem's.
        frozen_hosts = tuple(
            dict.fromkeys(str(x) for h in hangs for x in h.get("frozen_hosts", []))
        )
        error = (f"no progress for {first.get('waited_s')} s after iteration "
                 f"{first.get('iteration')} (limit {first.get('limit_s')} s): {who}")  # fmt: skip
        began = float(first.get("at", time.time())) - float(first.get("waited_s", 0))
        return Fault("hang", error, stalled, hosts, iteration, frozen_hosts, began)
    ends = rank_ends(run_dir)
    if start is not None:
        ends = [e for e in ends if e.start_id == start]
    elif since is not None:
        limit = dt.datetime.fromtimestamp(since - 2)  # rank logs: local time, whole seconds
        ends = [e for e in ends if e.started is not None and e.started >= limit]
    if (start is not None or since is not None) and not ends:
        return Fault("crash", "no rank started (it failed before training: see the job's "
                     "output in submitit/)", (), (), iteration, (), time.time())  # fmt: skip
    if not any(e.how in ("failed", "hung", "no-exit") for e in ends):
        return None
    cause = first_failure(ends)
    assert cause is not None
    host = cause.host or "?"
    killed = cause.how == "no-exit"
    if killed and slurm_oom and not cause.oom:
        cause = dataclasses.replace(cause, oom=True)
    failure = read_record(run_dir).get("failure") or {}
    error = cause.describe()
    if failure.get("kind") in ("environment", "out-of-memory") and failure.get("error"):
        error = str(failure["error"]).splitlines()[0]
    at = cause.at.timestamp() if cause.at is not None else None  # rank logs: local time
    if cause.oom or failure.get("kind") == "out-of-memory":  # the settings, not the node
        return Fault("out-of-memory", error, (cause.rank,), (host,), iteration, (), at)
    if not killed:
        return Fault("crash", error, (cause.rank,), (host,), iteration, (), at)
    dead = [e for e in ends if e.how == "no-exit"]
    ranks = tuple(e.rank for e in dead)
    hosts = tuple(dict.fromkeys(e.host or "?" for e in dead))
    if len(dead) == len(ends) and len(hosts) > 1:
        # Nobody lived on to tell, on several nodes: no node ends ranks on another, so the
        # start was killed from outside the ranks (a signal to the whole job).
        error = (f"every rank ({len(dead)}) ended without an exit record, on {len(hosts)} "
                 "nodes: killed from outside the ranks; no node suspected")  # fmt: skip
        return Fault("crash", error, ranks, hosts, iteration, (), at)
    if len(dead) > 1:
        who = ", ".join(f"rank {e.rank} on {e.host or '?'}" for e in dead)
        error = (f"{who} ended without an exit record (killed by a signal: SIGKILL, out of "
                 "memory, a segfault or a lost node)")  # fmt: skip
    return Fault("crash", error, ranks, hosts, iteration, tuple(h for h in hosts if h != "?"), at)


def decide(
    run_dir: Path, max_restarts: int, job_id: str | None = None, since: float | None = None,
    slurm_oom: bool = False, start: str | None = None,
) -> Healing:  # fmt: skip
    """Whether to requeue after the latest start of the run in `run_dir` ended (`find_fault`
    for `since`, `slurm_oom` and `start`)."""
    fault = find_fault(run_dir, since, slurm_oom, start)
    if fault is None:
        return Healing(None, why="nothing to heal")
    rec = read_record(run_dir)
    earlier = [f for f in rec.get("faults", []) if f.get("reason") == fault.reason]
    requeued_before = sum(1 for f in earlier if f.get("kind") in RESTARTED)
    entry: dict[str, Any] = {
        "reason": fault.reason,
        "error": fault.error[:2000],
        "ranks": list(fault.ranks),
        "hosts": list(fault.hosts),
        "iteration": fault.iteration,
        "job_id": job_id,
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "at": now_iso(fault.at_s),
        "at_s": fault.at_s or time.time(),
        "healed_at": now_iso(),
        "signature": fault.signature(),
    }
    heal = Healing(fault, entry=entry)
    last = (rec.get("faults") or [None])[-1]
    if cancel_marker(run_dir, rec) is not None:
        heal.why = "the run was cancelled (mjlab-hpc cancel)"
    elif fault.reason == "out-of-memory":
        heal.why = f"not restarted (the same settings run out again): {memory_advice(rec)}"
    elif (
        last
        and last.get("signature") == entry["signature"]
        and (int(last.get("iteration", -1)) == fault.iteration)
    ):
        heal.why = (
            f"the same failure at iteration {fault.iteration} as the previous start: not "
            "retried (a crash loop: a bug, a NaN or a bad node; fix it and resume)"
        )
    elif requeued_before >= max_restarts:
        heal.why = (
            f"--max-restarts {max_restarts}: the run already restarted {requeued_before} "
            f"time(s) after a {fault.reason}"
        )
    else:
        heal.requeue = True
        heal.exclude = list(fault.suspect_nodes)
        heal.why = f"requeued after a {fault.reason} ({requeued_before + 1} of {max_restarts})"
    entry["kind"] = "requeue" if heal.requeue else "failed"
    entry["action"] = heal.why
    return heal


def record_healing(
    run_dir: Path, heal: Healing, lease_wait_s: float = 60.0, replace_last: bool = False
) -> None:
    """Write the decision into run.json as the run's writer (waiting for a crashed writer's
    lease to run out); `replace_last`: it corrects the fault recorded last."""
    try:
        writer = RunWriter.acquire(RunDir(run_dir), rank=0, timeout_s=lease_wait_s)
        try:
            before = read_record(run_dir, set_aside=True)
            if replace_last and before.get("faults"):
                before["faults"] = before["faults"][:-1]
            after = on_fault(before, heal.entry, heal.requeue)
            if not heal.requeue:  # the cause, not a consequence the writer may have recorded
                after["failure"] = {
                    "kind": heal.entry["reason"], "error": heal.entry["error"],
                    "rank": (heal.entry["ranks"] or [None])[0],
                    "host": (heal.entry["hosts"] or [None])[0], "at": heal.entry["at"],
                }  # fmt: skip
            writer.write_json(writer.run.record, after)
        finally:
            writer.release()
    finally:  # read now: never taken for a later start's
        for path in RunDir(run_dir).heartbeats.glob("hang-rank*.json"):
            path.unlink(missing_ok=True)


def _excluded(client: SlurmClient, job_id: str) -> list[str]:
    """The nodes the job already excludes."""
    value = (client.job_fields(job_id) or {}).get("ExcNodeList", "(null)")
    return [] if value in ("(null)", "") else client.hostnames(value) or []


def _hosts(client: SlurmClient, value: str | None) -> list[str]:
    return [] if value in (None, "", "(null)") else client.hostnames(value) or []


def _satisfies(constraint: str, features: set[str]) -> bool | None:
    """Whether a node with `features` satisfies a --constraint of names joined by `&` or `,`
    (all) or by `|` (any); None for Slurm's other forms (counts, brackets)."""
    if not re.fullmatch(r"[\w.+@:-]+([&,|][\w.+@:-]+)*", constraint):
        return None
    if "|" in constraint:
        return (
            None if re.search("[&,]", constraint) else bool(set(constraint.split("|")) & features)
        )
    return set(re.split("[&,]", constraint)) <= features


def usable_without(client: SlurmClient, job_id: str, exclude: Sequence[str]) -> tuple[bool, str]:
    """Whether the job can still run once `exclude` (and the nodes excluded before) are left
    out: no node the job requires (--sbatch-arg nodelist) is excluded, and enough usable nodes
    of its partition with its --constraint's features remain; and why not."""
    fields = client.job_fields(job_id) or {}
    partition = fields.get("Partition", "")
    needed = int(fields.get("NumNodes", "1").split("-")[0] or 1)
    before = _excluded(client, job_id)
    required = set(_hosts(client, fields.get("ReqNodeList")))
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
        fits = True if constraint in ("", "(null)") else _satisfies(
            constraint, set(features.split(",")))  # fmt: skip
        if fits is None:
            return False, f"which nodes satisfy --constraint {constraint} is not known here"
        if fits:
            usable.add(node)
    left = usable - set(exclude) - set(before)
    if len(left) < needed:
        return False, (
            f"partition {partition} would have {len(left)} usable node(s) for a {needed}-node job"
            + (f" with --constraint {constraint}" if constraint not in ("", "(null)") else "")
        )
    return True, ""


def _fewer_nodes(
    heal: Healing, run_dir: Path, nodes: int, tasks_per_node: int, min_nodes: int | None
) -> None:  # fmt: skip
    """Record that the next step runs on `nodes` nodes: fewer ranks, whose environments are
    those of the ranks with the same numbers (the ranks read `world_size` to accept it)."""
    before = int(read_record(run_dir).get("world_size") or 0)
    after = nodes * tasks_per_node
    if before <= after:  # fewer already (an earlier restart in this allocation)
        return
    heal.entry["world_size"] = [before, after]
    gone = ", ".join(map(str, range(after, before)))
    heal.why = heal.entry["action"] = (
        f"{heal.why} on {nodes} node(s), {after} rank(s) (--min-nodes {min_nodes}; no spare "
        f"left): the environments of rank(s) {gone} dropped"
    )


def restart_here(heal: Healing, excluded: Sequence[str] = ()) -> None:
    """Make a restart decision one without the queue: a new srun step in the same allocation
    leaving out `excluded` (locally: new ranks under the same controller)."""
    heal.entry.update(kind=IN_ALLOCATION, excluded_nodes=list(excluded))
    heal.why = heal.entry["action"] = "restarted without the queue " + heal.why.removeprefix(
        "requeued "
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
    client: SlurmClient, run_dir: Path, heal: Healing, step_nodes: int | None,
    min_nodes: int | None = None,
) -> Step | None:  # fmt: skip
    """The next srun step in this job's allocation: it leaves out the suspect nodes while
    `step_nodes` others remain (None: all of the allocation's), or, with `min_nodes`, at
    least that many (a step on fewer nodes), and stragglers' nodes while spares remain; None:
    requeue instead (the last restart in this allocation made no progress, or a suspect node
    has no spare to take its place but the partition has)."""
    assert heal.fault is not None
    alloc = client.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or []
    record = read_record(run_dir)
    job, count = heal.entry["job_id"], heal.entry["restart_count"]
    here = [f for f in record.get("faults", []) if f.get("kind") == IN_ALLOCATION
            and f.get("job_id") == job and f.get("restart_count") == count]  # fmt: skip
    if not alloc or (here and int(here[-1].get("iteration", -1)) >= heal.fault.iteration):
        return None
    # Stragglers' nodes left out before are slow, not broken: they count as spares again.
    slow_before = [n for f in here for n in f.get("straggler_nodes", [])]
    before = [n for n in (here[-1].get("excluded_nodes", []) if here else [])
              if n not in slow_before]  # fmt: skip
    wanted = list(dict.fromkeys([*before, *heal.exclude]))
    need = step_nodes or len(alloc)
    left = len(set(alloc) - set(wanted))
    if left >= (min_nodes or need):  # spares first: the same world size while they last
        # Stragglers' nodes too (those left out before first), while spares take their place:
        # never fewer nodes or a requeue for one.
        now = [str(s.get("host")) for s in record.get("stragglers") or []]
        slow = [h for h in dict.fromkeys([*slow_before, *now]) if h in alloc and h not in wanted]
        slow = slow[: max(0, left - need)]
        if slow:
            heal.entry["straggler_nodes"] = slow
            heal.why += f"; straggler node(s) {', '.join(slow)} left out for a spare"
        left -= len(slow)
        return Step((*wanted, *slow), left if left < need else None)
    if heal.exclude and job:
        ok, why = usable_without(client, job, heal.exclude)
        if ok:
            return None  # a fresh allocation without the suspect node
        heal.entry["not_excluded"] = f"{', '.join(heal.exclude)} not excluded: no spare; {why}"
    left = len(set(alloc) - set(before))
    return Step(tuple(before), left if left < need else None)


def apply_slurm(client: SlurmClient, job_id: str, heal: Healing) -> bool:
    """Requeue the job (from inside it), excluding the suspect nodes. True when done."""
    if not heal.exclude:
        return client.requeue(job_id)
    nodes = ",".join(dict.fromkeys([*_excluded(client, job_id), *heal.exclude]))
    # A running job's ExcNodeList cannot change; a requeued one's can, in the seconds before
    # Slurm may start it again (its begin time, ~10 s). The requeue ends this script (SIGTERM,
    # SIGKILL after KillWait): the change follows at once. No requeuehold and later release:
    # a release before the requeue completes is lost, and a helper meant to release it later
    # dies with the job under proctrack/cgroup: the job stayed held for good (seen on 22.05
    # and 24.11 with task/cgroup).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not client.requeue(job_id):
        return False
    update = client.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={nodes}"])
    if update is None or update.returncode != 0:  # it runs again, maybe on the same node
        log.error("excluding %s failed: %s", nodes, update and update.stderr.strip())
    return True


def heal_slurm(
    run_dir: Path, exit_code: int, max_restarts: int, client: SlurmClient,
    since: float | None = None, submitit_dir: Path | None = None, step_nodes: int | None = None,
    min_nodes: int | None = None, tasks_per_node: int = 1,
) -> int:  # fmt: skip
    """The batch script's step after srun: decide, record, act; the script's exit code
    (EXIT_RESTART: another srun step, with the srun options printed on stdout). `since`: when
    this srun step began; `submitit_dir`: the job's submitit folder; `step_nodes`: the
    nodes of a step (the allocation's others are spares); `min_nodes`: the fewest nodes a step
    may go on with (`tasks_per_node` ranks each)."""
    if exit_code in (EXIT_OK, EXIT_REQUEUE):  # done; or a stop the ranks want requeued
        return exit_code
    exit_code = EXIT_FAILED if exit_code == EXIT_RESTART else exit_code  # not ours: no loop
    job_id = os.environ.get("SLURM_JOB_ID")
    start = os.environ.get(START_ENV) or None
    heal = decide(run_dir, max_restarts, job_id, None if start else since,
                  bool(job_id and client.out_of_memory(job_id)), start)  # fmt: skip
    if heal.fault is None:
        return exit_code
    here = (
        next_step(client, run_dir, heal, step_nodes, min_nodes) if heal.requeue and job_id else None
    )
    if here is not None:
        restart_here(heal, here.excluded)
        if here.nodes is not None:
            _fewer_nodes(heal, run_dir, here.nodes, tasks_per_node, min_nodes)
    elif heal.requeue and heal.exclude and job_id:
        ok, why = usable_without(client, job_id, heal.exclude)
        heal.entry["excluded_nodes"] = heal.exclude if ok else []
        if not ok:
            heal.entry["not_excluded"] = f"{', '.join(heal.exclude)} not excluded: {why}"
            heal.exclude = []
    _say(heal)
    try:
        record_healing(run_dir, heal)
    except Exception as exc:  # the run matters more than its record: heal anyway
        log.error("could not record the fault in run.json: %s", exc)
        here = None  # unrecorded restarts would escape --max-restarts: a requeue instead
    if heal.requeue and submitit_dir is not None:
        # The failed start's results (a rank's exception): `mjlab-submit --follow` would take
        # one that the next start has not rewritten yet for its own (seen on 24.11).
        key = os.environ.get("SLURM_ARRAY_TASK_ID")
        key = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{key}" if key else job_id
        for stale in submitit_dir.glob(f"{key}_*_result.pkl"):
            stale.unlink(missing_ok=True)
    if here is not None:  # the batch script's options for its next srun step
        options = [f"--exclude={','.join(here.excluded)}"] if here.excluded else []
        if here.nodes is not None:
            options += [f"--nodes={here.nodes}", f"--ntasks={here.nodes * tasks_per_node}"]
        print(" ".join(options), flush=True)
        return EXIT_RESTART
    if (
        heal.requeue
        and job_id
        and shutil.which("scontrol", path=(client.env or os.environ).get("PATH")) is None
    ):
        return EXIT_REQUEUE  # inside an image without Slurm's client: the batch shell requeues
    if heal.requeue and job_id and apply_slurm(client, job_id, heal):
        return EXIT_OK
    if heal.requeue:  # run.json must not say requeued
        heal.requeue = False
        heal.entry["kind"] = "failed"
        heal.entry["action"] = f"{heal.why}, but Slurm refused the requeue (see the job's output)"
        with contextlib.suppress(Exception):
            record_healing(run_dir, heal, replace_last=True)
    return exit_code if exit_code != EXIT_OK else EXIT_FAILED


def _say(heal: Healing) -> None:
    assert heal.fault is not None
    print(f"mjlab-hpc heal: {heal.fault.reason} after iteration {heal.fault.iteration}: "
          f"{heal.fault.error}; {heal.why}", file=sys.stderr, flush=True)  # fmt: skip
    if heal.entry.get("excluded_nodes"):
        print(f"mjlab-hpc heal: excluding node(s) {', '.join(heal.entry['excluded_nodes'])}",
              file=sys.stderr, flush=True)  # fmt: skip
    if heal.entry.get("not_excluded"):
        print(f"mjlab-hpc heal: {heal.entry['not_excluded']}", file=sys.stderr, flush=True)


def job_run_dir(path: Path, env: Mapping[str, str]) -> Path:
    """The run directory of this job: `path`, or for a sweep's job array (`path` is the sweep
    directory) the run directory of this array element (linked from the sweep's directory)."""
    index = env.get("SLURM_ARRAY_TASK_ID", "0")
    link = path / SWEEP_ELEMENTS / index
    if link.is_dir():
        return link.resolve()
    elements = read_sweep(path).get("elements")
    return Path(elements[int(index)]["run_dir"]) if elements else path


def heal_job(
    run_dir: Path, exit_code: int, max_restarts: int, elapsed_s: float | None = None,
    step_nodes: int | None = None, min_nodes: int | None = None, tasks_per_node: int = 1,
) -> int:  # fmt: skip
    """What a Slurm job script runs after srun: heal (see `heal_slurm`), never raising; the
    script's exit code. `elapsed_s`: how long the srun step ran."""
    logging.basicConfig(level=logging.INFO, format="mjlab-hpc heal: %(message)s")
    since = time.time() - elapsed_s if elapsed_s is not None else None
    try:
        return heal_slurm(job_run_dir(run_dir, os.environ), exit_code, max_restarts,
                          SlurmClient(), since, run_dir / SUBMITIT_DIR, step_nodes, min_nodes,
                          tasks_per_node)  # fmt: skip
    except Exception as exc:  # the job's own exit code matters more than ours
        print(f"mjlab-hpc heal: could not heal on {socket.gethostname()}: {exc}",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED if exit_code in (EXIT_OK, EXIT_RESTART) else exit_code

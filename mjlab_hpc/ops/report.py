"""`mjlab-hpc report`: what a run cost, across all its jobs, requeues and heals.

The allocations come from sacct (one row per run of a job: each requeue is another), or, for
a local run or when accounting does not answer, from the run's own records: a local run
holds its machine from the moment its directory was made to its last rank's end, and a Slurm
run each of its jobs from the first start to the last end in it.

Every second of an allocation is put in one phase, so the phases add up to the allocation:
`checkpointing` (logs/checkpoints.jsonl), `recomputed` (iterations done again after a fault:
from the checkpoint the next start resumed from to the fault), `lost_to_faults` (from a fault
to the next start, or to the end of the allocation), `training` (the iterations that count),
`start_up` (from the allocation's or the heal's start to the first iteration), `spare` (the
nodes of an allocation the ranks did not run on, while they ran on the others) and `other`
(the rest: the end of the job, a stop's wait for the requeue). A suspended job holds its
nodes but is not charged for them (sacct's ElapsedRaw leaves its Suspended seconds out):
suspended time is in no phase, put on the timeline where the records pause longest. Queue
wait is not allocated time either: sacct's Eligible to Start, summed over the job's runs (a
chain link's wait for the previous link is not queue wait).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mjlab_hpc.console import inert
from mjlab_hpc.ops.runs import JobKind, RunJobs, created_at, run_jobs
from mjlab_hpc.rundir.ends import RankStart, rank_starts, read_end
from mjlab_hpc.rundir.layout import RunDir, list_checkpoints
from mjlab_hpc.rundir.progress import (
    CheckpointTime,
    ProgressLine,
    read_checkpoint_times,
    read_progress,
)
from mjlab_hpc.rundir.record import RunRecord, read_record
from mjlab_hpc.rundir.running import run_processes
from mjlab_hpc.slurm.client import SlurmClient, Usage

__all__ = [
    "PHASES",
    "Allocation",
    "CostReport",
    "Efficiency",
    "Phase",
    "collect_report",
    "draw_timeline",
    "report_table",
]

#: The phases of allocated time, in the order they are shown (they add up to the total).
PHASES = (
    "start_up",
    "training",
    "checkpointing",
    "recomputed",
    "lost_to_faults",
    "spare",
    "other",
)
# Where phases overlap, the first of these wins (a checkpoint inside a training span is
# checkpointing; iterations done again are recomputed, not training).
# Suspended time is no phase at all.
_PRECEDENCE = (
    "suspended",
    "checkpointing",
    "lost_to_faults",
    "recomputed",
    "training",
    "start_up",
)
# Phases of the ranks' work: an allocation's nodes the ranks did not run on are `spare` then.
_WORK = frozenset({"start_up", "training", "checkpointing", "recomputed"})
_COLORS = {
    "start_up": "tab:orange",
    "training": "tab:green",
    "checkpointing": "tab:blue",
    "recomputed": "tab:purple",
    "lost_to_faults": "tab:red",
    "spare": "khaki",
    "other": "lightgray",
    "queue": "whitesmoke",
    "suspended": "black",
}


# CostReport's fields for --out only (left out of --json).
_DRAWN = ("timeline", "iteration_times", "start_times", "fault_times", "stop_times")


@dataclass(frozen=True)
class Allocation:
    """One allocation of the run: a run of a Slurm job, or the local run's machine."""

    label: str
    """The job id (a local run: its controller's id, or `local`)."""
    begin: float
    """When it began (epoch s)."""
    end: float
    """When it ended (epoch s; now for one that still runs)."""
    nodes: int
    """Nodes held."""
    cores: int
    """Cores held over all its nodes (sacct's AllocCPUS; local: ranks x torch threads)."""
    gpus: int
    """GPUs held over all its nodes (0: none)."""
    submitted: float | None = None
    """When it was queued (sacct's Submit; None: not known)."""
    eligible: float | None = None
    """When it could start (sacct's Eligible: after Submit for a chain link that waited for
    the previous link, or a --begin time; None: not known)."""
    suspended_s: float = 0.0
    """Seconds it was suspended (sacct's Suspended): held, not charged."""

    @property
    def held_s(self) -> float:
        """Seconds charged: from begin to end, suspended time left out (sacct's ElapsedRaw)."""
        return max(0.0, self.end - self.begin - self.suspended_s)

    @property
    def queued(self) -> float | None:
        """When its queue wait began: Eligible, else Submit (None: not known)."""
        known = [t for t in (self.submitted, self.eligible) if t is not None]
        return max(known) if known else None


@dataclass(frozen=True)
class Phase:
    """One span of time on the timeline, in one phase (or `queue`)."""

    name: str
    """One of PHASES, `queue` or `suspended`."""
    begin: float
    """Epoch s."""
    end: float
    """Epoch s."""


@dataclass(frozen=True)
class Efficiency:
    """Slurm's own figures for the run's jobs, where accounting gathered them."""

    total_cpu_s: float | None
    """TotalCPU over every step of every run of the jobs."""
    cpu_efficiency: float | None
    """TotalCPU over the cores held for the jobs' elapsed time (0-1)."""
    max_rss_bytes: int | None
    """The largest MaxRSS of one task of any step."""
    gpu_util: str | None
    """TRESUsageInMax's gres/gpuutil (the site gathers GPU figures)."""
    gpu_mem: str | None
    """TRESUsageInMax's gres/gpumem."""
    missing: tuple[str, ...]
    """The figures accounting does not have (TotalCPU, MaxRSS, gres/gpuutil, gres/gpumem)."""


@dataclass(frozen=True)
class CostReport:
    """What a run cost: `mjlab-hpc report`, and `--json`'s keys."""

    run_dir: Path
    """The run."""
    kind: JobKind | None
    """slurm, local, or None (a plain process)."""
    job_ids: tuple[str, ...]
    """Its jobs, oldest first."""
    source: str
    """`sacct` (allocations from accounting) or `records` (from the run's own records)."""
    allocations: tuple[Allocation, ...]
    """Every allocation of the run, oldest first."""
    node_hours: float
    """Allocated node-hours, every allocation of the run."""
    gpu_hours: float | None
    """Allocated GPU-hours (None: no GPU was allocated)."""
    core_hours: float
    """Allocated core-hours."""
    phase_hours: Mapping[str, float]
    """Node-hours by phase (PHASES); they add up to node_hours."""
    phase_share: Mapping[str, float]
    """The same as shares of the allocated time (0-1)."""
    queue_wait_s: float | None
    """Seconds the jobs waited in the queue once they could start (sacct's Eligible to Start;
    None: not known without accounting)."""
    suspended_s: float
    """Seconds the jobs were suspended (sacct's Suspended): not in node_hours."""
    starts: int
    """Starts of the ranks: the first, and one per requeue or heal."""
    faults: int
    """Crashes, hangs and lost nodes (run.json `faults`)."""
    stops: int
    """Stops with a checkpoint (time limit, preemption, Ctrl-C)."""
    checkpoints: int
    """Checkpoints written (logs/checkpoints.jsonl)."""
    iterations: int
    """Iterations that count (the last in progress.jsonl)."""
    recomputed_iterations: int
    """Iterations done again after faults (past the checkpoint a start resumed from)."""
    env_steps: int
    """Useful env-steps: the counted iterations' (num_envs x steps per env x ranks each)."""
    env_steps_per_hour: float | None
    """env-steps per GPU-hour, or per core-hour on CPU."""
    per: str
    """`GPU-hour` or `core-hour`."""
    efficiency: Efficiency | None
    """Slurm's figures (None: no Slurm job, or accounting did not answer)."""
    notes: tuple[str, ...] = ()
    """What could not be known, one line each (accounting missing, a run still running)."""
    timeline: tuple[Phase, ...] = field(default=(), repr=False)
    """Every phase span and queue wait, in time order (for --out)."""
    iteration_times: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    """(iteration, when it completed) of the counted iterations (for --out)."""
    start_times: tuple[float, ...] = field(default=(), repr=False)
    """When each start began (for --out)."""
    fault_times: tuple[float, ...] = field(default=(), repr=False)
    """When each fault happened (for --out)."""
    stop_times: tuple[float, ...] = field(default=(), repr=False)
    """When each stop's checkpoint was asked for (for --out)."""

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for `report --json` (documented keys; the timeline left out)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _DRAWN
        }
        out["run_dir"] = str(self.run_dir)
        out["job_ids"] = list(self.job_ids)
        out["allocations"] = [dataclasses.asdict(a) for a in self.allocations]
        out["phase_hours"] = dict(self.phase_hours)
        out["phase_share"] = dict(self.phase_share)
        out["efficiency"] = (
            dataclasses.asdict(self.efficiency) if self.efficiency is not None else None
        )
        if self.efficiency is not None:
            out["efficiency"]["missing"] = list(self.efficiency.missing)
        out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class _Start:
    """One start of the ranks, from their start and end records."""

    begin: float
    """Its first rank's start (epoch s)."""
    end: float | None
    """Its last rank's end (None: no rank recorded one)."""
    nodes: int
    """Nodes its ranks ran on."""
    ranks: int
    """Ranks that recorded it."""


def _starts(run_dir: Path, unread: list[str]) -> list[_Start]:
    """The starts of the run, oldest first: the n-th start record of every rank is start n.

    A damaged record is named in `unread` and left out.
    """
    by_number: dict[int, list[tuple[RankStart, float | None]]] = {}
    for rank in RunDir(run_dir).rank_numbers():
        for start in rank_starts(run_dir, rank, unread):
            end = read_end(run_dir, start, unread)
            by_number.setdefault(start.number, []).append((start, end.at if end else None))
    out = []
    for _, group in sorted(by_number.items()):
        ends = [e for _, e in group if e is not None]
        out.append(
            _Start(
                begin=min(s.at for s, _ in group),
                end=max(ends) if ends else None,
                nodes=len({s.node for s, _ in group}),
                ranks=len(group),
            )
        )
    return out


def _cores_per_rank(record: RunRecord) -> int:
    threads = record.spec.torch_threads if record.spec is not None else 0
    return threads if threads > 0 else 1


# The longest a local launch takes from making the run to its first rank's start (imports).
_LAUNCH_S = 600.0


def _local_allocations(
    run_dir: Path, record: RunRecord, starts: list[_Start], last: float, label: str
) -> list[Allocation]:
    """The machine a local run held: from its directory's making to its last end.

    The making is told by the directory's name, which anyone may choose (`--run-dir`): it
    counts only as far as a launch takes before the first rank starts."""
    made = created_at(run_dir)
    begin = made
    if starts:
        first = starts[0].begin
        begin = made if first - _LAUNCH_S <= made <= first else first
    ranks = max((s.ranks for s in starts), default=record.world_size or 1)
    gpus = ranks if (record.device or "").startswith("cuda") else 0
    return [
        Allocation(
            label=label,
            begin=begin,
            end=max(last, begin),
            nodes=1,
            cores=ranks * _cores_per_rank(record),
            gpus=gpus,
        )
    ]


def _record_allocations(
    record: RunRecord, starts: list[_Start], last: float, in_allocation: set[int]
) -> list[Allocation]:
    """A Slurm run's allocations without accounting: each from a start (not one restarted in
    the allocation) to the last end before the next such start."""
    groups: list[list[_Start]] = []
    for i, start in enumerate(starts):
        if groups and i in in_allocation:
            groups[-1].append(start)
        else:
            groups.append([start])
    out = []
    for n, group in enumerate(groups):
        nxt = groups[n + 1][0].begin if n + 1 < len(groups) else None
        ends = [s.end for s in group if s.end is not None]
        end = max(ends) if ends else (nxt if nxt is not None else last)
        gpn = record.world_size // record.num_nodes if record.world_size and record.num_nodes else 0
        nodes = max(s.nodes for s in group)
        gpus = nodes * gpn if (record.device or "").startswith("cuda") else 0
        cores = max(s.ranks for s in group) * _cores_per_rank(record)
        label = _job_at(record, group[0].begin)
        out.append(Allocation(label, group[0].begin, max(end, group[0].begin), nodes, cores, gpus))
    return out


def _job_at(record: RunRecord, at: float) -> str:
    """The job of the recorded start nearest to `at` (`?`: none recorded)."""
    known = []
    for start in record.starts:
        with contextlib.suppress(ValueError):
            known.append((abs(dt.datetime.fromisoformat(start.at).timestamp() - at), start))
    return str(min(known, key=lambda k: k[0])[1].job_id or "?") if known else "?"


def _sacct_allocations(usage: Sequence[Usage], now: float) -> list[Allocation]:
    """The runs of the jobs that held nodes, oldest first (a run never started is left out).

    A RESIZING row is an allocation too: the job's nodes before Slurm shrank it (a node lost
    under --no-kill), up to the next row of the same job.
    """
    out = []
    for row in usage:
        if row.step or row.start is None:
            continue
        end = row.end if row.end is not None else now
        out.append(
            Allocation(
                label=row.job_id,
                begin=row.start,
                end=max(end, row.start),
                nodes=row.nodes or 1,
                cores=row.cpus or 0,
                gpus=row.gpus or 0,
                submitted=row.submit,
                eligible=row.eligible,
                suspended_s=min(row.suspended_s, max(0.0, end - row.start)),
            )
        )
    return sorted(out, key=lambda a: a.begin)


def _pending(usage: Sequence[Usage], now: float) -> list[str]:
    """One note per job of the run that waits in the queue, with how long it has waited."""
    notes = []
    for row in usage:
        if not row.step and row.start is None and row.state == "PENDING":
            since = row.eligible or row.submit
            waited = f" for {_duration(now - since)}" if since is not None else ""
            notes.append(
                f"job {row.job_id} is pending: it has waited{waited} and holds no nodes yet"
            )
    return notes


def _efficiency(usage: Sequence[Usage]) -> Efficiency:
    runs = [u for u in usage if not u.step]
    steps = [u for u in usage if u.step]
    cpu = [u.total_cpu_s for u in (steps or runs) if u.total_cpu_s is not None]
    total_cpu = sum(cpu) if cpu else None
    held = sum(u.elapsed_s * (u.cpus or 0) for u in runs)
    rss = [u.max_rss for u in steps if u.max_rss]
    util = [u.tres_usage["gres/gpuutil"] for u in steps if u.tres_usage.get("gres/gpuutil")]
    mem = [u.tres_usage["gres/gpumem"] for u in steps if u.tres_usage.get("gres/gpumem")]
    missing = [
        name
        for name, found in (
            ("TotalCPU", bool(total_cpu)),
            ("MaxRSS", bool(rss)),
            ("gres/gpuutil", bool(util)),
            ("gres/gpumem", bool(mem)),
        )
        if not found
    ]
    return Efficiency(
        total_cpu_s=total_cpu if total_cpu else None,
        cpu_efficiency=round(total_cpu / held, 4) if total_cpu and held else None,
        max_rss_bytes=max(rss) if rss else None,
        gpu_util=max(util, key=_leading_number) if util else None,
        gpu_mem=max(mem, key=_leading_number) if mem else None,
        missing=tuple(missing),
    )


def _leading_number(text: str) -> float:
    digits = ""
    for ch in text:
        if not (ch.isdigit() or ch == "."):
            break
        digits += ch
    try:
        return float(digits)
    except ValueError:
        return 0.0


def _work_s(line: ProgressLine) -> float:
    """An iteration's own seconds (collect and learn) from its progress record."""
    return line.collect_s + line.learn_s


def _time(line: ProgressLine) -> float:
    """When an iteration's record was written (the lines read here all say)."""
    return line.time or 0.0


def _phases(
    starts: list[_Start],
    allocations: list[Allocation],
    progress: list[ProgressLine],
    saves: list[CheckpointTime],
    record: RunRecord,
) -> tuple[list[Phase], int]:
    """The spans of each phase (overlapping; `_PRECEDENCE` settles overlaps), and the
    iterations recomputed."""
    spans: list[Phase] = [Phase("checkpointing", c.at, c.at + c.s) for c in saves]
    median_s = statistics.median([_work_s(r) for r in progress]) if progress else 0.0
    faults = sorted(record.faults, key=lambda f: f.when_s)
    # Sorted once and cut by bisection: linear in the run's length, whatever its starts.
    progress = sorted(progress, key=_time)
    done_at = [_time(r) for r in progress]
    saves = sorted(saves, key=lambda c: c.at)
    saved_at = [c.at for c in saves]
    begins = [s.begin for s in starts]
    held_from = [a.begin for a in allocations]
    recomputed_total = 0
    for n, start in enumerate(starts):
        nxt = starts[n + 1].begin if n + 1 < len(starts) else float("inf")
        mine = progress[bisect.bisect_left(done_at, start.begin) : bisect.bisect_left(done_at, nxt)]
        fault = next((f for f in faults if start.begin <= f.when_s < nxt), None)
        home = bisect.bisect_right(held_from, start.begin + 1e-6)
        window = allocations[home - 1] if home else (allocations[0] if allocations else None)
        first_in_window = window is not None and bisect.bisect_left(begins, window.begin, 0, n) == n
        began = window.begin if window is not None and first_in_window else start.begin
        recomputed = 0
        if fault is not None:
            if fault.recomputed is not None:
                recomputed = fault.recomputed
            elif fault.iteration is not None and n + 1 < len(starts) and mine:
                recomputed = max(0, fault.iteration - mine[-1].iteration)
        recomputed_total += recomputed
        if mine:
            first_work = (mine[0].time or start.begin) - _work_s(mine[0])
            done = mine[-1].time or first_work
            own = saves[
                bisect.bisect_left(saved_at, start.begin) : bisect.bisect_left(saved_at, nxt)
            ]
            last_save = max((c.at + c.s for c in own), default=done)
            spans.append(Phase("training", first_work, max(done, last_save)))
            redo_from = max(done, last_save)
        else:  # nothing of this start counts: its iterations were all done again
            fault_at = fault.when_s if fault is not None else start.end or start.begin
            first_work = max(start.begin, fault_at - recomputed * median_s)
            redo_from = first_work
        spans.append(Phase("start_up", began, max(began, first_work)))
        if fault is not None:
            if recomputed:
                spans.append(Phase("recomputed", redo_from, max(redo_from, fault.when_s)))
            # To the next start, but a requeue's new allocation starts up anew: the fault's
            # loss ends with its own allocation.
            held = [a.end for a in allocations if a.begin <= fault.when_s < a.end]
            lost_to = min([nxt, *held])
            if lost_to == float("inf"):
                lost_to = start.end or fault.when_s
            spans.append(Phase("lost_to_faults", fault.when_s, max(fault.when_s, lost_to)))
    return spans, recomputed_total


def _older_records(
    run: RunDir, record: RunRecord, starts: list[_Start], saves: list[CheckpointTime]
) -> list[str]:
    """What the records of a run written by an older mjlab-hpc lack, one note each."""
    notes = []
    if record.starts and not starts and not run.rank_records.exists():
        notes.append(
            f"the run has no rank start and end records ({run.rank_records.relative_to(run.path)}/"
            f": an older mjlab-hpc wrote it): its {len(record.starts)} start(s) are from "
            "run.json, and start-up, training and faults are not told apart (all in `other`)"
        )
    if list_checkpoints(run.path) and not saves and not run.checkpoint_times.exists():
        notes.append(
            f"the run has no checkpoint times ({run.checkpoint_times.relative_to(run.path)}: "
            "an older mjlab-hpc wrote it): checkpoint writes are not told apart"
        )
    return notes


def _suspensions(
    allocation: Allocation, progress_at: Sequence[float], work_s: float
) -> list[Phase]:
    """Where the allocation's suspended seconds go on the timeline: the longest pauses in its
    records (between iterations, or before the first or after the last), longest first.

    sacct says how long a job was suspended, not when; the ranks' records stop meanwhile.
    """
    left = allocation.suspended_s
    if left <= 0:
        return []
    lo = bisect.bisect_right(progress_at, allocation.begin)
    hi = bisect.bisect_left(progress_at, allocation.end)
    marks = [allocation.begin, *progress_at[lo:hi], allocation.end]
    pauses = sorted(((b - a - work_s, a, b) for a, b in itertools.pairwise(marks)), reverse=True)
    out = []
    for _, a, b in pauses:
        if left <= 0:
            break
        took = min(left, b - a)
        out.append(Phase("suspended", b - took, b))
        left -= took
    return out


def _cover(
    spans: Sequence[Phase], allocation: Allocation, working: Callable[[float], int]
) -> tuple[dict[str, float], list[Phase]]:
    """Node-seconds of each phase inside one allocation, every second in exactly one phase
    (suspended seconds in none), and the pieces of its timeline.

    A sweep over the spans' ends (linear after one sort, however many spans): `working(t)` is
    the nodes the ranks ran on at t; the allocation's other nodes are `spare` while they work.
    """
    events = []
    for span in spans:
        begin, end = max(span.begin, allocation.begin), min(span.end, allocation.end)
        if begin < end:
            events += [(begin, 1, span.name), (end, -1, span.name)]
    events.sort(key=lambda e: e[0])
    active = dict.fromkeys(_PRECEDENCE, 0)
    node_s = dict.fromkeys(PHASES, 0.0)
    pieces: list[Phase] = []

    def piece(a: float, b: float) -> None:
        name = next((p for p in _PRECEDENCE if active[p] > 0), "other")
        if name in _WORK:
            ranks = min(allocation.nodes, working((a + b) / 2))
            node_s[name] += (b - a) * ranks
            node_s["spare"] += (b - a) * (allocation.nodes - ranks)
        elif name != "suspended":
            node_s[name] += (b - a) * allocation.nodes
        if pieces and pieces[-1].name == name and pieces[-1].end == a:
            pieces[-1] = Phase(name, pieces[-1].begin, b)
        else:
            pieces.append(Phase(name, a, b))

    at = allocation.begin
    for t, step, name in events:
        if t > at:
            piece(at, t)
            at = t
        active[name] += step
    if allocation.end > at:
        piece(at, allocation.end)
    return node_s, pieces


def _working(starts: Sequence[_Start], record: RunRecord) -> Callable[[float], int]:
    """The nodes the ranks ran on at a time: the latest start's by then (the first start's
    before it). A start whose ranks did not all record it counts the run's node count; with
    no start recorded, every node of the allocation works."""
    begins = [s.begin for s in starts]
    everyone = 1 << 30

    def at(t: float) -> int:
        if not starts:
            return everyone
        start = starts[max(0, bisect.bisect_right(begins, t) - 1)]
        if record.world_size and start.ranks >= record.world_size:
            return start.nodes
        return record.num_nodes or everyone

    return at


def _last_and_running(
    run_dir: Path, kind: JobKind | None, record: RunRecord, marks: list[float], ended: bool
) -> tuple[float, str | None]:
    """When the run's records end, or now with a note for a run that still runs.

    A Slurm run runs while its record says so and a start has no end (sacct's rows say it
    better where accounting answers); a local run or a plain process only while a process it
    recorded lives: one killed with no end record costs nothing from its last record on.
    """
    last = max(marks, default=created_at(run_dir))
    if ended or record.state not in (None, "running"):
        return last, None
    if kind == "slurm" or run_processes(run_dir):
        return time.time(), "the run is still running: figures up to now"
    return last, (
        "the run's processes are gone and left no end record (killed, or its machine lost): "
        "figures up to its last record"
    )


def _allocations(
    run_dir: Path,
    jobs: RunJobs,
    record: RunRecord,
    starts: list[_Start],
    last: float,
    slurm: SlurmClient | None,
) -> tuple[list[Allocation], Sequence[Usage] | None, list[str]]:
    """The run's allocations: sacct's rows of its Slurm jobs, else from its records; what
    sacct answered, and notes."""
    if jobs.kind != "slurm":
        label = jobs.current or "local"
        return _local_allocations(run_dir, record, starts, last, label), None, []
    notes: list[str] = []
    usage = None
    if jobs.job_ids:
        client = slurm or SlurmClient()
        usage = client.usage(jobs.job_ids)
        notes += client.bad_rows
        if usage is None:
            notes.append(
                "sacct did not answer (accounting disabled or unreachable): allocations from "
                "the run's records, queue wait unknown"
            )
    if usage:
        return _sacct_allocations(usage, time.time()), usage, notes + _pending(usage, time.time())
    in_allocation = {
        i + 1
        for i, s in enumerate(starts[:-1])
        if any(
            f.kind == "in-allocation" and s.begin <= f.when_s < starts[i + 1].begin
            for f in record.faults
        )
    }
    if usage is not None:  # sacct answered with nothing: the job is not in accounting (yet)
        queue = (slurm or SlurmClient()).squeue(jobs.job_ids) or ()
        notes += [
            f"job {r.job_id} is pending ({r.reason or 'queued'}): it holds no nodes yet"
            for r in queue
            if r.state == "PENDING"
        ]
        notes.append("sacct has no record of the jobs: allocations from the run's records")
    return _record_allocations(record, starts, last, in_allocation), usage, notes


def collect_report(run_dir: Path, slurm: SlurmClient | None = None) -> CostReport:
    """Work out what the run cost, from sacct (Slurm jobs) and the run's own records."""
    jobs = run_jobs(run_dir)
    record = read_record(run_dir)
    run = RunDir(run_dir)
    lines, times = read_progress(run), read_checkpoint_times(run)
    progress = [r for r in lines.values if r.time is not None]
    saves = list(times.values)
    unread = [*lines.unread, *times.unread]
    starts = _starts(run_dir, unread)
    notes = [f"{why}: left out" for why in dict.fromkeys(unread)]
    notes += _older_records(run, record, starts, saves)
    marks = [
        *(s.end for s in starts if s.end is not None),
        *(_time(r) for r in progress),
        *(e.when_s for e in record.interruptions),
        *(c.at + c.s for c in saves),
    ]
    ended = not starts or starts[-1].end is not None
    last, running = _last_and_running(run_dir, jobs.kind, record, marks, ended)
    allocations, usage, more = _allocations(run_dir, jobs, record, starts, last, slurm)
    if usage:  # sacct knows whether a job still holds its nodes
        live = any(not u.step and u.start is not None and u.end is None for u in usage)
        running = "the run is still running: figures up to now" if live else None
    notes += [*([running] if running else []), *more]
    spans, recomputed = _phases(starts, allocations, progress, saves, record)
    done_at = sorted(_time(r) for r in progress)
    median_s = statistics.median([_work_s(r) for r in progress]) if progress else 0.0
    node_s = dict.fromkeys(PHASES, 0.0)
    timeline: list[Phase] = []
    working = _working(starts, record)
    for a in allocations:
        seconds, pieces = _cover([*spans, *_suspensions(a, done_at, median_s)], a, working)
        for name, s in seconds.items():
            node_s[name] += s
        timeline += pieces
        if a.queued is not None and a.queued < a.begin:
            timeline.append(Phase("queue", a.queued, a.begin))
    queue_wait = None
    if usage:
        queue_wait = sum(max(0.0, a.begin - a.queued) for a in allocations if a.queued)
    elif jobs.kind != "slurm":
        queue_wait = 0.0
    return CostReport(
        run_dir=run_dir,
        kind=jobs.kind,
        job_ids=jobs.job_ids,
        source="sacct" if usage else "records",
        allocations=tuple(allocations),
        **_hours_of(allocations, node_s, progress),
        queue_wait_s=queue_wait,
        suspended_s=sum(a.suspended_s for a in allocations),
        starts=len(starts) or len(record.starts),
        faults=len(record.faults),
        stops=len(record.restarts),
        checkpoints=len(saves),
        iterations=progress[-1].iteration if progress else 0,
        recomputed_iterations=recomputed,
        efficiency=_efficiency(usage) if usage else None,
        notes=tuple(notes),
        timeline=tuple(sorted(timeline, key=lambda p: p.begin)),
        iteration_times=tuple((r.iteration, _time(r)) for r in progress),
        start_times=tuple(s.begin for s in starts),
        fault_times=tuple(f.when_s for f in record.faults),
        stop_times=tuple(e.when_s for e in record.restarts if e.when_s),
    )


def _hours_of(
    allocations: Sequence[Allocation], node_s: Mapping[str, float], progress: list[ProgressLine]
) -> dict[str, Any]:
    """CostReport's hours, shares and env-steps per hour (suspended time is not charged)."""
    node_hours = sum(a.nodes * a.held_s for a in allocations) / 3600
    gpu_hours = sum(a.gpus * a.held_s for a in allocations) / 3600
    core_hours = sum(a.cores * a.held_s for a in allocations) / 3600
    env_steps = sum(r.env_steps for r in progress)
    per, hours = ("GPU-hour", gpu_hours) if gpu_hours > 0 else ("core-hour", core_hours)
    total = sum(node_s.values())
    return {
        "node_hours": node_hours,
        "gpu_hours": gpu_hours if gpu_hours > 0 else None,
        "core_hours": core_hours,
        "phase_hours": {k: v / 3600 for k, v in node_s.items()},
        "phase_share": {k: (v / total if total else 0.0) for k, v in node_s.items()},
        "env_steps": env_steps,
        "env_steps_per_hour": env_steps / hours if hours > 0 else None,
        "per": per,
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _hours(value: float) -> str:
    return f"{value:.4f}" if value < 10 else f"{value:,.1f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "missing"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


def report_table(report: CostReport) -> Group:
    """The report as people read it: a table of the phases, then the figures."""
    gpu = report.gpu_hours is not None
    title = f"cost of {inert(report.run_dir.name, markup=True)}"
    table = Table(title=title, box=None, title_justify="left")
    table.add_column("phase")
    table.add_column("node-time", justify="right")
    table.add_column("node-hours", justify="right")
    if gpu:
        table.add_column("GPU-hours", justify="right")
    table.add_column("share", justify="right")
    per_node = (report.gpu_hours or 0) / report.node_hours if report.node_hours else 0
    for name in PHASES:
        hours = report.phase_hours[name]
        row = [name.replace("_", " "), _duration(hours * 3600), _hours(hours)]
        if gpu:
            row.append(_hours(hours * per_node))
        table.add_row(*row, f"{100 * report.phase_share[name]:.1f}%")
    total = [
        "[bold]allocated[/]",
        f"[bold]{_duration(report.node_hours * 3600)}[/]",
        f"[bold]{_hours(report.node_hours)}[/]",
    ]
    if gpu:
        total.append(f"[bold]{_hours(report.gpu_hours or 0)}[/]")
    table.add_row(*total, "100.0%")
    jobs = ", ".join(report.job_ids) or "-"
    lines = [
        f"{report.kind or 'process'} job(s) {inert(jobs, markup=True)}; allocations from "
        f"{'sacct' if report.source == 'sacct' else 'the run records'}: "
        f"{len(report.allocations)}, {_hours(report.core_hours)} core-hours",
        "queue wait: "
        + ("none (a local run)" if report.kind != "slurm" else _duration(report.queue_wait_s))
        + (
            f"; suspended {_duration(report.suspended_s)} (not charged)"
            if report.suspended_s
            else ""
        ),
        f"{report.starts} start(s), {report.faults} fault(s), {report.stops} stop(s), "
        f"{report.checkpoints} checkpoint(s); {report.iterations} iterations count, "
        f"{report.recomputed_iterations} recomputed after faults",
        f"useful env-steps: {report.env_steps:,}"
        + (
            f", {report.env_steps_per_hour:,.0f} per {report.per}"
            if report.env_steps_per_hour is not None
            else ""
        ),
    ]
    eff = report.efficiency
    if eff is not None:
        cpu = (
            f"TotalCPU {_duration(eff.total_cpu_s)}"
            + (
                f" ({100 * eff.cpu_efficiency:.1f}% of the cores held)"
                if eff.cpu_efficiency
                else ""
            )
            if eff.total_cpu_s is not None
            else "TotalCPU missing"
        )
        gpu_util = f"gres/gpuutil {inert(eff.gpu_util, markup=True)}" if eff.gpu_util else ""
        gpu_mem = f"gres/gpumem {inert(eff.gpu_mem, markup=True)}" if eff.gpu_mem else ""
        said = [cpu, f"MaxRSS {_bytes(eff.max_rss_bytes)}", gpu_util, gpu_mem]
        missing = [m for m in eff.missing if m.startswith("gres/")]
        lines.append(
            "Slurm: "
            + ", ".join(s for s in said if s)
            + (f"; not gathered by this site: {', '.join(missing)}" if missing else "")
        )
    parts: list[Any] = [table, *(Text.from_markup(line) for line in lines)]
    parts += [Text(f"note: {inert(n)}", style="yellow") for n in report.notes]
    return Group(*parts)


def draw_timeline(report: CostReport, out: Path) -> None:
    """Draw the run's timeline into the PNG `out`: the allocations in phases (and queue
    wait), and the iterations that count, with every start and fault."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (login nodes, CI)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min([p.begin for p in report.timeline] + list(report.start_times) or [0.0])
    span = max([p.end for p in report.timeline] + [t0 + 1]) - t0
    unit, scale = ("s", 1.0) if span < 180 else ("min", 60.0) if span < 3 * 3600 else ("h", 3600.0)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [1, 3]}
    )
    by_phase: dict[str, list[tuple[float, float]]] = {}
    for p in report.timeline:  # one collection per phase: a bar each would be quadratic
        by_phase.setdefault(p.name, []).append(((p.begin - t0) / scale, (p.end - p.begin) / scale))
    for name, bars in by_phase.items():
        top.broken_barh(bars, (-0.4, 0.8), facecolors=_COLORS[name], edgecolor="none")
    for a in report.allocations:  # each job (each run of a requeued one) named where it began
        top.text((a.begin - t0) / scale, 0.3, f" job {inert(a.label)}", fontsize=8, va="center")
    top.set_yticks([])
    top.set_ylabel("phase")
    shown = [n for n in (*PHASES, "queue", "suspended") if n in by_phase]
    top.legend(
        handles=[Patch(color=_COLORS[n], label=n.replace("_", " ")) for n in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, 1.45),
        ncol=len(shown) or 1,
        fontsize="small",
    )
    # One line, broken (NaN) where a start begins: none drawn across a restart.
    breaks, n, xs, ys = list(report.start_times[1:]), 0, [], []
    for it, t in sorted(report.iteration_times, key=lambda p: p[1]):
        if n < len(breaks) and t >= breaks[n]:
            while n < len(breaks) and t >= breaks[n]:
                n += 1
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append((t - t0) / scale)
        ys.append(it)
    if xs:
        bottom.plot(xs, ys, ".-", color="tab:green", label="iterations that count")
    for i, at in enumerate(report.start_times):
        for ax in (top, bottom):
            ax.axvline((at - t0) / scale, color="tab:gray", ls="--", lw=1)
        bottom.text((at - t0) / scale, 0, f" start {i + 1}", rotation=90, va="bottom", fontsize=8)
    for at in report.stop_times:
        for ax in (top, bottom):
            ax.axvline((at - t0) / scale, color="tab:orange", ls=":", lw=1.5)
        bottom.text((at - t0) / scale, 0, " stop", color="tab:orange", rotation=90, fontsize=8)
    for at in report.fault_times:
        for ax in (top, bottom):
            ax.axvline((at - t0) / scale, color="tab:red", lw=1.5)
        bottom.text((at - t0) / scale, 0, " fault", color="tab:red", rotation=90, fontsize=8)
    bottom.set_xlabel(f"time since the run began ({unit})")
    bottom.set_ylabel("iteration")
    bottom.grid(True, alpha=0.3)
    title = report.run_dir.name.replace("$", r"\$")
    fig.suptitle(inert(f"{title}: {_hours(report.node_hours)} node-hours"))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)

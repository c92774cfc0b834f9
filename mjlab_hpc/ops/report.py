"""`mjlab-hpc report`: what a run cost, across all its jobs, requeues and heals.

The allocations come from sacct (one row per run of a job: each requeue is another), or, for
a local run or when accounting does not answer, from the run's own records: a local run
holds its machine from the moment its directory was made to its last rank's end, and a Slurm
run each of its jobs from the first start to the last end in it.

Every second of an allocation is put in one phase, so the phases add up to the allocation:
`checkpointing` (logs/checkpoints.jsonl), `recomputed` (iterations done again after a fault:
from the checkpoint the next start resumed from to the fault), `lost_to_faults` (from a fault
to the next start, or to the end of the allocation), `training` (the iterations that count),
`start_up` (from the allocation's or the heal's start to the first iteration) and `other`
(the rest: the end of the job, a stop's wait for the requeue). Queue wait is not allocated
time: sacct's Submit to Start, summed over the job's runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mjlab_hpc.console import inert
from mjlab_hpc.ops.runs import JobKind, created_at, run_jobs
from mjlab_hpc.rundir.ends import RankStart, rank_starts, read_end
from mjlab_hpc.rundir.layout import RunDir, list_checkpoints
from mjlab_hpc.rundir.progress import (
    CheckpointTime,
    ProgressLine,
    read_checkpoint_times,
    read_progress,
)
from mjlab_hpc.rundir.record import RunRecord, read_record
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
    "other",
)
# Where phases overlap, the first of these wins (a checkpoint inside a training span is
# checkpointing; iterations done again are recomputed, not training).
_PRECEDENCE = ("checkpointing", "lost_to_faults", "recomputed", "training", "start_up")
_COLORS = {
    "start_up": "tab:orange",
    "training": "tab:green",
    "checkpointing": "tab:blue",
    "recomputed": "tab:purple",
    "lost_to_faults": "tab:red",
    "other": "lightgray",
    "queue": "whitesmoke",
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


@dataclass(frozen=True)
class Phase:
    """One span of time on the timeline, in one phase (or `queue`)."""

    name: str
    """One of PHASES, or `queue`."""
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
    """Seconds the jobs waited in the queue (None: not known without accounting)."""
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


def _local_allocations(
    run_dir: Path, record: RunRecord, starts: list[_Start], last: float, label: str
) -> list[Allocation]:
    """The machine a local run held: from its directory's making to its last end."""
    begin = min(created_at(run_dir), starts[0].begin) if starts else created_at(run_dir)
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
    """The runs of the jobs that held nodes, oldest first (a run never started is left out)."""
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
            )
        )
    return sorted(out, key=lambda a: a.begin)


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
    recomputed_total = 0
    for n, start in enumerate(starts):
        nxt = starts[n + 1].begin if n + 1 < len(starts) else float("inf")
        mine = [r for r in progress if start.begin <= _time(r) < nxt]
        fault = next((f for f in faults if start.begin <= f.when_s < nxt), None)
        home = [a for a in allocations if a.begin <= start.begin + 1e-6]
        window = home[-1] if home else (allocations[0] if allocations else None)
        first_in_window = window is not None and not any(
            window.begin <= s.begin < start.begin for s in starts[:n]
        )
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
            last_save = max((c.at + c.s for c in saves if start.begin <= c.at < nxt), default=done)
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


def _cover(spans: list[Phase], allocation: Allocation) -> tuple[dict[str, float], list[Phase]]:
    """Seconds of each phase inside one allocation, every second in exactly one phase."""
    cuts = {allocation.begin, allocation.end}
    for s in spans:
        for t in (s.begin, s.end):
            if allocation.begin < t < allocation.end:
                cuts.add(t)
    edges = sorted(cuts)
    seconds = dict.fromkeys(PHASES, 0.0)
    pieces: list[Phase] = []
    for a, b in itertools.pairwise(edges):
        mid = (a + b) / 2
        here = {s.name for s in spans if s.begin <= mid < s.end}
        name = next((p for p in _PRECEDENCE if p in here), "other")
        seconds[name] += b - a
        if pieces and pieces[-1].name == name and pieces[-1].end == a:
            pieces[-1] = Phase(name, pieces[-1].begin, b)
        else:
            pieces.append(Phase(name, a, b))
    return seconds, pieces


def collect_report(run_dir: Path, slurm: SlurmClient | None = None) -> CostReport:
    """Work out what the run cost, from sacct (Slurm jobs) and the run's own records."""
    now = time.time()
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
    last = max(marks, default=created_at(run_dir))
    running = bool(starts) and starts[-1].end is None and record.state in (None, "running")
    if running:
        last = now
        notes.append("the run is still running: figures up to now")
    usage: list[Usage] | None = None
    efficiency = None
    source = "records"
    if jobs.kind == "slurm" and jobs.job_ids:
        usage = (slurm or SlurmClient()).usage(jobs.job_ids)
        if usage is None:
            notes.append(
                "sacct did not answer (accounting disabled or unreachable): allocations from "
                "the run's records, queue wait unknown"
            )
    allocations: list[Allocation]
    if usage:
        allocations = _sacct_allocations(usage, now)
        efficiency = _efficiency(usage)
        source = "sacct"
    elif jobs.kind == "slurm":
        in_allocation = {
            i + 1
            for i, s in enumerate(starts[:-1])
            if any(
                f.kind == "in-allocation" and s.begin <= f.when_s < starts[i + 1].begin
                for f in record.faults
            )
        }
        allocations = _record_allocations(record, starts, last, in_allocation)
        if usage is not None:  # sacct answered with nothing: the job is not in accounting
            notes.append("sacct has no record of the jobs: allocations from the run's records")
    else:
        label = jobs.current or "local"
        allocations = _local_allocations(run_dir, record, starts, last, label)
    spans, recomputed = _phases(starts, allocations, progress, saves, record)
    node_s = dict.fromkeys(PHASES, 0.0)
    timeline: list[Phase] = []
    for a in allocations:
        seconds, pieces = _cover(spans, a)
        for name, s in seconds.items():
            node_s[name] += s * a.nodes
        timeline += pieces
        if a.submitted is not None and a.submitted < a.begin:
            timeline.append(Phase("queue", a.submitted, a.begin))
    node_hours = sum(a.nodes * (a.end - a.begin) for a in allocations) / 3600
    gpu_hours = sum(a.gpus * (a.end - a.begin) for a in allocations) / 3600
    core_hours = sum(a.cores * (a.end - a.begin) for a in allocations) / 3600
    waits = [a.begin - a.submitted for a in allocations if a.submitted is not None]
    queue_wait = (
        sum(max(0.0, w) for w in waits)
        if source == "sacct"
        else 0.0
        if jobs.kind != "slurm"
        else None
    )
    env_steps = sum(r.env_steps for r in progress)
    per, hours = ("GPU-hour", gpu_hours) if gpu_hours > 0 else ("core-hour", core_hours)
    total_node_s = sum(node_s.values())
    iterations = progress[-1].iteration if progress else 0
    return CostReport(
        run_dir=run_dir,
        kind=jobs.kind,
        job_ids=jobs.job_ids,
        source=source,
        allocations=tuple(allocations),
        node_hours=node_hours,
        gpu_hours=gpu_hours if gpu_hours > 0 else None,
        core_hours=core_hours,
        phase_hours={k: v / 3600 for k, v in node_s.items()},
        phase_share={k: (v / total_node_s if total_node_s else 0.0) for k, v in node_s.items()},
        queue_wait_s=queue_wait,
        starts=len(starts) or len(record.starts),
        faults=len(record.faults),
        stops=len(record.restarts),
        checkpoints=len(saves),
        iterations=iterations,
        recomputed_iterations=recomputed,
        env_steps=env_steps,
        env_steps_per_hour=env_steps / hours if hours > 0 else None,
        per=per,
        efficiency=efficiency,
        notes=tuple(notes),
        timeline=tuple(sorted(timeline, key=lambda p: p.begin)),
        iteration_times=tuple((r.iteration, _time(r)) for r in progress),
        start_times=tuple(s.begin for s in starts),
        fault_times=tuple(f.when_s for f in record.faults),
        stop_times=tuple(e.when_s for e in record.restarts if e.when_s),
    )


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
        + ("none (a local run)" if report.kind != "slurm" else _duration(report.queue_wait_s)),
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
    for p in report.timeline:
        top.barh(
            0,
            (p.end - p.begin) / scale,
            left=(p.begin - t0) / scale,
            color=_COLORS[p.name],
            edgecolor="none",
        )
    for a in report.allocations:  # each job (each run of a requeued one) named where it began
        top.text((a.begin - t0) / scale, 0.3, f" job {inert(a.label)}", fontsize=8, va="center")
    top.set_yticks([])
    top.set_ylabel("phase")
    shown = [n for n in (*PHASES, "queue") if any(p.name == n for p in report.timeline)]
    top.legend(
        handles=[Patch(color=_COLORS[n], label=n.replace("_", " ")) for n in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, 1.45),
        ncol=len(shown) or 1,
        fontsize="small",
    )
    bounds = [*report.start_times[1:], float("inf")]
    done = list(report.iteration_times)
    for i, until in enumerate(bounds):  # one line per start: none drawn across a restart
        mine = [(it, t) for it, t in done if t < until]
        done = [(it, t) for it, t in done if t >= until]
        if mine:
            x = [(t - t0) / scale for _, t in mine]
            bottom.plot(
                x,
                [it for it, _ in mine],
                ".-",
                color="tab:green",
                label=None if i else "iterations that count",
            )
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

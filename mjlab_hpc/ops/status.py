"""`mjlab-hpc status`: one row per run with its job, state, size, progress and restarts.

The state comes from Slurm for Slurm jobs (squeue, and sacct where accounting runs), from the
local executor's processes for local jobs, else from the run's own record (run.json, the
writer's lease lock, and `cancelled.json`). Progress comes from progress.jsonl, restarts
from run.json. Elements of a sweep are shown together under a line naming the sweep.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from mjlab_hpc.console import inert
from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.ops.runs import JobKind, RunJobs, run_jobs
from mjlab_hpc.rundir.ends import rank_ends, recorded_cause, start_faults
from mjlab_hpc.rundir.layout import ElementRecord, RunDir, read_sweep
from mjlab_hpc.rundir.progress import progress_summary
from mjlab_hpc.rundir.record import Interruption, RunRecord, RunState, now_iso, read_record
from mjlab_hpc.rundir.running import run_processes
from mjlab_hpc.rundir.state import JobState, record_state
from mjlab_hpc.slurm.client import SlurmAnswer, SlurmClient, SlurmRow

__all__ = [
    "FAILED_STATES",
    "RunStatus",
    "StatusReport",
    "collect",
    "console",
    "disk_bytes",
    "interruption_line",
    "job_states",
    "render",
    "status_table",
    "watch",
]

STATE_STYLES = {
    "RUNNING": "bold green",
    "PENDING": "yellow",
    "REQUEUED": "yellow",
    "COMPLETING": "cyan",
    "COMPLETED": "blue",
    "STOPPED": "yellow",
    "INTERRUPTED": "yellow",
    "CANCELLED": "magenta",
    "FAILED": "bold red",
    "DAMAGED": "bold red",
    "LOST": "bold red",
    "TIMEOUT": "red",
    "OUT_OF_MEMORY": "bold red",
    "NODE_FAIL": "bold red",
}
# How many of the last iterations the env-steps/s column averages (one iteration is noisy).
RATE_WINDOW = 10


@dataclass(frozen=True)
class RunStatus:
    """Everything `status` shows about one run."""

    run_dir: Path
    kind: JobKind | None
    job_ids: tuple[str, ...]
    state: str
    state_source: str
    active: bool
    nodes: int | None
    gpus_per_node: int | None
    ranks: int | None
    iteration: int | None
    total: int | None
    env_steps_per_s: float | None
    mean_reward: float | None
    restarts: int
    restart_reasons: tuple[str, ...]
    sweep: ElementRecord | None
    cause: str | None = None
    """For a failed run: the rank that failed first and why (not the ranks that died of it)."""
    cause_rank: int | None = None
    """That rank (None: no rank in particular)."""
    interruptions: tuple[Interruption, ...] = ()
    """Every stop and fault of the run (run.json `restarts` and `faults`), oldest first."""
    reason: str | None = None
    """Slurm's reason: why the job pends (BadConstraints, JobHeldAdmin, Priority), or why it
    ended without running (JobLaunchFailure)."""
    stragglers: tuple[str, ...] = ()
    """Its ranks that are consistently slower than the others (`rank 1 on node2 is 1.80x
    slower ...`), as the ranks last recorded them; once the run is not active, said as of
    when it last trained."""
    waiting: str | None = None
    """For a Slurm job that waits again after a stop or fault: that event, and the state of
    the nodes it named now (`node2 is drained (Not responding)`), which Slurm's reason
    (`Resources`, `ReqNodeNotAvail`) does not say."""
    disagrees: str | None = None
    """What Slurm says where the run's own record says otherwise and wins (sacct's last word
    on a job while slurmctld is down: `sacct says RUNNING`)."""
    unread: tuple[str, ...] = ()
    """Files (or lines) of the run that were not read, and why: a FIFO, a device, a link out
    of it, a damaged or forged record (each is left out; the rest is shown)."""
    disk_bytes: int | None = None
    """The bytes its directory holds, counted as `du -sb` does (None: not readable)."""

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for `status --json`."""
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir)
        out["interruptions"] = [e.to_json() for e in self.interruptions]
        if self.sweep is not None:
            out["sweep"] = {k: out["sweep"][k] for k in ("index", "job_id", "overrides")}
            out["sweep"]["sweep_dir"] = str(self.sweep.sweep_dir)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _status_of(jobs: RunJobs, state: JobState) -> RunStatus:
    run_dir = jobs.run_dir
    try:
        record, damaged = read_record(run_dir, strict=True), None
    except DamagedRecord as exc:  # named on its row; the other runs are listed as ever
        record, damaged = RunRecord(), str(exc)
        if state.source in ("record", "none"):
            state = JobState(state="DAMAGED", source="record", active=False)
    progress = progress_summary(RunDir(run_dir), RATE_WINDOW)
    unread = [*jobs.unread, *([progress.unread] if progress.unread else [])]
    world = record.world_size
    nodes = state.nodes or record.num_nodes
    gpus = state.gpus_per_node
    if gpus is None and (record.device or "").startswith("cuda") and world and nodes:
        gpus = world // nodes
    events = record.interruptions
    restarts, reasons = record.restarts_told()
    stragglers = [str(s.text) for s in record.stragglers]
    if not state.active:  # a slow node is worth knowing after the run too
        stragglers = [f"when it last trained, {t}" for t in stragglers]
    cause = _cause(run_dir, record, state, unread) if state.state in FAILED_STATES else None
    return RunStatus(
        run_dir=run_dir,
        kind=jobs.kind,
        job_ids=jobs.job_ids,
        state=state.state,
        state_source=state.source,
        active=state.active,
        nodes=nodes,
        gpus_per_node=gpus,
        ranks=world,
        iteration=progress.iteration,
        total=progress.total or record.effective.max_iterations or None,
        env_steps_per_s=progress.env_steps_per_s,
        mean_reward=progress.mean_reward,
        restarts=restarts,
        restart_reasons=reasons,
        interruptions=events,
        sweep=jobs.element,
        cause=damaged or (cause[0] if cause else None),
        cause_rank=None if damaged or not cause else cause[1],
        reason=state.reason,
        stragglers=tuple(stragglers),
        disagrees=state.disagrees,
        unread=tuple(dict.fromkeys(unread)),
        disk_bytes=disk_bytes(run_dir),
    )


def disk_bytes(path: Path) -> int | None:
    """The bytes under `path` as `du -sb` counts them: every file's, folder's and link's own
    size, a hard-linked file once, links not followed (None: `path` cannot be read).

    One lstat per entry, from the directory listing (os.scandir): cheap beside a run's other
    reads, and a run whose checkpoints prune holds few files.
    """
    try:
        top = path.lstat()
    except OSError:
        return None
    total, seen, folders = top.st_size, {(top.st_dev, top.st_ino)}, [path]
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    if st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
        except OSError:  # a folder gone or closed meanwhile: what was counted stands
            continue
    return total


def _bytes_text(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# States whose run ended by a failure: status names the rank that caused it.
FAILED_STATES = frozenset({"FAILED", "LOST", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})


def _cause(
    run_dir: Path, record: RunRecord, state: JobState, unread: list[str]
) -> tuple[str, int | None] | None:
    """Who failed first and why, then every other rank's own fault of the start; and the
    first rank (None: no rank in particular). A damaged rank record is named in `unread`."""
    ends = rank_ends(run_dir, unread)
    cause = recorded_cause(record, ends)
    if cause is not None:
        also = [e for e in start_faults(ends) if e.rank != cause.rank]
        return "; ".join(e.describe() for e in [cause, *also]), cause.rank
    if state.reason and not ends:
        return f"the job failed before any rank started (Slurm: {state.reason})", None
    return None


@dataclass(frozen=True)
class StatusReport:
    """The rows of one status query, and whether Slurm's accounting answered."""

    rows: tuple[RunStatus, ...]
    accounting: bool | None
    """None: no Slurm job was asked about."""
    slurm_here: bool = True
    """Whether Slurm's commands are on PATH."""
    queue: bool = True
    """Whether squeue answered (False: it failed to answer within the client's timeout)."""

    @property
    def note(self) -> str | None:
        """What the reader should know about where states came from."""
        if self.accounting is not None and not self.slurm_here:
            return (
                "Slurm's commands are not on PATH here: the states of Slurm jobs come from "
                "their run records"
            )
        if self.accounting is not None and not self.queue:
            source = "sacct and the run records" if self.accounting else "the run records"
            return f"squeue did not answer (slurmctld slow or down?): states come from {source}"
        if self.accounting is False:
            return (
                "sacct failed (accounting disabled?): states come from squeue, and from the "
                "run records for jobs squeue no longer lists"
            )
        return None


def _current_row(run: RunJobs, rows: dict[str, SlurmRow]) -> SlurmRow | None:
    """Return the row of the run's job that runs or waits, else of its last job.

    In a --chain the job that runs or waits is the first that has not ended.
    """
    known = [rows[j] for j in run.job_ids if j in rows]
    return next((r for r in known if not r.final), rows.get(run.current or ""))


# The states in which a run's own record says its start ended for good.
_ENDED = frozenset(
    {
        *(s.status_name() for s in (RunState.COMPLETED, RunState.FAILED, RunState.INTERRUPTED)),
        "CANCELLED",
    }
)


def _record_first(run_dir: Path, row: SlurmRow) -> JobState:
    """Return the job's state from Slurm, unless the run's own record knows better.

    The record wins when only accounting says the job is active (squeue did not list it:
    slurmctld down or forgetful) and the record says this job's start ended; and when the
    ranks stopped for good although Slurm says the job failed or completed. The state then
    says what Slurm says.
    """
    from_slurm = JobState(
        state=row.state,
        source=row.source,
        active=not row.final,
        nodes=row.nodes,
        gpus_per_node=row.gpus_per_node,
        reason=row.reason,
    )
    if row.final and row.state in ("FAILED", "COMPLETED"):
        # The ranks stopped for good with a checkpoint (a person's SIGTERM, a time limit too
        # short to requeue): the job's exit code says failed, the run is stopped.
        record = read_record(run_dir)
        stop = record.restarts[-1] if record.restarts else Interruption()
        if (
            record.state == RunState.STOPPED
            and stop.kind == "stop"
            and stop.job_id in (row.job_id, row.raw_id)
        ):
            return JobState(
                state="STOPPED",
                source="record",
                active=False,
                nodes=row.nodes,
                gpus_per_node=row.gpus_per_node,
                disagrees=f"{row.source} says {row.state}",
            )
    if row.final or row.source == "squeue":
        return from_slurm
    own = record_state(run_dir)
    last = read_record(run_dir).last_start.job_id
    if own.source != "record" or own.state not in _ENDED or last not in (row.job_id, row.raw_id):
        return from_slurm
    return dataclasses.replace(own, disagrees=f"{row.source} says {row.state}")


def job_states(
    runs: Sequence[RunJobs], slurm: SlurmClient | None = None
) -> tuple[dict[Path, JobState], SlurmAnswer | None]:
    """Every run's state, and what Slurm answered (None: no Slurm run asked). One squeue and
    one sacct call for all Slurm runs together, however many runs and array elements."""
    slurm = slurm or SlurmClient()
    # Every job of a run: in a --chain the current one is the first that has not ended.
    slurm_ids = [j for r in runs if r.kind == "slurm" for j in r.job_ids]
    answer = slurm.answer(slurm_ids) if slurm_ids else None
    rows = answer.rows if answer else {}
    out: dict[Path, JobState] = {}
    for run in runs:
        row = _current_row(run, rows) if run.kind == "slurm" else None
        if row is not None:
            out[run.run_dir] = _record_first(run.run_dir, row)
        elif run.kind == "local" and run_processes(run.run_dir):  # recorded, not by argv
            out[run.run_dir] = JobState(state="RUNNING", source="process", active=True, nodes=1)
        else:
            out[run.run_dir] = record_state(run.run_dir)
    return out, answer


def _named_nodes(event: Interruption) -> list[str]:
    """Return the nodes a stop or fault named: where it happened, what the healer left out.

    Not stragglers' nodes: they are slow, not why a job waits.
    """
    slow = set(event.straggler_nodes)
    names = [*event.nodes, *event.hosts, *event.excluded_nodes]
    return list(dict.fromkeys(str(n) for n in names if n and n not in slow))


def _suspects(events: Sequence[Interruption]) -> list[str]:
    """Return the nodes the last stop or fault named.

    After a preemption or a requeue by Slurm that named none (the ranks take a node's loss for
    one when Slurm no longer calls it down), those of the last that named any.
    """
    last = events[-1] if events else None
    if last and not _named_nodes(last) and last.reason in ("preemption", "requeue"):
        return next((n for e in reversed(events) if (n := _named_nodes(e))), [])
    return _named_nodes(events[-1]) if events else []


def _explain_waits(rows: list[RunStatus], slurm: SlurmClient) -> list[RunStatus]:
    """Add why to the rows of Slurm jobs that wait again after a stop or fault.

    One sinfo call serves all of them; none is made when no row waits.
    """
    waits = [
        i
        for i, r in enumerate(rows)
        if r.kind == "slurm" and r.state == "PENDING" and r.interruptions
    ]
    named = {i: _suspects(rows[i].interruptions) for i in waits}
    # Slurm's NODE_FAIL names the allocation (`node[1-2]`): sinfo -N answers node by node.
    names = {
        n: [n] if "[" not in n else (slurm.hostnames(n) or []) for v in named.values() for n in v
    }
    nodes = list(dict.fromkeys(h for hosts in names.values() for h in hosts))
    states = (slurm.node_states(nodes) or {}) if nodes else {}
    for i in waits:
        hosts = dict.fromkeys(h for n in named[i] for h in names[n])
        said = [
            f"{h} is {states[h][0]}" + (f" ({states[h][1]})" if states[h][1] else "")
            for h in hosts
            if h in states
        ]
        why = f"waits after: {interruption_line(rows[i].interruptions[-1])}"
        rows[i] = dataclasses.replace(rows[i], waiting=why + "".join(f"; {s}" for s in said))
    return rows


def collect(run_dirs: Sequence[Path], slurm: SlurmClient | None = None) -> StatusReport:
    """Return the status of every run.

    One squeue and one sacct call serve all of them, and one sinfo where some wait again
    after a stop or fault.
    """
    slurm = slurm or SlurmClient()
    jobs = [run_jobs(Path(r).absolute()) for r in run_dirs]
    states, answer = job_states(jobs, slurm)
    rows = _explain_waits([_status_of(j, states[j.run_dir]) for j in jobs], slurm)
    accounting = answer.accounting if answer else None
    queue = answer.queue if answer else True
    return StatusReport(
        rows=tuple(rows),
        accounting=accounting,
        slurm_here=shutil.which("squeue") is not None,
        queue=queue,
    )


def _display_path(path: Path) -> str:
    try:
        rel = path.relative_to(Path.cwd())
        return str(rel) if str(rel) != "." else str(path)
    except ValueError:
        return str(path)


def _size(s: RunStatus) -> str:
    if s.nodes is None:
        return "-"
    if s.gpus_per_node:
        return f"{s.nodes} x {s.gpus_per_node} GPU"
    if s.ranks:
        return f"{s.nodes} x {max(1, s.ranks // max(1, s.nodes))} CPU"
    return f"{s.nodes} node(s)"


def interruption_line(e: Interruption) -> str:
    """One line for a stop or fault: when, what, where, what happened next, how it came back."""
    when = e.at or (now_iso(e.signal_at) if e.signal_at else "")
    where = ""
    if e.ranks:
        hosts = ", ".join(e.hosts) or "?"
        where = f" of rank {', '.join(map(str, e.ranks))} on {hosts}"
    if e.nodes:
        where = f" of node {', '.join(e.nodes)}"
    line = f"{when[:19].replace('T', ' ')} {e.reason}{where} at iteration {e.iteration}"
    if e.error and e.reason in ("crash", "hang", "out-of-memory", "diverged", "preflight"):
        line += f" ({e.error})"
    line += f": {e.action or ('requeued' if e.kind == 'requeue' else 'stopped')}"
    if e.excluded_nodes:
        line += f"; excluded {', '.join(e.excluded_nodes)}"
    if e.not_excluded:
        line += f"; {e.not_excluded}"
    if e.recovered_at is not None:
        line += f"; resumed from {e.resumed_from} ({e.recomputed} iteration(s) recomputed)"
        if e.recovery_s is not None:  # (None: the hosts' clocks disagreed)
            line += f", first iteration {e.recovery_s} s after"
    return line


def _number(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _row(s: RunStatus) -> list[str | Text]:
    iteration = "-" if s.iteration is None else str(s.iteration)
    total = "?" if s.total is None else str(s.total)
    restarts = str(s.restarts)
    # A start that no stop or fault came before: continued by a person (--resume, --run-dir).
    reasons = [*s.restart_reasons, *["resumed"] * (s.restarts > len(s.restart_reasons))]
    if s.restarts:
        restarts += f" ({', '.join(dict.fromkeys(reasons))})"
    job = ",".join(s.job_ids) or "-"
    if s.kind == "local":  # the controller's pid of each start: the newest is the job now
        job = f"{s.job_ids[-1]} (local)" if s.job_ids else "- (local)"
    # What a run's files and Slurm say is inert (and plain strings are markup, escaped).
    return [
        inert(job, markup=True),
        Text(
            inert(
                s.state
                + (f" ({s.reason})" if s.reason else "")
                + (f" (run record; {s.disagrees})" if s.disagrees else "")
                + (f"\n{s.cause}" if s.cause else "")
                + (f"\n{s.waiting}" if s.waiting else "")
                + "".join(f"\nstraggler: {t}" for t in s.stragglers)
                + "".join(f"\n{u}: not read" for u in s.unread)
            ),
            style=STATE_STYLES.get(s.state, ""),
        ),
        inert(_size(s), markup=True),
        f"{iteration}/{total}",
        _number(s.env_steps_per_s, ",.0f"),
        _number(s.mean_reward, ".2f"),
        inert(restarts, markup=True),
        _bytes_text(s.disk_bytes),
        inert(_display_path(s.run_dir), markup=True),
    ]


def _groups(rows: Sequence[RunStatus]) -> list[tuple[Path | None, list[RunStatus]]]:
    """Rows in their order, the elements of a sweep gathered at the place of the first."""
    groups: list[tuple[Path | None, list[RunStatus]]] = []
    index: dict[Path, int] = {}
    for row in rows:
        key = row.sweep.sweep_dir if row.sweep else None
        if key is None:
            groups.append((None, [row]))
        elif key in index:
            groups[index[key]][1].append(row)
        else:
            index[key] = len(groups)
            groups.append((key, [row]))
    for key, members in groups:
        if key is not None:
            members.sort(key=lambda r: r.sweep.index if r.sweep else 0)
    return groups


def _sweep_header(sweep_dir: Path, members: list[RunStatus]) -> list[str | Text]:
    record = read_sweep(sweep_dir)
    array = record.array_job_id if record else None
    axes = record.axes if record else {}
    label = " x ".join(f"{k.removeprefix('agent.')}={','.join(v)}" for k, v in axes.items())
    counts: dict[str, int] = {}
    for m in members:
        counts[m.state] = counts.get(m.state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in counts.items())
    name = f"sweep {array}" if array else f"sweep {sweep_dir.name}"
    return [
        Text(inert(name), style="bold"),
        Text(inert(summary), style="bold"),
        "",
        "",
        "",
        "",
        "",
        "",
        Text(inert(f"{label}  ({_display_path(sweep_dir)})"), style="bold"),
    ]


def status_table(rows: Sequence[RunStatus], title: str | None = None) -> Table:
    """The status of runs as a rich table (sweeps grouped, each under a header line)."""
    table = Table(title=title, title_justify="left")
    for col, justify in (
        ("job", "left"),
        ("state", "left"),
        ("nodes x GPUs", "left"),
        ("iteration", "right"),
        ("env-steps/s", "right"),
        ("reward", "right"),
        ("restarts", "left"),
        ("disk", "right"),
        ("run directory", "left"),
    ):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for key, members in _groups(rows):
        if key is not None:
            table.add_section()
            table.add_row(*_sweep_header(key, members))
        for row in members:
            table.add_row(*_row(row))
        if key is not None:
            table.add_section()
    return table


def render(report: StatusReport, hidden: int = 0) -> Group | Table:
    """The table, and notes below it: fallbacks used, runs left out by --limit."""
    if not report.rows:
        return Group(Text("no runs"))
    notes = [inert(report.note)] if report.note else []
    if hidden:
        notes.append(f"{hidden} older run(s) not shown (--limit)")
    table = status_table(report.rows)
    return Group(table, *(Text(n, style="dim") for n in notes)) if notes else table


def console() -> Console:
    """A console that does not wrap a table into 80 columns when the output is a file."""
    return Console() if os.isatty(1) else Console(width=250)


def watch(make: Any, interval_s: float, out: Console) -> None:
    """Redraw `make()` every `interval_s` seconds until Ctrl-C."""
    from rich.live import Live

    with Live(make(), console=out, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(make(), refresh=True)
        except KeyboardInterrupt:
            pass

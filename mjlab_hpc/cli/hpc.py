"""`mjlab-hpc`: tasks, sbatch templates, run directories, and the operations on submitted runs
(status, logs, cancel, plot, report)."""

from __future__ import annotations

import contextlib
import getpass
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import tyro
from rich.console import Console
from rich.table import Table

from mjlab_hpc.cli.common import drop_internal_variables, error_line, guarded, parse_command
from mjlab_hpc.cli.config import (
    PROJECT_FILE,
    Setting,
    config_files,
    default_log_root,
    naming_sources,
    site_given,
    user_file,
    with_site_defaults,
    write_profile,
)
from mjlab_hpc.console import inert, reopen
from mjlab_hpc.errors import EXIT_FAILED, EXIT_INTERRUPTED, DamagedRecord, SpecError
from mjlab_hpc.launch.heal_slurm import heal_job
from mjlab_hpc.launch.plan import job_plan, render
from mjlab_hpc.ops.cancel import cancel as cancel_runs
from mjlab_hpc.ops.doctor import cluster_profile, diagnose
from mjlab_hpc.ops.logs import find_tracebacks, follow, rank_files, rank_host, tail, unreadable
from mjlab_hpc.ops.report import collect_report, draw_timeline, report_table
from mjlab_hpc.ops.runs import list_runs, resolve_target, run_jobs
from mjlab_hpc.ops.status import (
    FAILED_STATES,
    StatusReport,
    collect,
    console,
    interruption_line,
    watch,
)
from mjlab_hpc.ops.status import render as render_status
from mjlab_hpc.rundir.layout import run_dir_for_key
from mjlab_hpc.rundir.record import Interruption, read_record
from mjlab_hpc.spec import SubmitSpec
from mjlab_hpc.tasks.registry import list_tasks as all_tasks
from mjlab_hpc.validate.places import no_control, path_component, run_name
from mjlab_hpc.validate.rules import positive_seconds

__all__ = ["main"]


@dataclass(frozen=True)
class ListTasks:
    """List the tasks mjlab-train and mjlab-submit accept."""


@dataclass(frozen=True)
class Render:
    """Fill an sbatch template from mjlab-submit's flags and print it.

    Submit the result with plain `sbatch`.
    """

    template: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TEMPLATE")]
    """train, train_apptainer (shipped in the package), or the path of a template of yours."""
    spec: Annotated[SubmitSpec, tyro.conf.OmitArgPrefixes] = field(default_factory=SubmitSpec)
    """The job, as mjlab-submit's flags give it."""


@dataclass(frozen=True)
class RunDirCommand:
    """Print the run directory recorded under KEY, making it on first use.

    The templates use it so that every rank and restart of one job shares one directory.
    """

    log_root: str = "logs"
    """Root folder of all experiments."""
    experiment: str = "cartpole"
    """Experiment folder under the log root."""
    run_name: str = ""
    """Suffix of the run directory's name."""
    key: str = ""
    """A name for the job (e.g. slurm-$SLURM_JOB_ID): the same key gives the same directory."""


@dataclass(frozen=True)
class Status:
    """Show a table of runs.

    Each row has the job, state, nodes x GPUs, iteration, env-steps/s, mean reward, restarts
    and run directory. Without arguments: the runs under --log-root, newest first.
    """

    targets: Annotated[
        tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR|JOB_ID")
    ] = ()
    """Run directories, job ids (4711, 4711_2, a local job's pid), job array ids, sweep or
    experiment directories."""
    log_root: str = "logs"
    """Where runs are listed (no arguments) and job ids are looked up."""
    watch: bool = False
    """Redraw the table every --interval-s seconds until Ctrl-C."""
    interval_s: float = 2.0
    """With --watch: seconds between redraws."""
    limit: int = 20
    """At most this many runs when listing --log-root (0: all)."""
    json: bool = False
    """Print the rows as JSON instead of a table."""


@dataclass(frozen=True)
class Logs:
    """Show the per-rank logs of a run or job.

    Without --rank, the first traceback across all ranks comes first, named by rank and host,
    then the end of every rank's log.
    """

    target: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="JOB|RUN")]
    """A job id (4711, 4711_2, a local job's pid) or a run directory."""
    rank: int | None = None
    """Only this rank."""
    follow: bool = False
    """Keep printing what the ranks write until the job ends (Ctrl-C stops)."""
    lines: int = 20
    """Last lines of each file (0: whole files)."""
    stream: Literal["log", "out", "err"] = "log"
    """With --rank: the rank's log, or its task stdout / stderr (submitit)."""
    log_root: str = "logs"
    """Where job ids are looked up."""


@dataclass(frozen=True)
class Cancel:
    """Cancel a Slurm job or stop a local-executor run, leaving no process.

    A Slurm job is cancelled with scancel, requeue forbidden first. A local run's ranks save
    a checkpoint on SIGTERM; SIGKILL follows after --grace-s.
    """

    target: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="JOB|RUN")]
    """A job id, a job array id (all its elements), a run or a sweep's directory."""
    grace_s: float = 30.0
    """Seconds to wait for the ranks to stop before killing them."""
    log_root: str = "logs"
    """Where job ids are looked up."""


@dataclass(frozen=True)
class Heal:
    """Heal a job after srun (for job scripts): record a crash or hang, and start again.

    The fault is recorded in run.json. The ranks start again while restarts remain and the
    failure is not a repeat. Exits 76 when the script should start a new srun step in its
    allocation (printing that step's srun options: the nodes it leaves out, fewer nodes with
    --min-nodes), 0 when it requeued the job (excluding a suspect node), else --exit-code.
    """

    run_dir: str
    """The job's run directory (a sweep's directory: this array element's run)."""
    exit_code: int
    """srun's exit code (0: nothing to do)."""
    max_restarts: int = 10
    """Start again at most this many times per kind of fault."""
    elapsed_s: float | None = None
    """How long the srun step ran: rank logs older than that are an earlier step's."""
    nodes: int | None = None
    """Nodes of one srun step (default: the allocation's; fewer: the others are spares that
    take a failed node's place in the next step)."""
    min_nodes: int | None = None
    """The fewest nodes the next step may go on with when no spare is left (mjlab-submit's
    --min-nodes; default: --nodes)."""
    tasks_per_node: int = 1
    """Ranks per node (for a step on fewer nodes)."""


@dataclass(frozen=True)
class Doctor:
    """Check on the cluster itself that a job as asked would run there.

    It checks Slurm's commands, the partition and the request, a log root every node shares,
    the same Python and mjlab_hpc on the nodes, GPUs per task, the time-limit signal,
    requeue, accounting and job arrays. Two short probe jobs run; exit 0 only when every
    check passes.
    """

    spec: Annotated[SubmitSpec, tyro.conf.OmitArgPrefixes] = field(default_factory=SubmitSpec)
    """The job to check, as mjlab-submit's flags give it."""
    wait_s: float = 300.0
    """Seconds to wait for the probe jobs to start and end (a busy cluster queues them)."""
    json: bool = False
    """Print the checks as JSON instead of a table."""
    keep: bool = False
    """Keep the probe folder (<log-root>/.doctor/...) for a look at what the nodes wrote."""
    write_profile: str | None = None
    """Instead of the checks, write [profile.NAME] from what the cluster says (a partition with
    GPUs, its GPUs per node and MaxTime, your account and QOS) into your config file, for
    mjlab-submit --profile NAME; --partition, --account and --qos choose among them."""
    project: bool = False
    """With --write-profile: into the project's mjlab-hpc.toml (the nearest one upward, else
    one here) instead of ~/.config/mjlab-hpc/config.toml."""
    force: bool = False
    """With --write-profile: replace a profile of that name."""


@dataclass(frozen=True)
class Plot:
    """Plot runs' mean reward and env-steps/s against iteration and wall time, as a PNG.

    The runs are overlaid, read from their tensorboard events.
    """

    runs: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="RUN")]
    """Run directories or job ids (a job array id: all its elements)."""
    out: str = "training.png"
    """The PNG to write."""
    title: str | None = None
    """The figure's title (default: the runs' names)."""
    log_root: str = "logs"
    """Where job ids are looked up."""


@dataclass(frozen=True)
class Report:
    """Show what a run cost across its jobs, requeues and heals.

    Allocated node-hours (GPU-hours) by phase: start-up, training, checkpointing, iterations
    recomputed after faults, time lost to faults; queue wait; useful env-steps per GPU-hour
    (core-hour on CPU); Slurm's TotalCPU, MaxRSS and GPU figures where accounting has them.
    """

    target: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN|JOB")]
    """A run directory or a job id (4711, 4711_2, a local job's pid)."""
    out: str | None = None
    """Also draw the run's timeline into this PNG."""
    json: bool = False
    """Print the report as JSON instead of a table."""
    log_root: str = "logs"
    """Where job ids are looked up."""


Command = (
    Annotated[ListTasks, tyro.conf.subcommand("list-tasks")]
    | Annotated[Render, tyro.conf.subcommand("render")]
    | Annotated[RunDirCommand, tyro.conf.subcommand("run-dir")]
    | Annotated[Status, tyro.conf.subcommand("status")]
    | Annotated[Logs, tyro.conf.subcommand("logs")]
    | Annotated[Cancel, tyro.conf.subcommand("cancel")]
    | Annotated[Doctor, tyro.conf.subcommand("doctor")]
    | Annotated[Plot, tyro.conf.subcommand("plot")]
    | Annotated[Report, tyro.conf.subcommand("report")]
    | Annotated[Heal, tyro.conf.subcommand("heal")]
)


def list_tasks() -> int:
    """Print every task with its default envs and iterations."""
    table = Table(title="tasks (default envs per rank and iterations)", box=None)
    table.add_column("name", no_wrap=True)  # copied into commands: never cropped
    for col in ("source", "envs", "iterations"):
        table.add_column(col, no_wrap=True, justify="right" if col != "source" else "left")
    tasks = all_tasks()
    for t in tasks:
        table.add_row(inert(t.name, markup=True), t.source, str(t.num_envs), str(t.max_iterations))
    Console().print(table)
    if not any(t.source == "mjlab" for t in tasks):
        Console().print("mjlab tasks: install the [mjlab] extra (pip install 'mjlab-hpc[mjlab]')")
    return 0


def _runs_of(targets: Sequence[str], log_root: str) -> list[Path]:
    """Return the run directories the arguments name; all runs under the log root without any."""
    if not targets:
        unreadable: list[Path] = []
        runs = list_runs(Path(log_root), unreadable)
        if unreadable:
            print(
                f"note: {len(unreadable)} folder(s) under {log_root} not readable by "
                f"{getpass.getuser()}, left out: {inert(', '.join(map(str, unreadable[:5])))}"
                + (" ..." if len(unreadable) > 5 else ""),
                file=sys.stderr,
            )
        return runs
    runs: list[Path] = []
    for target in targets:
        runs.extend(resolve_target(target, Path(log_root)).runs)
    return list(dict.fromkeys(runs))


def status(cmd: Status) -> int:
    """`mjlab-hpc status`."""
    positive_seconds("--interval-s", cmd.interval_s, minimum=0.1)
    if cmd.limit < 0:
        raise SpecError("--limit", f"must be >= 0 (0: all), got {cmd.limit}")

    def snapshot() -> tuple[StatusReport, int]:
        runs = _runs_of(cmd.targets, cmd.log_root)
        hidden = 0
        if not cmd.targets and cmd.limit and len(runs) > cmd.limit:
            hidden = len(runs) - cmd.limit
            runs = runs[: cmd.limit]
        return collect(runs), hidden

    if cmd.json:
        report, _ = snapshot()
        print(json.dumps([r.as_dict() for r in report.rows], indent=2))
        return 0
    out = console()
    if cmd.watch:
        watch(lambda: render_status(*snapshot()), cmd.interval_s, out)
    else:
        out.print(render_status(*snapshot()))
    return 0


def single_run(target: str, log_root: str) -> Path:
    """Return the one run directory an argument names (SpecError if it names several)."""
    runs = resolve_target(target, Path(log_root)).runs
    if len(runs) != 1:
        names = "\n  ".join(str(r) for r in runs[:20])
        raise SpecError("JOB|RUN", f"{target} names {len(runs)} runs; name one of:\n  {names}")
    return runs[0]


def logs(cmd: Logs) -> int:
    """`mjlab-hpc logs`."""
    if cmd.lines < 0:
        raise SpecError("--lines", f"must be >= 0 (0: whole files), got {cmd.lines}")
    run = single_run(cmd.target, cmd.log_root)
    unread: list[str] = []  # damaged records: named, left out
    ranks = rank_files(run, unread)
    out = Console(highlight=False, soft_wrap=True)
    failed = False
    if cmd.rank is not None:
        chosen = [f for f in ranks if f.rank == cmd.rank]
        if not chosen:
            known = ", ".join(str(f.rank) for f in ranks) or "none yet"
            raise SpecError("--rank", f"no files of rank {cmd.rank} in {run} (ranks: {known})")
        path = chosen[0].stream(cmd.stream)
        if path is None:
            raise SpecError("--stream", f"rank {cmd.rank} has no {cmd.stream} file in {run}")
        host = rank_host(chosen[0]) or "?"
        out.print(f"[bold]── rank {cmd.rank} · {inert(host, markup=True)} · {_shown(path)}")
        _print_file(path, cmd.lines)
        targets = {"": path}
    else:
        row = collect([run]).rows[0]
        cause = row.cause
        tracebacks = find_tracebacks(ranks)
        if row.reason and row.active:
            out.print(f"[yellow]{row.state}: {inert(row.reason, markup=True)} (Slurm's reason)[/]")
        if row.waiting:
            out.print(f"[yellow]{inert(row.waiting, markup=True)}[/]")
        for text in row.stragglers:
            out.print(f"[yellow]straggler: {inert(text, markup=True)}[/]")
        for why in dict.fromkeys([*row.unread, *unread]):
            out.print(f"[yellow]{inert(why, markup=True)}: not read[/]")
        if cause is not None:
            out.print(f"[bold red]cause: {inert(cause, markup=True)}[/]")
        if row.cause_rank is not None:
            # The cause's own traceback first; the others' are consequences.
            tracebacks.sort(key=lambda tb: tb.rank != row.cause_rank)
        if tracebacks:
            first = tracebacks[0]
            out.print(
                f"[bold red]first traceback: {inert(first.where(), markup=True)}[/] "
                f"({_shown(first.source)})"
            )
            sys.stdout.write(inert(first.text) + "\n")
            for tb in tracebacks[1:]:
                out.print(
                    f"[yellow]later traceback: {inert(tb.where(), markup=True)}: "
                    f"{inert(tb.last_line, markup=True)}[/] ({_shown(tb.source)})"
                )
        elif row.state in FAILED_STATES:
            out.print(
                f"[bold red]{row.state}, and no traceback in any rank's log or task output[/]"
            )
            failed = True
        else:
            out.print("[green]no traceback in any rank's log or task output[/]")
        for event in row.interruptions:  # every stop and fault, and how the run came back
            out.print(f"[yellow]{inert(interruption_line(event), markup=True)}[/]")
        for files in ranks:
            path = files.log or files.stream("err")
            if path is None:
                continue
            out.print(
                f"\n[bold]── rank {files.rank} · {inert(rank_host(files) or '?', markup=True)} · "
                f"{_shown(path)}"
            )
            _print_file(path, cmd.lines)
        targets = {f"[rank {f.rank}] ": f.log for f in ranks if f.log is not None}
    sys.stdout.flush()
    if cmd.follow:
        jobs = run_jobs(run)

        def files() -> dict[str, Path]:
            if cmd.rank is not None:
                return targets
            return {f"[rank {f.rank}] ": f.log for f in rank_files(run) if f.log is not None}

        def active() -> bool:
            return collect([jobs.run_dir]).rows[0].active

        def said(e: Interruption) -> tuple[object, ...]:
            return (
                e.reason,
                e.iteration,
                e.job_id,
                e.restart_count,
                e.signal_at or e.at,
                e.recovered_at is not None,
            )

        seen = {said(e) for e in read_record(run).interruptions}

        def news() -> list[str]:  # faults and stops as they are recorded, and healed
            new = [e for e in read_record(run).interruptions if said(e) not in seen]
            seen.update(said(e) for e in new)
            return [f"[run] {interruption_line(e)}" for e in new]

        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends following, not the job
            follow(files, active, sys.stdout, news=news)
    return EXIT_FAILED if failed else 0


def _shown(path: Path) -> str:
    """A path of a run in a rich markup string."""
    return inert(str(path), markup=True)


def _print_file(path: Path, lines: int) -> None:
    """The last `lines` lines of a rank's file, inert; or why it is not read."""
    why = unreadable(path)
    text = f"({why}: skipped)" if why else tail(path, lines)
    sys.stdout.write(inert(text) + "\n")


def cancel(cmd: Cancel) -> int:
    """`mjlab-hpc cancel`."""
    positive_seconds("--grace-s", cmd.grace_s, minimum=0.0)
    resolved = resolve_target(cmd.target, Path(cmd.log_root))
    outcomes = cancel_runs(resolved, grace_s=cmd.grace_s)
    out = Console(highlight=False, soft_wrap=True)
    for o in outcomes:
        ids = ",".join(o.job_ids) or "-"
        runs = ", ".join(str(r) for r in o.runs[:3]) + (" ..." if len(o.runs) > 3 else "")
        style = "green" if o.ok else "bold red"
        out.print(
            f"[{style}]{inert(o.kind, markup=True)} job {inert(ids, markup=True)}[/]: "
            f"{inert(o.message, markup=True)}\n  run: {inert(runs, markup=True)}"
        )
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


def plot(cmd: Plot) -> int:
    """`mjlab-hpc plot`."""
    from mjlab_hpc.ops.plot import load_run, plot_runs  # tensorboard, matplotlib: only here

    if not cmd.runs:
        raise SpecError("RUN", "name at least one run directory (or job id)")
    runs = _runs_of(cmd.runs, cmd.log_root)
    labels = [_label(r) for r in runs]
    if len(set(labels)) != len(labels):
        labels = [r.name for r in runs]
    series = [load_run(r, label) for r, label in zip(runs, labels, strict=True)]
    empty = [s.run_dir for s in series if not s.series]
    if len(empty) == len(series):
        why = "; ".join(f"{s.run_dir}: {s.unread}" for s in series if s.unread)
        raise SpecError(
            "RUN",
            f"no tensorboard scalars in {', '.join(map(str, empty))}" + (f" ({why})" * bool(why)),
        )
    no_control("--out", cmd.out)
    if cmd.title is not None:
        no_control("--title", cmd.title)
    try:
        drawn = plot_runs(series, Path(cmd.out), cmd.title)
    except OSError as exc:
        raise SpecError("--out", f"cannot write {cmd.out}: {exc.strerror or exc}") from None
    unread = {s.label: s.unread for s in series}
    for entry in drawn["runs"]:
        points = ", ".join(f"{t} {v['points']} points" for t, v in entry["series"].items())
        why = f"{unread[entry['label']]}: skipped" if unread[entry["label"]] else "no scalars"
        print(f"{inert(entry['label'])}: {points or inert(why)}")
    print(f"wrote {inert(cmd.out)}")
    return 0


def report(cmd: Report) -> int:
    """`mjlab-hpc report`."""
    out = None
    if cmd.out is not None:  # checked before anything is read or written
        no_control("--out", cmd.out)
        out = Path(cmd.out).expanduser()
        if out.suffix.lower() != ".png":
            raise SpecError("--out", f"{cmd.out} is not a .png file; name one, e.g. cost.png")
        if not out.parent.is_dir():
            raise SpecError(
                "--out", f"folder {out.parent} does not exist; make it or name a PNG in another"
            )
    cost = collect_report(single_run(cmd.target, cmd.log_root))
    if out is not None:
        try:
            draw_timeline(cost, out)
        except OSError as exc:
            raise SpecError("--out", f"cannot write {cmd.out}: {exc.strerror or exc}") from None
    if cmd.json:
        print(json.dumps(cost.as_dict(), indent=2))
    else:
        Console(highlight=False, soft_wrap=True).print(report_table(cost))
        if out is not None:
            print(f"wrote {inert(str(out))}")
    return 0


def _label(run: Path) -> str:
    """Return a run's legend label: its name without the leading timestamp, if it has a suffix."""
    name = run.name
    return name[20:] if len(name) > 20 and name[19] == "_" and name[:4].isdigit() else name


def render_template(cmd: Render, named: frozenset[str], site: Sequence[Setting]) -> int:
    """`mjlab-hpc render`."""
    sys.stdout.write(render(cmd.template, job_plan(cmd.spec, named, site_given(site))))
    return 0


def run_dir(cmd: RunDirCommand) -> int:
    """`mjlab-hpc run-dir`."""
    if not cmd.key:
        raise SpecError("--key", "a key is needed, e.g. slurm-$SLURM_JOB_ID")
    # The same rules as mjlab-submit's: these become folder names under the log root.
    no_control("--log-root", cmd.log_root)
    path_component("--experiment", cmd.experiment)
    path_component("--key", cmd.key)
    if cmd.run_name:
        run_name("--run-name", cmd.run_name)
    try:
        print(run_dir_for_key(cmd.log_root, cmd.experiment, cmd.run_name, cmd.key))
    except (ValueError, DamagedRecord) as exc:  # DamagedRecord: another user's key or run
        raise SpecError("--key", str(exc)) from None
    return 0


def write_profile_cmd(cmd: Doctor) -> int:
    """`mjlab-hpc doctor --write-profile NAME`: a profile of what the cluster says."""
    assert cmd.write_profile is not None
    project, _ = config_files()
    path = (project or Path.cwd() / PROJECT_FILE) if cmd.project else user_file()
    found = cluster_profile(cmd.spec, getpass.getuser())
    if found is None:
        error_line("error", "sinfo did not answer: run on the cluster's login node")
        return 1
    values, notes = found
    table = write_profile(path, cmd.write_profile, values, notes, force=cmd.force)
    print(table, end="")
    print(
        f"wrote profile {cmd.write_profile} to {path}: use it with mjlab-submit --profile "
        f"{cmd.write_profile}; check it with mjlab-hpc doctor --profile {cmd.write_profile}",
        file=sys.stderr,
    )
    return 0


def doctor(cmd: Doctor, named: frozenset[str], site: Sequence[Setting]) -> int:
    """`mjlab-hpc doctor`."""
    if cmd.write_profile is not None:
        return write_profile_cmd(cmd)
    positive_seconds("--wait-s", cmd.wait_s, minimum=1.0)
    plan = job_plan(cmd.spec, named, site_given(site), warn=lambda _: None)  # bad flags: exit 2
    say = (lambda _: None) if cmd.json else (lambda m: print(inert(m), file=sys.stderr, flush=True))
    try:
        report = diagnose(plan, wait_s=cmd.wait_s, keep=cmd.keep, progress=say)
    except KeyboardInterrupt:  # the probe jobs are cancelled and their folder removed
        print("doctor stopped: probe jobs cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    if cmd.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        table = Table(title="mjlab-hpc doctor", box=None)
        for col in ("check", "result", "found", "fix"):
            table.add_column(col, overflow="fold")
        style = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
        for c in report.checks:
            table.add_row(
                inert(c.name, markup=True),
                f"[{style[c.result]}]{c.result}[/]",
                inert(c.detail, markup=True),
                inert(c.fix, markup=True) if c.result != "ok" else "",
            )
        # Piped (a log, CI), rich would wrap the fixes at 80 columns.
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
        out.print(table)
        out.print(
            "[green]a job as asked would run here[/]"
            if report.ok
            else "[bold red]a job as asked would not run here: see the fixes above[/]"
        )
    return 0 if report.ok else 1


def heal(cmd: Heal) -> int:
    """`mjlab-hpc heal`."""
    return heal_job(
        Path(cmd.run_dir),
        exit_code=cmd.exit_code,
        max_restarts=cmd.max_restarts,
        elapsed_s=cmd.elapsed_s,
        step_nodes=cmd.nodes,
        min_nodes=cmd.min_nodes,
        tasks_per_node=cmd.tasks_per_node,
    )


_NAMES = {
    "list-tasks": ListTasks,
    "render": Render,
    "run-dir": RunDirCommand,
    "status": Status,
    "logs": Logs,
    "cancel": Cancel,
    "doctor": Doctor,
    "plot": Plot,
    "report": Report,
    "heal": Heal,
}
_COMMANDS = {
    ListTasks: lambda cmd: list_tasks(),
    RunDirCommand: run_dir,
    Status: status,
    Logs: logs,
    Cancel: cancel,
    Plot: plot,
    Report: report,
    Heal: heal,
}
_JOB_COMMANDS = {Render: render_template, Doctor: doctor}


def _attach(cmd: object, overrides: tuple[str, ...]) -> object:
    """Give a job's `--env.*`/`--agent.*` overrides to its spec (render, doctor)."""
    if isinstance(cmd, Render | Doctor):
        return replace(
            cmd, spec=cmd.spec.replace(train=cmd.spec.train.replace(overrides=overrides))
        )
    if overrides:
        raise SpecError(overrides[0], "unknown argument (see --help)")
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mjlab-hpc` with `argv` and return its exit code.

    A command's flags are parsed once (`parse_command`), which also says which were typed.
    A Ctrl-C while the command loads is one line too.
    """
    if argv is None:  # a viewer: it ends when its reader does (`status --watch | head`)
        reopen()
    drop_internal_variables()
    args = list(sys.argv[1:] if argv is None else argv)
    name = args[0] if args else ""
    if name not in _NAMES:  # --help, or no such command: tyro says what there is and exits
        guarded(lambda: tyro.cli(Command, prog="mjlab-hpc", args=args, description=__doc__))  # type: ignore[call-overload]
        return 2
    cls = _NAMES[name]
    parsed = parse_command(cls, args[1:], cls.__doc__, _attach, prog=f"mjlab-hpc {name}")
    if isinstance(parsed, int):
        return parsed
    cmd, named = parsed

    def body() -> int:
        if isinstance(cmd, Render | Doctor):
            # The job's flags that were not typed: from the config files (--write-profile: none).
            site: Sequence[Setting] = ()
            job = cmd
            if not getattr(cmd, "write_profile", None):
                spec, site = with_site_defaults(cmd.spec, named)
                job = replace(cmd, spec=spec)
            with naming_sources(site):
                return _JOB_COMMANDS[type(job)](job, named, site)  # type: ignore[operator]
        if isinstance(cmd, Status | Logs | Cancel | Plot | Report):  # the runs mjlab-submit made
            return _COMMANDS[type(cmd)](
                replace(cmd, log_root=default_log_root(cmd.log_root, named))
            )
        return _COMMANDS[type(cmd)](cmd)

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())

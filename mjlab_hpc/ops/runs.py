"""Finding runs and the jobs behind them.

This module lists the run directories under a log root, the job ids of a run (Slurm's or the
local executor's), and what a RUN|JOB argument names. A run directory knows its jobs from, in
this order: `sweep_element.json` (an element of a sweep: its array job id `<array>_<index>`),
the submitit folder's file names (`<job>_submitted.pkl`; a `<job>_submission.sh` marks a Slurm
job, its absence a local one whose job id is the controller's pid) and `run.json` (`job_ids`,
`launch_mode`).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir.layout import (
    SWEEP_RECORD,
    TIMESTAMP_FORMAT,
    ElementRecord,
    RunDir,
    is_run_dir,
    read_element,
    read_sweep,
)
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.slurm.client import SlurmClient

__all__ = [
    "JobKind",
    "RunJobs",
    "Target",
    "created_at",
    "list_runs",
    "resolve_target",
    "run_dirs_of_job",
    "run_jobs",
    "sweep_runs",
]

JobKind = Literal["slurm", "local"]

_JOB_FILE = re.compile(
    r"^(?P<job>\d+(?:_\d+)?)_(?:submitted\.pkl|submission\.sh|\d+_log\.(?:out|err))$"
)
_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")


def created_at(run_dir: Path) -> float:
    """When the run was made: the timestamp its name starts with, else its mtime."""
    try:
        stamp = dt.datetime.strptime(run_dir.name[:19], TIMESTAMP_FORMAT)
        return stamp.timestamp()
    except ValueError:
        try:
            return run_dir.stat().st_mtime
        except OSError:
            return 0.0


def list_runs(root: Path, unreadable: list[Path] | None = None) -> list[Path]:
    """List the run directories under a log root or an experiment directory, newest first.

    A log root holds `<experiment>/<run>`, an experiment directory `<run>`. Hidden entries
    (`.sweeps`, `.keys`) are skipped, and so are folders this user may not read (another
    user's, in a team's log root): those are listed in `unreadable`.
    """
    if not root.is_dir():
        return []
    found: list[Path] = []

    def readable(path: Path) -> bool:
        if os.access(path, os.R_OK | os.X_OK):
            return True
        if unreadable is not None:
            unreadable.append(path)
        return False

    for entry in sorted(root.iterdir()) if readable(root) else ():
        if entry.name.startswith(".") or not entry.is_dir() or not readable(entry):
            continue
        if is_run_dir(entry):
            found.append(entry)
            continue
        found.extend(
            run
            for run in sorted(entry.iterdir())
            if not run.name.startswith(".") and run.is_dir() and readable(run) and is_run_dir(run)
        )
    return sorted(found, key=lambda p: (created_at(p), p.name), reverse=True)


@dataclass(frozen=True)
class RunJobs:
    """The jobs that ran (or run) a run directory, oldest first.

    A --chain's jobs are in its order. The last one is current, except in a chain, where
    Slurm's states tell which one runs.
    """

    run_dir: Path
    kind: JobKind | None
    """slurm, local (submitit's local executor), or None (a plain process, torchrun)."""
    job_ids: tuple[str, ...]
    element: ElementRecord | None = None
    unread: tuple[str, ...] = ()
    """Records of the run that were not read, and why (a damaged sweep element record)."""

    @property
    def current(self) -> str | None:
        return self.job_ids[-1] if self.job_ids else None


def _folder_jobs(folder: Path | None) -> tuple[list[str], bool]:
    """Return the job ids that a submitit folder's files name, oldest first.

    The second value tells whether they are Slurm jobs: submitit writes a submission script
    only for those.
    """
    if folder is None:
        return [], False
    seen: dict[str, float] = {}
    slurm = False
    for entry in folder.iterdir():
        m = _JOB_FILE.match(entry.name)
        if not m:
            continue
        slurm = slurm or entry.name.endswith("_submission.sh")
        try:
            mtime = entry.lstat().st_mtime
        except OSError:
            continue
        job = m.group("job")
        seen[job] = min(seen.get(job, mtime), mtime)
    return sorted(seen, key=lambda j: (seen[j], j)), slurm


def run_jobs(run_dir: Path) -> RunJobs:
    """The jobs of a run directory (see the module docstring for where they come from)."""
    unread: list[str] = []
    element = read_element(run_dir, unread)
    if element is not None:
        kind: JobKind = "slurm" if element.executor == "slurm" else "local"
        job_ids = (element.job_id, *element.chain)
        return RunJobs(run_dir=run_dir, kind=kind, job_ids=job_ids, element=element)
    record = read_record(run_dir)
    ids, slurm = _folder_jobs(RunDir(run_dir).task_folder())  # not a link out of the run
    found: JobKind | None = None
    if ids:
        found = "slurm" if slurm else "local"
    mode = record.launch_mode
    if mode == "slurm":
        found = "slurm"
    elif mode == "submitit-local" and found is None:
        found = "local"
    if found is not None:  # job ids of plain processes (torchrun's run id) are not jobs
        for start in record.starts:
            if start.job_id and start.job_id not in ids:
                ids.append(start.job_id)
    return RunJobs(
        run_dir=run_dir, kind=found, job_ids=tuple(ids) if found else (), unread=tuple(unread)
    )


def sweep_runs(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep's elements, in index order."""
    record = read_sweep(sweep_dir)
    elements = sorted(record.elements, key=lambda e: e.index) if record else []
    return [e.run_dir for e in elements if e.run_dir is not None]


def _sweeps_under(log_root: Path) -> Iterable[Path]:
    if not log_root.is_dir():
        return []
    return sorted(log_root.glob(f"*/.sweeps/*/{SWEEP_RECORD}")) + sorted(
        log_root.glob(f".sweeps/*/{SWEEP_RECORD}")
    )


@dataclass(frozen=True)
class Target:
    """What a RUN|JOB argument names: run directories, and an array's job id.

    The array's job id is set when the argument named a whole job array.
    """

    runs: tuple[Path, ...]
    array_job_id: str | None = None


def resolve_target(target: str, log_root: Path, slurm: SlurmClient | None = None) -> Target:
    """Find the run directories that a path or a job id names.

    A path is a run, a sweep's record directory, an experiment or a log root; a job id is
    Slurm's (`4711`, `4711_2`) or the local controller's pid.

    Job ids are looked up in the run directories under `log_root`, then, for Slurm jobs run
    elsewhere, through `scontrol show job` (its StdOut lies in the run's submitit folder).
    Raises SpecError naming RUN|JOB when nothing matches.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        path = path.resolve()
        if (path / SWEEP_RECORD).is_file():
            record = read_sweep(path)
            return Target(tuple(sweep_runs(path)), record.array_job_id if record else None)
        if is_run_dir(path):
            return Target((path,))
        runs = list_runs(path)
        if runs:
            return Target(tuple(runs))
        raise SpecError("RUN|JOB", f"{target} holds no run directories")
    if not _JOB_ID.match(target):
        raise SpecError("RUN|JOB", f"{target!r} is neither a directory nor a job id")
    for record_path in _sweeps_under(log_root):
        record = read_sweep(record_path.parent)
        if record is not None and record.array_job_id == target:
            return Target(tuple(sweep_runs(record_path.parent)), target)
    matches = []
    for run in list_runs(log_root):
        jobs = run_jobs(run)
        raw_ids = set(read_record(run).job_ids)
        if target in jobs.job_ids or target in raw_ids:
            matches.append(run)
    if matches:
        return Target(tuple(matches))
    slurm = slurm or SlurmClient()
    found = run_dirs_of_job(target, slurm)
    if found:
        return found
    paths = slurm.job_stdout_paths(target)
    if paths or (paths is not None and slurm.sacct([target])):
        # A job of Slurm's that is no run of ours: a plain `sbatch --wrap`, say.
        raise SpecError(
            "RUN|JOB",
            f"job {target} is not an mjlab-hpc run (no run directory of it under --log-root "
            f"{log_root}, nor where its output goes); `sacct -j {target}` shows what it used",
        )
    why = (
        "Slurm does not know it"
        if paths is not None
        else "Slurm could not be asked: scontrol did not answer"
    )
    raise SpecError(
        "RUN|JOB",
        f"no run directory for job {target} under --log-root {log_root} (and {why}); pass the "
        "run directory instead",
    )


def run_dirs_of_job(job_id: str, slurm: SlurmClient) -> Target | None:
    """Find the run directories of a job that slurmctld knows, from its StdOut paths.

    submitit writes them into the run's submitit folder, or a sweep's shared one.
    """
    runs: list[Path] = []
    for stdout in slurm.job_stdout_paths(job_id) or []:
        owner = stdout.parent.parent  # <run>/submitit/<job>_0_log.out
        if not (owner / SWEEP_RECORD).is_file():
            if is_run_dir(owner):
                runs.append(owner)
            continue
        record = read_sweep(owner)  # a sweep's shared folder: <sweep>/submitit/...
        if record is not None and record.array_job_id == job_id:
            return Target(tuple(sweep_runs(owner)), job_id)
        name = _JOB_FILE.match(stdout.name)
        runs += [
            e.run_dir
            for e in (record.elements if record else ())
            if name and e.job_id == name.group("job") and e.run_dir is not None
        ]
    unique = tuple(dict.fromkeys(runs))
    return Target(unique) if unique else None

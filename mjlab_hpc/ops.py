"""Operations on submitted runs: find runs and the jobs that run them, ask Slurm (squeue,
sacct) or this machine (the local executor's processes) what those jobs are doing, and cancel
them. `mjlab-hpc status`, `logs` and `cancel` are built on this module.

A run directory knows its jobs from, in this order: `sweep_element.json` (an element of a
sweep: its array job id `<array>_<index>`), the submitit folder's file names
(`<job>_submitted.pkl`; a `<job>_submission.sh` marks a Slurm job, its absence a local one
whose job id is the controller's pid) and `run.json` (`job_ids`, `launch_mode`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir import TIMESTAMP_FORMAT, RunDir, write_json_atomic
from mjlab_hpc.runrecord import now_iso, read_record
from mjlab_hpc.sweep import SWEEP_RECORD, ElementRecord, read_element, read_sweep

JobKind = Literal["slurm", "local"]

CANCEL_RECORD = "cancelled.json"
SUBMITIT_DIR = "submitit"
# Slurm states after which a job never runs again (REQUEUED is not one of them).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
# Files that only a run directory holds (a directory with none of them is not a run).
_RUN_MARKERS = ("run.json", "progress.jsonl", SUBMITIT_DIR, "logs", "params", "sweep_element.json")
_JOB_FILE = re.compile(
    r"^(?P<job>\d+(?:_\d+)?)_(?:submitted\.pkl|submission\.sh|\d+_log\.(?:out|err))$"
)
_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")
_GPUS = re.compile(r"gpu(?::[\w.-]+)?[:=](\d+)")


# ---------------------------------------------------------------------------- runs and jobs


def is_run_dir(path: Path) -> bool:
    """Whether `path` looks like a run directory (it holds a file only runs have)."""
    return path.is_dir() and any((path / name).exists() for name in _RUN_MARKERS)


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


def list_runs(root: Path) -> list[Path]:
    """Run directories under a log root (`<root>/<experiment>/<run>`) or an experiment
    directory (`<root>/<run>`), newest first. Hidden entries (`.sweeps`, `.keys`) are skipped."""
    if not root.is_dir():
        return []
    found: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if is_run_dir(entry):
            found.append(entry)
            continue
        found.extend(
            run
            for run in sorted(entry.iterdir())
            if not run.name.startswith(".") and is_run_dir(run)
        )
    return sorted(found, key=lambda p: (created_at(p), p.name), reverse=True)


def submitit_folder(run_dir: Path) -> Path:
    """`<run>/submitit`; for a sweep element, the array's shared folder it links to."""
    return (run_dir / SUBMITIT_DIR).resolve()


@dataclass(frozen=True)
class RunJobs:
    """The jobs that ran (or run) a run directory, oldest first: the last one is current."""

    run_dir: Path
    kind: JobKind | None
    """slurm, local (submitit's local executor), or None (a plain process, torchrun)."""
    job_ids: tuple[str, ...]
    element: ElementRecord | None = None

    @property
    def current(self) -> str | None:
        return self.job_ids[-1] if self.job_ids else None


def _folder_jobs(folder: Path) -> tuple[list[str], bool]:
    """Job ids named by the files of a submitit folder (oldest first), and whether they are
    Slurm jobs (submitit writes a submission script only for those)."""
    if not folder.is_dir():
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
    element = read_element(run_dir)
    if element is not None:
        kind: JobKind = "slurm" if element.executor == "slurm" else "local"
        return RunJobs(run_dir, kind, (element.job_id,), element)
    record = read_record(run_dir)
    ids, slurm = _folder_jobs(run_dir / SUBMITIT_DIR)
    found: JobKind | None = None
    if ids:
        found = "slurm" if slurm else "local"
    mode = record.get("launch_mode")
    if mode == "slurm":
        found = "slurm"
    elif mode == "submitit-local" and found is None:
        found = "local"
    if found is not None:  # job ids of plain processes (torchrun's run id) are not jobs
        for start in record.get("starts", []):
            job = start.get("job_id")
            if job and str(job) not in ids:
                ids.append(str(job))
    return RunJobs(run_dir, found, tuple(ids) if found else (), None)


def sweep_runs(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep's elements, in index order."""
    record = read_sweep(sweep_dir)
    elements = sorted(record.get("elements", []), key=lambda e: int(e.get("index", 0)))
    return [Path(e["run_dir"]) for e in elements if "run_dir" in e]


def _sweeps_under(log_root: Path) -> Iterable[Path]:
    if not log_root.is_dir():
        return []
    return sorted(log_root.glob(f"*/.sweeps/*/{SWEEP_RECORD}")) + sorted(
        log_root.glob(f".sweeps/*/{SWEEP_RECORD}")
    )


@dataclass(frozen=True)
class Resolved:
    """What a RUN|JOB argument names: run directories, and the array job id when it named a
    whole job array."""

    runs: tuple[Path, ...]
    array_job_id: str | None = None


def resolve_target(target: str, log_root: Path, slurm: SlurmClient | None = None) -> Resolved:
    """Run directories named by a path (a run, a sweep's record directory, an experiment or a
    log root) or by a job id (Slurm: `4711`, `4711_2`; local: the controller's pid).

    Job ids are looked up in the run directories under `log_root`, then, for Slurm jobs run
    elsewhere, through `scontrol show job` (its StdOut lies in the run's submitit folder).
    Raises SpecError naming RUN|JOB when nothing matches.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        path = path.resolve()
        if (path / SWEEP_RECORD).is_file():
            record = read_sweep(path)
            return Resolved(tuple(sweep_runs(path)), record.get("array_job_id"))
        if is_run_dir(path):
            return Resolved((path,))
        runs = list_runs(path)
        if runs:
            return Resolved(tuple(runs))
        raise SpecError("RUN|JOB", f"{target} holds no run directories")
    if not _JOB_ID.match(target):
        raise SpecError("RUN|JOB", f"{target!r} is neither a directory nor a job id")
    for record_path in _sweeps_under(log_root):
        record = read_sweep(record_path.parent)
        if str(record.get("array_job_id")) == target:
            return Resolved(tuple(sweep_runs(record_path.parent)), target)
    matches = []
    for run in list_runs(log_root):
        jobs = run_jobs(run)
        raw_ids = {str(j) for j in read_record(run).get("job_ids", [])}
        if target in jobs.job_ids or target in raw_ids:
            matches.append(run)
    if matches:
        return Resolved(tuple(matches))
    found = (slurm or SlurmClient()).run_dirs_of(target)
    if found:
        return found
    raise SpecError(
        "RUN|JOB",
        f"no run directory for job {target} under --log-root {log_root} "
        "(and Slurm does not know it); pass the run directory instead",
    )


# ---------------------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class SlurmRow:
    """One job (or array element) as squeue or sacct reports it."""

    job_id: str
    """`4711`, or `4711_2` for an element of a job array."""
    raw_id: str
    state: str
    nodes: int | None
    gpus_per_node: int | None
    node_list: str | None
    source: Literal["squeue", "sacct"]

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def matches(self, asked: str) -> bool:
        return asked in (self.job_id, self.raw_id)


def _int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


@dataclass(frozen=True)
class SlurmClient:
    """Runs Slurm's commands (squeue, sacct, scontrol, scancel) with a given environment."""

    env: Mapping[str, str] | None = None
    """Environment of the commands (default: this process's; tests add SLURM_CONF)."""
    timeout_s: float = 30.0

    def run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
        """Run a Slurm command; None when it is not installed or hangs."""
        try:
            return subprocess.run(
                list(args),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                env=dict(self.env) if self.env is not None else None,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    def squeue(self, ids: Sequence[str]) -> list[SlurmRow]:
        """The jobs slurmctld still knows (running, pending, and recently ended ones)."""
        if not ids:
            return []
        fmt = "%i|%F|%K|%A|%T|%D|%N|%b"
        proc = self.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", fmt])
        if proc is None or proc.returncode != 0:
            return []  # all ids unknown ("Invalid job id"), or no Slurm here
        rows = []
        for line in proc.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 8:
                continue
            job, array, task, raw, state, nodes, node_list, tres = parts
            job_id = f"{array}_{task}" if task.isdigit() else job
            gpus = _GPUS.search(tres)
            rows.append(
                SlurmRow(
                    job_id=job_id,
                    raw_id=raw,
                    state=state,
                    nodes=_int(nodes),
                    gpus_per_node=int(gpus.group(1)) if gpus else None,
                    node_list=node_list or None,
                    source="squeue",
                )
            )
        return rows

    def sacct(self, ids: Sequence[str]) -> list[SlurmRow] | None:
        """The jobs in accounting; None when sacct fails (e.g. accounting is disabled)."""
        if not ids:
            return []
        fields = "JobID,JobIDRaw,State,NNodes,AllocTRES,NodeList"
        proc = self.run(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", fields])
        if proc is None or proc.returncode != 0:
            return None
        rows = []
        for line in proc.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 6 or not parts[2]:
                continue
            job, raw, state, nodes, tres, node_list = parts
            n = _int(nodes)
            gpus = re.search(r"gres/gpu=(\d+)", tres)
            per_node = int(gpus.group(1)) // n if gpus and n else None
            rows.append(
                SlurmRow(
                    job_id=job,
                    raw_id=raw,
                    state=state.split()[0],  # "CANCELLED by 0" -> CANCELLED
                    nodes=n,
                    gpus_per_node=per_node,
                    node_list=None if node_list in ("", "None assigned") else node_list,
                    source="sacct",
                )
            )
        return rows

    def query(self, ids: Sequence[str]) -> tuple[dict[str, SlurmRow], bool]:
        """The freshest row for every id that Slurm knows, and whether accounting answered.

        squeue is current while slurmctld knows the job; sacct has the precise end state
        (squeue says COMPLETING while sacct already says CANCELLED) and jobs slurmctld has
        forgotten. Without accounting only squeue is used, and callers fall back to the run
        record for jobs squeue no longer lists.
        """
        ids = sorted(set(ids))
        queue = self.squeue(ids)
        accounting = self.sacct(ids)
        out: dict[str, SlurmRow] = {}
        for asked in ids:
            sq = next((r for r in queue if r.matches(asked)), None)
            sa = next((r for r in accounting or [] if r.matches(asked)), None)
            if sq is not None and not (sq.final or sq.state == "COMPLETING"):
                out[asked] = sq  # sacct may still say PENDING for a job that just started
            elif sa is not None and sa.final:
                out[asked] = sa
            elif sq is not None:
                out[asked] = sq
            elif sa is not None:
                out[asked] = sa
        return out, accounting is not None

    def run_dirs_of(self, job_id: str) -> Resolved | None:
        """Run directories of a job slurmctld knows, from its StdOut paths (submitit writes
        them into the run's submitit folder, or a sweep's shared one)."""
        proc = self.run(["scontrol", "show", "job", job_id])
        if proc is None or proc.returncode != 0:
            return None
        runs: list[Path] = []
        for m in re.finditer(r"StdOut=(\S+)", proc.stdout):
            stdout = Path(m.group(1))
            owner = stdout.parent.parent  # <run>/submitit/<job>_0_log.out
            if not (owner / SWEEP_RECORD).is_file():
                if is_run_dir(owner):
                    runs.append(owner)
                continue
            record = read_sweep(owner)  # a sweep's shared folder: <sweep>/submitit/...
            if str(record.get("array_job_id")) == job_id:
                return Resolved(tuple(sweep_runs(owner)), job_id)
            name = _JOB_FILE.match(stdout.name)
            runs += [
                Path(e["run_dir"])
                for e in record.get("elements", [])
                if name and e.get("job_id") == name.group("job") and "run_dir" in e
            ]
        unique = tuple(dict.fromkeys(runs))
        return Resolved(unique) if unique else None

    def scancel(self, ids: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
        return self.run(["scancel", *ids])

    def forbid_requeue(self, job_id: str) -> subprocess.CompletedProcess[str] | None:
        # Our ranks answer SIGTERM (which scancel sends) with a checkpoint and
        # `scontrol requeue`; a job that may not be requeued stays cancelled.
        return self.run(["scontrol", "update", f"JobId={job_id}", "Requeue=0"])


# ---------------------------------------------------------------------------- local processes


@dataclass(frozen=True)
class LocalProcess:
    """A process of this machine that works for a run's submitit folder."""

    pid: int
    role: Literal["controller", "rank", "launcher"]
    """controller: the local executor's controller; rank: a Python process running a task;
    launcher: anything else naming the folder (srun, the shell that runs a local job's setup
    lines before its controller)."""


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie waits only to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def local_processes(run_dir: Path) -> list[LocalProcess]:
    """The live processes of this machine started for the run's submitit folder."""
    folders = {str(run_dir.absolute() / SUBMITIT_DIR), str(submitit_folder(run_dir))}
    quoted = [re.compile(re.escape(shlex.quote(f)) + r"(?=$|\s)") for f in folders]
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        in_argv = any(a in folders for a in argv)
        # A job with setup lines runs its controller under `sh -c "<setup> && python ..."`.
        in_shell = any(p.search(a) for p in quoted for a in argv[1:]) if not in_argv else False
        if not (in_argv or in_shell) or not _alive(int(entry.name)):
            continue
        role: Literal["controller", "rank", "launcher"] = "launcher"
        if "submitit.local._local" in argv:
            role = "controller"
        elif "submitit.core._submit" in argv and Path(argv[0]).name.startswith("python"):
            role = "rank"
        found.append(LocalProcess(int(entry.name), role))
    return found


# ---------------------------------------------------------------------------- states


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


def cancel_marker(run_dir: Path) -> dict[str, Any] | None:
    """The cancel record, if the run was cancelled after its last start."""
    try:
        marker = dict(json.loads((run_dir / CANCEL_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    starts = read_record(run_dir).get("starts", [])
    last_start = str(starts[-1].get("at", "")) if starts else ""
    # ISO 8601 with the same offset sorts as text; a start after the cancel wins.
    return marker if str(marker.get("at", "")) >= last_start else None


def writer_alive(run_dir: Path) -> bool:
    """Whether the run's writer heartbeats its lease lock (whatever launched it)."""
    from mjlab_hpc.lock import LeaseLock, LockError
    from mjlab_hpc.rundir import RunWriter

    path = run_dir / RunWriter.LOCK_NAME
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
        "running": "LOST",
    }.get(state)
    if mapped is None:
        return JobState("UNKNOWN", "none", False)
    return JobState(mapped, "record", False, record.get("num_nodes"))


def job_states(
    runs: Sequence[RunJobs], slurm: SlurmClient | None = None
) -> tuple[dict[Path, JobState], bool | None]:
    """Every run's state (one squeue and one sacct call for all Slurm runs), and whether
    accounting answered (None: no Slurm run asked)."""
    slurm = slurm or SlurmClient()
    slurm_ids = [r.current for r in runs if r.kind == "slurm" and r.current]
    rows, accounting = slurm.query(slurm_ids) if slurm_ids else ({}, None)
    out: dict[Path, JobState] = {}
    for run in runs:
        row = rows.get(run.current or "") if run.kind == "slurm" else None
        if row is not None:
            active = not row.final
            out[run.run_dir] = JobState(row.state, row.source, active, row.nodes, row.gpus_per_node)
        elif run.kind == "local" and local_processes(run.run_dir):
            out[run.run_dir] = JobState("RUNNING", "process", True, 1)
        else:
            out[run.run_dir] = record_state(run.run_dir)
    return out, accounting if slurm_ids else None


# ---------------------------------------------------------------------------- cancel


@dataclass(frozen=True)
class CancelOutcome:
    """What cancelling one job (or a whole job array) did."""

    kind: JobKind
    job_ids: tuple[str, ...]
    runs: tuple[Path, ...]
    ok: bool
    message: str
    remaining_pids: tuple[int, ...] = field(default=())


def _write_cancel_marker(run_dir: Path, job_ids: Sequence[str]) -> None:
    write_json_atomic(
        run_dir / CANCEL_RECORD,
        {
            "at": now_iso(),
            "by": f"{getpass.getuser()}@{socket.gethostname()}",
            "job_ids": list(job_ids),
        },
    )


def cancel_slurm(
    job_ids: Sequence[str], runs: Sequence[Path], slurm: SlurmClient, grace_s: float = 30.0
) -> CancelOutcome:
    """scancel the jobs that are still queued or running, after forbidding their requeue.

    Waits up to `grace_s` until none of them is pending or running; a job that comes back
    to the queue (requeued by a rank in the instant before Requeue=0 took effect) is
    cancelled again.
    """
    states, _ = slurm.query(job_ids)
    active = [j for j in job_ids if j in states and not states[j].final]
    if not active:
        seen = ", ".join(f"{j} {states[j].state}" for j in job_ids if j in states)
        return CancelOutcome(
            "slurm", tuple(job_ids), tuple(runs), True, f"nothing to cancel ({seen or 'ended'})"
        )
    for run in runs:
        _write_cancel_marker(run, active)
    for job in active:
        slurm.forbid_requeue(job)
    proc = slurm.scancel(active)
    if proc is None or proc.returncode != 0:
        why = "scancel not found" if proc is None else (proc.stderr.strip() or proc.stdout)
        return CancelOutcome("slurm", tuple(active), tuple(runs), False, f"scancel failed: {why}")
    deadline = time.monotonic() + grace_s
    while True:
        rows, _ = slurm.query(active)
        queued = [j for j in active if j in rows and rows[j].state in ("PENDING", "REQUEUED")]
        running = [j for j in active if j in rows and not rows[j].final]
        running = [j for j in running if rows[j].state != "COMPLETING"]
        if queued:
            slurm.scancel(queued)
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    summary = ", ".join(f"{j} {rows[j].state}" if j in rows else f"{j} gone" for j in active)
    ok = not running
    message = f"cancelled: {summary}" if ok else f"still running after {grace_s:g} s: {summary}"
    return CancelOutcome("slurm", tuple(active), tuple(runs), ok, message)


def cancel_local(run_dir: Path, grace_s: float = 30.0) -> CancelOutcome:
    """Stop a local-executor run and leave no process behind.

    The controller is killed first (SIGKILL): on SIGTERM it would forward the signal and then
    restart the ranks, which exit for a requeue after a stop. The ranks get SIGTERM, save a
    checkpoint at the next iteration boundary and exit; any rank still alive after `grace_s`
    gets SIGKILL.
    """
    jobs = run_jobs(run_dir)
    procs = local_processes(run_dir)
    if not procs:
        return CancelOutcome("local", jobs.job_ids, (run_dir,), True, "no process left to stop")
    _write_cancel_marker(run_dir, jobs.job_ids)
    controllers = [p.pid for p in procs if p.role != "rank"]
    ranks = [p.pid for p in procs if p.role == "rank"]
    for pid in controllers:
        _signal(pid, signal.SIGKILL)
    for pid in ranks:
        _signal(pid, signal.SIGTERM)
    left = _wait_gone(ranks + controllers, grace_s)
    killed = list(left)
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    left = _wait_gone(killed, 10.0)
    # A rank started between our scan and the kill of its controller: stop it too.
    late = [p.pid for p in local_processes(run_dir)]
    for pid in late:
        _signal(pid, signal.SIGKILL)
    left = _wait_gone(left + late, 10.0)
    parts = [f"controller {', '.join(map(str, controllers)) or '-'} killed"]
    parts.append(
        f"{len(ranks) - len([p for p in killed if p in ranks])} rank(s) stopped by SIGTERM"
    )
    if killed:
        parts.append(f"{len(killed)} killed after {grace_s:g} s")
    parts.append("no process left" if not left else f"still alive: {left}")
    return CancelOutcome("local", jobs.job_ids, (run_dir,), not left, "; ".join(parts), tuple(left))


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


def cancel(
    resolved: Resolved, slurm: SlurmClient | None = None, grace_s: float = 30.0
) -> list[CancelOutcome]:
    """Cancel what a RUN|JOB argument named: a whole job array at once, else every run's
    current job (Slurm) or processes (local)."""
    slurm = slurm or SlurmClient()
    runs = [run_jobs(r) for r in resolved.runs]
    outcomes = []
    if resolved.array_job_id is not None and all(r.kind == "slurm" for r in runs):
        return [cancel_slurm([resolved.array_job_id], resolved.runs, slurm, grace_s)]
    slurm_runs = [r for r in runs if r.kind == "slurm" and r.current]
    if slurm_runs:
        ids = list(dict.fromkeys(str(r.current) for r in slurm_runs))
        outcomes.append(cancel_slurm(ids, [r.run_dir for r in slurm_runs], slurm, grace_s))
    for run in runs:
        if run.kind == "local":
            outcomes.append(cancel_local(run.run_dir, grace_s))
        elif run.kind is None:
            outcomes.append(
                CancelOutcome(
                    "local",
                    (),
                    (run.run_dir,),
                    False,
                    "not a Slurm or local-executor job: stop the process that runs it "
                    "(Ctrl-C, or kill its mjlab-train / torchrun)",
                )
            )
    return outcomes


def progress_tail(run_dir: Path, lines: int = 10) -> list[dict[str, Any]]:
    """The last `lines` records of progress.jsonl, read from the end of the file."""
    path = RunDir(run_dir).progress
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 512 * (lines + 1)))
            chunk = f.read().decode(errors="replace")
    except OSError:
        return []
    records = []
    for line in chunk.splitlines()[-(lines + 1) :]:
        try:
            records.append(dict(json.loads(line)))
        except (ValueError, TypeError):
            continue  # the first, partial line of the chunk, or a torn last line
    return records[-lines:]

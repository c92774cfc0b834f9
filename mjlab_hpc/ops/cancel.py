"""`mjlab-hpc cancel`: stop a Slurm job for good (no requeue) or a local-executor run.

No process is left behind, and nothing is claimed that was not done: a run of another user is
left alone (said, not attempted), a cancel record that cannot be written cancels nothing, and
every process counted as stopped was signalled.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mjlab_hpc.ops.runs import JobKind, Target, run_jobs
from mjlab_hpc.procs import descendants, owner, send_signal, user_name, wait_gone
from mjlab_hpc.rundir.layout import CANCEL_RECORD
from mjlab_hpc.rundir.record import now_iso, read_record
from mjlab_hpc.rundir.running import run_processes
from mjlab_hpc.rundir.state import CancelRecord, write_cancel_record
from mjlab_hpc.slurm.client import SlurmClient

__all__ = ["CancelOutcome", "cancel", "cancel_local", "cancel_slurm", "write_cancel_marker"]


@dataclass(frozen=True)
class CancelOutcome:
    """What cancelling one job (or a whole job array) did."""

    kind: JobKind
    job_ids: tuple[str, ...]
    runs: tuple[Path, ...]
    ok: bool
    message: str
    remaining_pids: tuple[int, ...] = field(default=())


def _marked(run_dir: Path, job_ids: Sequence[str]) -> str | None:
    """Write the cancel record; why it could not be (None: written)."""
    try:
        write_cancel_marker(run_dir, job_ids)
    except OSError as exc:
        why = exc.strerror or exc
        return (
            f"cannot write {CANCEL_RECORD} in {run_dir} as {getpass.getuser()} ({why}): "
            "nothing was cancelled; ask the run's owner (or root)"
        )
    return None


def write_cancel_marker(run_dir: Path, job_ids: Sequence[str]) -> None:
    """Record in the run directory that the user cancelled these jobs.

    A rank that gets the cancel's SIGTERM then stops for good instead of taking it for a
    preemption. `starts`: how many starts the run had; a later one (a resume) is not
    cancelled. Starts are counted, not timed: this machine's clock need not agree with the
    nodes'.
    """
    write_cancel_record(
        run_dir,
        CancelRecord(
            at=now_iso(),
            by=f"{getpass.getuser()}@{socket.gethostname()}",
            job_ids=tuple(job_ids),
            starts=len(read_record(run_dir).starts),
        ),
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

    def outcome(ok: bool, message: str) -> CancelOutcome:
        ids = tuple(active or job_ids)
        return CancelOutcome(kind="slurm", job_ids=ids, runs=tuple(runs), ok=ok, message=message)

    if not active:
        seen = ", ".join(f"{j} {states[j].state}" for j in job_ids if j in states)
        return outcome(True, f"nothing to cancel ({seen or 'ended'})")
    for run in runs:
        if (why := _marked(run, active)) is not None:
            for done in runs[: runs.index(run)]:
                (done / CANCEL_RECORD).unlink(missing_ok=True)
            return outcome(False, why)
    slurm.forbid_requeue(active)  # one scontrol call for all of them
    proc = slurm.scancel(active)
    if proc is None or proc.returncode != 0:
        why = "no answer" if proc is None else (proc.stderr.strip() or proc.stdout.strip())
        for run in runs:  # nothing was cancelled: the record must not say it was
            (run / CANCEL_RECORD).unlink(missing_ok=True)
        return outcome(False, f"scancel failed ({why}): nothing was cancelled")
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
    if running:
        return outcome(False, f"still running after {grace_s:g} s: {summary}")
    return outcome(True, f"cancelled: {summary}")


def cancel_local(run_dir: Path, grace_s: float = 30.0) -> CancelOutcome:
    """Stop a local-executor run and leave no process behind.

    Only the run's own processes are signalled: those it recorded (`run_processes`: pid and
    start time, never a command line) and what its controller started. The controller is
    stopped, its children taken, then killed (on SIGTERM it would forward the signal and then
    restart the ranks, which exit for a requeue after a stop). The ranks get SIGTERM, save a
    checkpoint at the next iteration boundary and exit; any rank still alive after `grace_s`
    gets SIGKILL.
    """
    jobs = run_jobs(run_dir)
    procs = run_processes(run_dir)

    def outcome(ok: bool, message: str, remaining: Sequence[int] = ()) -> CancelOutcome:
        return CancelOutcome(
            kind="local",
            job_ids=jobs.job_ids,
            runs=(run_dir,),
            ok=ok,
            message=message,
            remaining_pids=tuple(remaining),
        )

    if not procs:
        return outcome(True, "no process left to stop")
    me = os.geteuid()
    others = {p.uid for p in procs if p.uid != me}
    if others and me != 0:  # a signal would be refused (EPERM): claim nothing, do nothing
        who = ", ".join(sorted(map(user_name, others)))
        pids = ", ".join(str(p.pid) for p in procs)
        return outcome(
            False,
            f"run by {who} (pid {pids}), not by {user_name(me)}: only its owner (or root) can "
            "stop it; nothing was done",
        )
    if (why := _marked(run_dir, jobs.job_ids)) is not None:
        return outcome(False, why)
    # A stopped controller starts nothing more: what it started so far is all there is.
    controllers = [p.pid for p in procs if p.role == "controller"]
    uid = procs[0].uid
    stopped = [pid for pid in controllers if send_signal(pid, signal.SIGSTOP)]
    started = [c for pid in stopped for c in descendants(pid) if owner(c) == uid]
    # Only what a signal reached is counted (a process gone by now was not stopped by us).
    controllers = [pid for pid in controllers if send_signal(pid, signal.SIGKILL)]
    ranks = dict.fromkeys([*started, *(p.pid for p in procs if p.role == "rank")])
    ranks = [pid for pid in ranks if send_signal(pid, signal.SIGTERM)]
    killed = wait_gone(ranks + controllers, grace_s)  # still alive after the grace period
    for pid in killed:
        send_signal(pid, signal.SIGKILL)
    left = wait_gone(killed, 10.0)
    parts = [f"controller {', '.join(map(str, controllers)) or '-'} killed"]
    parts.append(
        f"{len(ranks) - len([p for p in killed if p in ranks])} rank(s) stopped by SIGTERM"
    )
    if killed:
        parts.append(f"{len(killed)} killed after {grace_s:g} s")
    parts.append("no process left" if not left else f"still alive: {left}")
    return outcome(not left, "; ".join(parts), left)


def cancel(
    resolved: Target, slurm: SlurmClient | None = None, grace_s: float = 30.0
) -> list[CancelOutcome]:
    """Cancel what a RUN|JOB argument named.

    A whole job array goes at once; else every run's jobs that are still queued or running
    (Slurm, a --chain's included) or its processes (local).
    """
    slurm = slurm or SlurmClient()
    runs = [run_jobs(r) for r in resolved.runs]
    outcomes = []
    # A --chain's queued jobs go too: each would otherwise start and continue the run.
    chained = [j for r in runs if r.element for j in r.element.chain]
    if resolved.array_job_id is not None and all(r.kind == "slurm" for r in runs):
        ids = [resolved.array_job_id, *dict.fromkeys(chained)]
        return [cancel_slurm(ids, resolved.runs, slurm, grace_s=grace_s)]
    slurm_runs = [r for r in runs if r.kind == "slurm" and r.current]
    if slurm_runs:
        # Every job of each run (those that ended are skipped): a --chain's later ones too.
        ids = list(dict.fromkeys(str(j) for r in slurm_runs for j in r.job_ids))
        run_dirs = [r.run_dir for r in slurm_runs]
        outcomes.append(cancel_slurm(ids, run_dirs, slurm, grace_s=grace_s))
    for run in runs:
        if run.kind == "local":
            outcomes.append(cancel_local(run.run_dir, grace_s))
        elif run.kind is None:
            outcomes.append(
                CancelOutcome(
                    kind="local",
                    job_ids=(),
                    runs=(run.run_dir,),
                    ok=False,
                    message="not a Slurm or local-executor job: stop the process that runs it "
                    "(Ctrl-C, or kill its mjlab-train / torchrun)",
                )
            )
    return outcomes

"""Every way a rank is asked to stop, and the iteration boundary where it acts on it.

Signal handlers only record a stop (`rank.signals` says what each signal means), and so does
the supervisor watch when the process supervising the rank disappears. At the next iteration
boundary all ranks agree in one collective and the writer saves a checkpoint and records the
stop as its signal says; only then does rank 0 ask Slurm what the stop is (a preemption, a
requeue, a cancel, a lost node), each command bounded by STOP_SLURM_S. A requeue-type stop
then requeues where a scheduler can (`after_stop`); a stop for good exits 3. The lifecycle:
docs/preemption.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mjlab_hpc.errors import EXIT_FAILED, EXIT_LOCAL_REQUEUE, EXIT_OK, EXIT_REQUEUE, EXIT_STOPPED
from mjlab_hpc.procs import alive
from mjlab_hpc.rank.context import (
    ALLOCATION_ENV,
    SIGNAL_DELAY_ENV,
    START_ENV,
    SUPERVISOR_ENV,
    DistContext,
    chain_link,
)
from mjlab_hpc.rank.signals import (
    NO_SIGNAL,
    Stop,
    StopKind,
    StopReason,
    StopRequest,
    classify,
    why_signalled,
)
from mjlab_hpc.rank.stragglers import StragglerWatch
from mjlab_hpc.rank.watchdog import FaultInjection, Watchdog
from mjlab_hpc.rank.workload import Workload, rank_state
from mjlab_hpc.rundir.checkpoint import (
    CheckpointPolicy,
    Checkpoints,
    publish_rank_states,
    write_rank_state,
)
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.progress import CheckpointTime, IterationStats, checkpoint_line
from mjlab_hpc.rundir.record import (
    StopEntry,
    on_recovered,
    on_stop,
    on_stop_answered,
    on_stragglers,
    read_record,
)
from mjlab_hpc.rundir.state import cancel_marker
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.slurm.client import SlurmClient, own_job

__all__ = [
    "LOST_BEFORE_S",
    "STOP_SLURM_S",
    "Interrupted",
    "IterationBoundary",
    "Stopped",
    "Supervision",
    "after_stop",
    "agree",
    "agree_boundary",
]

log = logging.getLogger("mjlab_hpc")

# Seconds before a SIGTERM in which a node Slurm set DOWN explains it (the SIGTERM follows at
# once; the slack covers a slow iteration before the rank looked).
LOST_BEFORE_S = 60.0

# Seconds each Slurm command of a stop may take; they come after the checkpoint and its record
# are on disk. Slurm's default KillWait (30 s from the stop's SIGTERM to SIGKILL) leaves room
# for the iteration's end, the checkpoint and two of them: a slurmctld that does not answer
# costs one (Slurm's client gives up after MessageTimeout, 10 s by default), and the client
# then answers the others at once. Where SIGKILL comes first, the checkpoint is kept.
STOP_SLURM_S = 10.0


def agree(request: StopRequest, distributed: bool, device: str) -> Stop | None:
    """The strongest stop any rank recorded (None: none); the same answer on every rank."""
    return agree_boundary(request, distributed, device)[0]


def agree_boundary(
    request: StopRequest,
    distributed: bool,
    device: str,
    save_due: bool = False,
    busy_s: float = 0.0,
) -> tuple[Stop | None, bool, list[float]]:
    """Exchange what every rank needs at an iteration boundary, in one all-gather.

    Returns the strongest stop any rank recorded, whether any rank wants a checkpoint now
    (`save_due`: --save-every-min, or a signal that asks for one), and every rank's `busy_s`
    (its work in the iteration, for the stragglers). Every rank gets the same answer.
    """
    code, save, busy = request.code, int(save_due or bool(request.save)), [busy_s]
    if distributed:
        mine = torch.tensor([code, save, round(busy_s * 1e6)], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        table = torch.stack(every).cpu()
        code, save = int(table[:, 0].max()), int(table[:, 1].max())
        busy = [us / 1e6 for us in table[:, 2].tolist()]
    if code == 0:
        return None, bool(save), busy
    signum = code & 0xFF
    kind, reason = classify(signum, request.mode, request.time_limit_signal)
    return Stop(kind, reason, 0 if signum == NO_SIGNAL else signum), bool(save), busy


class Supervision:
    """Watches the processes that supervise this rank and records a stop when one is gone.

    It watches the PIDs our foreground launchers name in _MJLAB_HPC_SUPERVISOR_PIDS, and the
    parent process when it is a supervisor of ours (submitit's local controller, torchrun's
    agent): a rank re-parented to init has lost it. A daemon thread checks every `poll_s`.
    """

    def __init__(
        self,
        request: StopRequest,
        watch_parent: bool,
        env: dict[str, str] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        env = dict(os.environ) if env is None else env
        self.request = request
        self.parent = os.getppid() if watch_parent else None
        self.pids = [int(p) for p in env.get(SUPERVISOR_ENV, "").split(",") if p.strip().isdigit()]
        self.poll_s = poll_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Supervision:
        if self.parent is not None or self.pids:
            self._thread = threading.Thread(target=self._run, name="supervision", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _gone(self) -> str | None:
        if self.parent is not None and os.getppid() != self.parent:
            return f"its supervisor (pid {self.parent}) is gone"
        for pid in self.pids:
            if not alive(pid):
                return f"its launcher (pid {pid}) is gone"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            why = self._gone()
            if why is not None:
                self.lost = why
                log.warning("stopping at the next iteration boundary: %s", why)
                self.request.supervisor_lost()
                return


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C stopped training at once, without a checkpoint."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(run_dir)
        self.run_dir = run_dir


class Stopped(Exception):
    """Raised out of the training loop after the stop checkpoint is on disk."""

    def __init__(
        self, iteration: int, stop: Stop, ctx: DistContext | None = None, restarts: int = 0
    ) -> None:
        super().__init__(iteration, stop)
        self.iteration = iteration
        self.stop = stop
        self.ctx = ctx
        """The stopped rank's context (set by train_rank), for the launcher's next step."""
        self.restarts = restarts
        """How many times this run was restarted after a requeue-type stop so far."""
        self.run_dir: str | None = None
        """The run directory (set by train_rank)."""

    @property
    def reason(self) -> StopReason:
        """Why the run stopped."""
        return self.stop.reason

    def __str__(self) -> str:
        by = f", {self.stop.signal_name}" if self.stop.signum else ""
        return f"stopped at iteration {self.iteration} ({self.stop.reason}{by})"


def after_stop(stopped: Stopped, max_restarts: int) -> int:
    """Requeue the job where the launcher can, and return the exit code for this rank.

    A stop for good exits 3 everywhere. For a requeue-type stop, srun tasks have rank 0 run
    `scontrol requeue` (while restarts remain) and exit 0, so Slurm starts the job again; at
    the time limit of a --chain job that is not the last, the next job continues instead.
    Submitit's local executor restarts ranks that exit 144. Elsewhere (a plain process,
    torchrun, srun inside a salloc allocation) ranks exit 3 and the user resumes.
    """
    ctx = stopped.ctx
    if ctx is None or stopped.stop.kind == StopKind.FOR_GOOD:
        return EXIT_STOPPED
    if stopped.run_dir and cancel_marker(Path(stopped.run_dir)) is not None:
        return EXIT_STOPPED  # the SIGTERM of a cancel, not a preemption: no requeue
    link = chain_link(os.environ)
    if ctx.mode == "slurm" and stopped.reason == "time-limit" and link and link[0] < link[1]:
        # The next job of the chain is queued behind this one and continues the run.
        # The rank log is closed by now: say it in the task's stderr (submitit's .err file).
        if ctx.is_main:
            print(
                f"{stopped}; job {link[0]} of {link[1]} of the chain ends here, the next "
                "one continues the run",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_OK
    if stopped.restarts >= max_restarts and ctx.mode in ("slurm", "submitit-local"):
        log.error(
            "%s; not requeued: the run already restarted %d times (--max-restarts %d)",
            stopped,
            stopped.restarts,
            max_restarts,
        )
        return EXIT_FAILED
    if ctx.mode == "slurm" and ctx.job_id and ALLOCATION_ENV not in os.environ:
        if ctx.is_main and shutil.which("scontrol") is None:
            # A container image without Slurm's client: the batch script requeues, outside it.
            print(
                f"{stopped}; no scontrol here: the batch script requeues the job",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_REQUEUE
        client = SlurmClient(timeout_s=STOP_SLURM_S)
        if ctx.is_main and not client.requeue(own_job(os.environ) or ctx.job_id):
            if client.unreachable:  # the batch script tries again, for longer than KillWait
                print(
                    f"{stopped}; slurmctld unreachable: the batch script requeues the job",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_REQUEUE
            return EXIT_FAILED
        return EXIT_OK
    if ctx.mode == "submitit-local":
        return EXIT_LOCAL_REQUEUE
    return EXIT_STOPPED


@dataclass(frozen=True)
class _NotWritten:
    """A rank's state that was not written, as the writer learns it."""

    rank: int
    error: str
    """The exception's type and message."""
    errno: int | None = None
    """An OSError's errno (a full disk is the environment's, said in one line)."""
    filename: str | None = None
    """The file an OSError names."""

    @classmethod
    def of(cls, rank: int, exc: Exception) -> _NotWritten:
        oserror = exc if isinstance(exc, OSError) else None
        return cls(
            rank=rank,
            error=f"{type(exc).__name__}: {exc}",
            errno=oserror.errno if oserror else None,
            filename=str(oserror.filename) if oserror and oserror.filename else None,
        )


def _gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Gather every rank's `obj` on rank 0 (None on the other ranks)."""
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


@dataclass
class IterationBoundary:
    """The hook every rank runs after each iteration: stops, checkpoints and stragglers."""

    work: Workload
    run: RunDir
    ctx: DistContext
    device: str
    policy: CheckpointPolicy
    total: int
    """The iteration the run ends at."""
    start: int
    """The iteration this start resumed from."""
    request: StopRequest
    writer: RunWriter | None
    """The run's writer (rank 0); None on the other ranks."""
    checkpoints: Checkpoints | None
    """The writer's view of the run's checkpoints; None on the other ranks."""
    restarts: dict[str, int]
    """Requeues so far by reason (the same on every rank: read before training)."""
    watchdog: Watchdog | None = None
    injections: tuple[FaultInjection, ...] = ()
    stragglers: StragglerWatch | None = None
    """Ranks slower than the others (None: one rank)."""
    _last_save: float = field(default_factory=time.monotonic)
    _recovered: bool = False

    def __call__(self, runner: Any, s: IterationStats) -> None:
        entered = time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.progress(s.iteration)
        if self.writer is not None and not self._recovered:
            self._recovered = True
            self._record_recovery()
        for injection in self.injections:
            injection.fire_if_due(self.run, self.ctx.rank, s.iteration, s.iteration_s)
        due = self.policy.time_due(time.monotonic() - self._last_save)
        # A rank's work: its iteration but the collectives (where it waited for the others),
        # and this hook so far; not the writer's own bookkeeping, which the others do not do.
        work_s = max(0.0, s.iteration_s - s.collective_s) + time.perf_counter() - entered
        stop, save, busy = agree_boundary(
            self.request, self.ctx.is_distributed, self.device, save_due=due, busy_s=work_s
        )
        self._say_signals(save)
        if self.stragglers is not None and self.stragglers.add(s.iteration, busy):
            self._record_stragglers()
        if stop is not None and s.iteration >= self.total:
            stop = None  # the run is done: it completes (every rank agreed on the same value)
        if self.watchdog is not None and (stop is not None or s.iteration >= self.total):
            self.watchdog.disarm()  # what follows (W&B's upload, the last records) is no hang
        recorded = None
        if stop is not None or save or self.policy.periodic(s.iteration, self.total):
            dog = self.watchdog
            with dog.paused() if dog is not None else contextlib.nullcontext():
                recorded = self._checkpoint(s.iteration, stop)
        if stop is not None and stop.reason in ("preemption", "time-limit"):
            # Slurm only now: its answer may not come before KillWait's SIGKILL (slurmctld
            # away), and the checkpoint and the stop as its signal says are on disk already.
            answered = self._why(stop, first=s.iteration == self.start + 1)
            if answered != stop:
                self._answered(recorded, answered, s.iteration)
            stop = answered
        if stop is not None:
            raise Stopped(s.iteration, stop, self.ctx, restarts=self.restarts.get(stop.reason, 0))

    def _say_signals(self, save: bool) -> None:
        """Say the signals that asked for a checkpoint (saved now) or that were ignored."""
        request = self.request
        if save and request.save:
            log.info(
                "checkpoint at this iteration, asked for by %s; training goes on",
                signal.Signals(request.save).name,
            )
            request.save = 0
        for signum in dict.fromkeys(request.ignored):
            log.warning(
                "%s ignored (it means nothing to a rank: docs/preemption.md)",
                signal.Signals(signum).name,
            )
        request.ignored.clear()

    def _why(self, stop: Stop, first: bool) -> Stop:
        """Ask Slurm what a TERM or time-limit stop is (`why_signalled`).

        Rank 0 looks at the job (one `scontrol show job` and one `sinfo`) and every rank
        gets its answer.
        """
        link = chain_link(os.environ)
        if stop.reason == "time-limit" and link and link[0] < link[1]:
            return stop  # not a requeue: the next job of the chain goes on, queued already
        job: dict[str, str] | None = None
        lost: list[str] = []
        if self.ctx.mode == "slurm" and self.ctx.job_id and self.ctx.is_main:
            client = SlurmClient(timeout_s=STOP_SLURM_S)
            job = client.job_fields(own_job(os.environ) or self.ctx.job_id)
            nodelist = os.environ.get("SLURM_JOB_NODELIST")
            if stop.reason == "preemption" and nodelist:
                # A node set DOWN may be back already: accounting keeps the event.
                since = (self.request.signaled_at or time.time()) - LOST_BEFORE_S
                lost = client.lost_nodes(nodelist, since=since) or []
        elif self.ctx.mode not in ("slurm", "submitit-local"):
            return stop  # nothing requeues it
        delay = os.environ.get(SIGNAL_DELAY_ENV, "")
        stop = why_signalled(
            stop,
            job,
            self.ctx.restart_count,
            lost=lost,
            before_first_iteration=first,
            delay_s=float(delay) if delay.isdigit() else None,
        )
        if stop.kind == StopKind.REQUEUE and self.ctx.is_main and self._cancelled():
            # `mjlab-hpc cancel` (a chain's links included): whatever Slurm said in time.
            stop = Stop(StopKind.FOR_GOOD, "cancelled", stop.signum, why="mjlab-hpc cancel")
        if self.ctx.mode == "slurm" and self.ctx.is_distributed:
            shared = [stop]
            dist.broadcast_object_list(shared, src=0)
            stop = shared[0]
        return stop

    def _cancelled(self) -> bool:
        """Whether `mjlab-hpc cancel` left its record for this start of the run."""
        with contextlib.suppress(OSError):
            return cancel_marker(self.run.path) is not None
        return False

    def _checkpoint(self, iteration: int, stop: Stop | None) -> StopEntry | None:
        """Save the checkpoint of `iteration` on every rank; the writer records `stop`.

        Returns the writer's record of the stop (None elsewhere, or without a stop).
        """
        recorded = None
        t0 = time.time()
        path = self.run.checkpoint(iteration)
        # Every rank writes its own state (in parallel, nothing gathered); the writer
        # publishes them, then the model file, which makes the checkpoint count.
        fits = self.work.fits
        belongs = {"run": fits["run"], "task": fits["task"], "iteration": iteration}
        try:
            mine: Any = write_rank_state(
                path,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                state=rank_state(self.work, self.device),
                belongs=belongs,
            )
        except Exception as exc:  # said by the writer, which then fails the checkpoint
            own: Exception | None = exc
            mine = _NotWritten.of(self.ctx.rank, exc)
        else:
            own = None
        for injection in self.injections:  # a drill of a fault in the write
            injection.fire_if_due(self.run, self.ctx.rank, iteration, in_checkpoint=True)
        written = _gather_to_main(mine, self.ctx)
        if self.writer is not None and self.checkpoints is not None:
            assert written is not None
            failed = [w for w in written if isinstance(w, _NotWritten)]
            if isinstance(own, OSError):
                raise own  # (a full disk, a quota: one line, as any write of the writer's)
            if disk := next((w for w in failed if w.errno is not None), None):
                what = f"{os.strerror(disk.errno)} (rank {disk.rank}'s state of {path.name})"
                raise OSError(disk.errno, what, disk.filename)
            if failed:
                said = "; ".join(f"rank {w.rank}: {w.error}" for w in failed)
                raise RuntimeError(f"checkpoint {path.name}: a rank state was not written: {said}")
            t1 = time.time()
            listed = publish_rank_states(path, written, self.writer.check)
            infos = {
                "environments": {
                    **fits,
                    "world_size": self.ctx.world_size,
                    "iteration": iteration,
                    "rank_states": listed,
                }
            }
            self.work.save(path, self.writer, infos)
            published_s = time.time() - t1
            size = path.stat().st_size if path.is_file() else -1
            log.info(
                "checkpoint %s: %d bytes, ranks' states written in %.3f s, published in %.3f s",
                path.name,
                size,
                t1 - t0,
                published_s,
            )
            self.checkpoints.written(path)
            self.checkpoints.prune(self.policy.keep_checkpoints)
            self.checkpoints.prune_env_states(self.policy.keep_env_states)
            self._record_time(iteration, t0, stop)
            if stop is not None:
                recorded = self._record_stop(stop, iteration, t0)
        elif own is not None:
            raise own
        if self.ctx.is_distributed:
            # The others wait here, not in the next iteration's first collective, so that
            # their watchdogs (paused now) never count a long write as a hang.
            dist.barrier()
        self._last_save = time.monotonic()
        return recorded

    def _record_time(self, iteration: int, t0: float, stop: Stop | None) -> None:
        """When the checkpoint of `iteration` was written and how long it took (a line of
        logs/checkpoints.jsonl, for `mjlab-hpc report`), by the writer."""
        assert self.writer is not None
        line = CheckpointTime(
            iteration=iteration,
            at=round(t0, 3),
            s=round(time.time() - t0, 3),
            stop=stop.reason if stop is not None else None,
        )
        try:
            self.writer.append_line(self.run.checkpoint_times, checkpoint_line(line))
        except Exception as exc:  # a record, not the training
            log.warning("could not record the checkpoint's time: %s", exc)

    def _record_stragglers(self) -> None:
        """The stragglers now, in run.json (for `mjlab-hpc status` and `logs`), by the writer."""
        if self.writer is None or self.stragglers is None:
            return
        now = [s.as_dict() for s in self.stragglers.current]
        try:
            record = on_stragglers(read_record(self.run.path, set_aside=True), now)
            self.writer.write_record(record)
        except Exception as exc:  # a record, not the training
            log.warning("could not record the stragglers in run.json: %s", exc)

    def _record_recovery(self) -> None:
        assert self.writer is not None
        writer = self.writer

        def write() -> None:
            before = read_record(writer.run.path, set_aside=True)
            after = on_recovered(before, self.start)
            if after != before:
                writer.write_record(after)

        try:
            writer.last_records(write)
        except Exception as exc:  # a record, not the training
            log.warning("could not record the recovery in run.json: %s", exc)

    def _record_stop(self, stop: Stop, iteration: int, t0: float) -> StopEntry:
        assert self.writer is not None
        entry = StopEntry(
            signal=stop.signal_name,
            iteration=iteration,
            job_id=self.ctx.job_id,
            restart_count=self.ctx.restart_count,
            signal_at=self.request.signaled_at,
            checkpoint_at=time.time(),
            checkpoint_s=round(time.time() - t0, 3),
            start=os.environ.get(START_ENV) or None,  # the srun step it ended (rundir.ends)
            **_what(stop),
        )
        run = self.writer.run
        writer = self.writer

        def write() -> None:
            writer.append_line(run.restarts, json.dumps(entry.to_json()))
            writer.write_record(on_stop(read_record(run.path, set_aside=True), entry))

        writer.last_records(write)
        return entry

    def _answered(self, recorded: StopEntry | None, stop: Stop, iteration: int) -> None:
        """Say what Slurm said the stop is, and put it into the writer's record of it."""
        if stop.reason == "node-lost":
            log.warning("%s lost: the job is requeued from iteration %d", stop.why, iteration)
        elif stop.why:
            log.warning("%s at iteration %d: %s", stop.reason, iteration, stop.why)
        writer = self.writer
        if writer is None or recorded is None:
            return
        answered = dataclasses.replace(recorded, **_what(stop))

        def write() -> None:
            before = read_record(writer.run.path, set_aside=True)
            writer.write_record(on_stop_answered(before, recorded, answered))

        writer.last_records(write)


def _what(stop: Stop) -> dict[str, Any]:
    """A stop's record fields that Slurm's answer may change."""
    lost = stop.reason == "node-lost"
    return {
        "reason": stop.reason,
        "kind": "requeue" if stop.kind == StopKind.REQUEUE else "stop",
        "why": stop.why or None,
        "nodes": tuple(stop.why.removeprefix("node(s) ").split(", ")) if lost else (),
    }

"""One rank's training from start to end: rsl-rl PPO on one rank of a distributed job.

`train_rank` is the per-rank entry point, whatever launched the process. It joins the process
group, agrees on the run directory, makes rank 0 the writer, decides where training starts
(refusing what cannot be continued before anything changes) and runs PPO to the end or to a
stop. Every rank writes a start record as it starts and an end record as the start ends
(`rundir.ends`); a start without an end record ended abruptly. Its log says the same for
people.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
import warp as wp

from mjlab_hpc.errors import EXIT_INTERRUPTED, environment_problem
from mjlab_hpc.procs import oom_count
from mjlab_hpc.rank.beats import StoreAddress
from mjlab_hpc.rank.context import (
    DETACHED_ENV,
    START_ENV,
    DistContext,
    collective_timeout,
    own_mig,
    process_group,
    rank_device,
    seed_for_rank,
    torch_threads,
)
from mjlab_hpc.rank.failures import failure_kind
from mjlab_hpc.rank.kernel_cache import choose_kernel_cache, use_kernel_cache
from mjlab_hpc.rank.preflight import PreflightFailed, preflight, preflight_drills
from mjlab_hpc.rank.resume import ResumePlan, ResumeRefused, load_plan, plan_resume
from mjlab_hpc.rank.runner import IterationHook
from mjlab_hpc.rank.signals import StopRequest, watch_signals
from mjlab_hpc.rank.stop import (
    LOST_BEFORE_S,
    Interrupted,
    IterationBoundary,
    Stopped,
    Supervision,
    after_stop,
)
from mjlab_hpc.rank.stragglers import StragglerWatch
from mjlab_hpc.rank.watchdog import FaultInjection, Watchdog, parse_faults
from mjlab_hpc.rank.workload import Workload, build_workload
from mjlab_hpc.rundir.checkpoint import CheckpointPolicy, Checkpoints
from mjlab_hpc.rundir.durable import open_append
from mjlab_hpc.rundir.ends import Exit, FailureKind, RankExit, RankStart, record_end, record_start
from mjlab_hpc.rundir.layout import RunDir, realise_target, record_latest_run
from mjlab_hpc.rundir.progress import (
    IterationStats,
    ProgressDisplay,
    progress_line,
    progress_summary,
    progress_tail,
)
from mjlab_hpc.rundir.record import (
    Failure,
    RunSummary,
    Skipped,
    Start,
    now_iso,
    on_end,
    on_node_failed,
    on_preempted,
    on_start,
    read_record,
)
from mjlab_hpc.rundir.snapshot import code_record, imported_from
from mjlab_hpc.rundir.writer import RunWriter, busy_problem
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.spec import ResolvedSpec
from mjlab_hpc.tasks.memory import init_warp

__all__ = [
    "RankResult",
    "agree_run_dir",
    "run_job",
    "train_rank",
]

log = logging.getLogger("mjlab_hpc")


@dataclass(frozen=True)
class RankResult:
    """What one rank returns to its launcher."""

    rank: int
    world_size: int
    run_dir: str
    iterations: int
    device: str
    param_digest: str
    first_obs_digest: str


def agree_run_dir(resolved: ResolvedSpec, ctx: DistContext) -> ResolvedSpec:
    """Return `resolved` aimed at the one run directory of this run, the same on every rank.

    Rank 0 realises the run target validation decided (`realise_target`: a new run's
    directory is made there, once per job) and sends it to the others, which take it as
    theirs. Ranks of a launcher of ours receive the realised target already; ranks that
    torchrun or srun started alone decided theirs alike, from the same arguments.
    """
    target = [realise_target(resolved).target if ctx.is_main else None]
    if ctx.is_distributed:
        dist.broadcast_object_list(target, src=0)
    return resolved.aimed(target[0])


def _refuse_if_busy(run: RunDir, ctx: DistContext) -> None:
    """Raise ResumeRefused on every rank when another live training writes the run.

    That run is not ours to wait for, and nothing of this start is written there: not even
    its rank logs, whose refusal would be read as the other training's end.
    """
    busy = [busy_problem(run) if ctx.is_main else None]
    if ctx.is_distributed:
        dist.broadcast_object_list(busy, src=0)
    if busy[0] is not None:
        raise ResumeRefused("--run-dir", busy[0])


def _gather(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


class _RankLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The rank log's handler, which drops a record it cannot write (a full disk).

    Logging would print its "--- Logging error ---" traceback instead; the failure itself is
    reported by the training.
    """

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _thread_excepthook(run: RunDir) -> Callable[[threading.ExceptHookArgs], None]:
    """Log a library thread's death of a full disk in one line, not a console traceback.

    Tensorboard's event writer is such a thread; the training loop meets the same error.
    """
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        problem = environment_problem(args.exc_value, run.path) if args.exc_value else None
        if problem is None:
            default(args)
        else:
            log.warning("thread %s: %s", args.thread.name if args.thread else "?", problem)

    return hook


@contextlib.contextmanager
def _rank_logging(run: RunDir, rank: int) -> Iterator[TextIO]:
    run.logs.mkdir(parents=True, exist_ok=True)
    saved_hook = threading.excepthook
    with open_append(run.rank_log(rank)) as stream:  # never through a planted link
        handler = _RankLogHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        threading.excepthook = _thread_excepthook(run)
        try:
            yield stream
        finally:
            threading.excepthook = saved_hook
            log.removeHandler(handler)


def _lost_of(client: SlurmClient, nodes: str, ended: str) -> list[str]:
    """Return the nodes of a NODE_FAIL's node list (sacct: the allocation) that were lost.

    Those Slurm set DOWN or FAIL about when the attempt ended (an admin's `state=down` is
    over by the time the job starts again: accounting keeps it), else the whole list.
    """
    try:
        since = dt.datetime.fromisoformat(ended).timestamp() - LOST_BEFORE_S  # sacct: local
    except ValueError:
        since = None
    return client.lost_nodes(nodes, since=since) or client.hostnames(nodes) or [nodes]


def _begin(
    writer: RunWriter,
    checkpoints: Checkpoints,
    work: Workload,
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    plan: ResumePlan,
    start: int,
    environments: str,
) -> None:
    """Write the writer's records of a (re)start, once the resume is known to work.

    Damaged checkpoints are set aside and progress.jsonl is cut back to the resumed iteration
    (tools read one line per iteration); then run.json, `.latest_run`, and the params on a
    fresh start.
    """
    run = writer.run
    if plan.damaged:
        for d in plan.damaged:
            log.warning("skipped damaged checkpoint %s: %s", d.name, d.why)
            if ctx.mode == "single":  # other launchers show it from run.json
                print(f"warning: skipped damaged checkpoint {d.name}: {d.why}", file=sys.stderr)
        checkpoints.set_aside(list(plan.damaged), before=writer.check)
    written = writer.cut_progress(start)  # streamed: a long run's file is never held whole
    before = read_record(run.path, set_aside=True)
    if ctx.mode == "slurm" and ctx.job_id and ctx.restart_count >= 1:
        # The previous run of a requeued job ended because a node failed (sacct: NODE_FAIL).
        client = SlurmClient()
        runs = client.attempts(ctx.job_id) or []
        if len(runs) >= 2 and runs[-2][0] == "NODE_FAIL":
            last = start if written is None else written
            _, nodes, ended = runs[-2]
            before = on_node_failed(
                before,
                job_id=ctx.job_id,
                restart_count=ctx.restart_count,
                iteration=last,
                nodes=_lost_of(client, nodes, ended),
                ended=ended,
            )
        elif len(runs) >= 2 and runs[-2][0] == "PREEMPTED":  # a requeue was a preemption
            before = on_preempted(before, ctx.job_id, ctx.restart_count)
    # What ran: the submission's code record, and where this rank imported us from.
    # `imported_from`: the packages the snapshot holds, as this rank imported them (a path
    # inside the copy: the submitted code ran).
    code = code_record(run.path) or {}
    started = on_start(
        before,
        Start(
            job_id=ctx.job_id,
            restart_count=ctx.restart_count,
            resumed_from_iteration=start,
            checkpoint=Path(plan.checkpoint).name if plan.checkpoint else None,
            environments=environments,
            skipped_checkpoints=tuple(Skipped(d.name, d.why) for d in plan.damaged),
        ),
        spec=resolved.train,
        effective=resolved.effective(),
        launch_mode=ctx.mode,
        world_size=ctx.world_size,
        num_nodes=ctx.num_nodes,
        device=device,
        code={
            **code,
            "ran_from": str(Path(__file__).parents[1]),
            "imported_from": imported_from(code),
        },
        code_dir=Path.cwd(),
    )
    writer.write_record(started)
    record_latest_run(run.path)
    if start == 0:
        work.dump_params(writer)


def train_rank(
    resolved: ResolvedSpec, master_port: int | None = None, early_signals: Sequence[int] = ()
) -> RankResult:
    """Train on this rank until the spec's iterations are done; the per-rank entry point.

    `early_signals` are stop signals that arrived before this was called (the caller records
    them while the training code loads).

    Raises:
        Stopped: after a stop checkpoint (the launcher decides whether to requeue).
        ResumeRefused: the run directory cannot be continued (nothing of it changed).
        KeyboardInterrupt: a second Ctrl-C.
    """
    spec = resolved.train
    ctx = DistContext.from_env(master_port=master_port)
    mig = own_mig(os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.local_rank, ctx.local_world_size)
    if mig is not None:  # before CUDA starts (Warp's init starts it)
        os.environ["CUDA_VISIBLE_DEVICES"] = mig
    init_warp()
    device = rank_device(spec.device_choice, ctx)
    kernels = choose_kernel_cache(spec.kernel_cache, device)
    use_kernel_cache(kernels)
    torch.set_num_threads(torch_threads(spec.torch_threads, ctx, os.environ))
    if device.startswith("cuda"):
        # Offscreen rendering (videos) on this rank's GPU (its CUDA ordinal, not its local
        # rank: a task may see only its own GPU); mjlab's recorder asks EGL (tasks/mjlab).
        os.environ["MUJOCO_EGL_DEVICE_ID"] = device.partition(":")[2] or "0"
    seed = seed_for_rank(spec.seed, ctx)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)

    # Stop requests are recorded from the start, so one that arrives while kernels compile or
    # the process group forms is acted on at the first iteration boundary.
    request = StopRequest(ctx.mode, spec.preempt_signal)
    watch_parent = ctx.mode in ("submitit-local", "torchrun")
    joining = time.time()
    with (
        watch_signals(request, detached=DETACHED_ENV in os.environ),
        Supervision(request, watch_parent=watch_parent),
        process_group(ctx, device, spec.dist_timeout_s),
    ):
        joined = time.time()
        for signum in list(early_signals):  # our handlers are in place: none is lost now
            request.early(signum)
        resolved = agree_run_dir(resolved, ctx)
        run = RunDir(Path(str(resolved.target.path)))
        _refuse_if_busy(run, ctx)
        with _rank_logging(run, ctx.rank) as rank_log:
            return _train(
                resolved,
                ctx=ctx,
                device=device,
                seed=seed,
                run=run,
                rank_log=rank_log,
                request=request,
                rendezvous=(joining, joined),
                kernel_cache=kernels.why,
            )


def _train(
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    seed: int,
    run: RunDir,
    rank_log: TextIO,
    request: StopRequest,
    rendezvous: tuple[float, float],
    kernel_cache: str = "",
) -> RankResult:
    """Train in the agreed run directory and record how this start ends.

    Three steps: `_start` (records this start, resumes), `_loop` (the iterations), `_finish`
    (the writer's records). However it ends, `_Ending` records how, in one place.
    `rendezvous` is when this rank called into the process group and when it had joined;
    `kernel_cache` where Warp keeps its kernels (said in the log).
    """
    ending = _Ending(run, ctx, resolved, device)
    try:
        started = _start(
            resolved, ctx, device, seed, run, rank_log, rendezvous, ending, kernel_cache
        )
        _loop(started, resolved, ctx, device, run, rank_log, request, ending)
        return _finish(started, ctx, device, run, ending)
    except BaseException as exc:
        raised = ending.failed(exc)
        if raised is exc:
            raise
        raise raised from None
    finally:
        if ending.writer is not None:
            ending.writer.release()


@dataclass(frozen=True)
class _Started:
    """What a rank's start built, for its loop and its finish."""

    work: Workload
    """The environments and the runner."""
    start: int
    """The iteration it resumed from (0: a fresh start)."""
    first_obs: str
    """The digest of its first observations."""
    checkpoints: Checkpoints | None
    """The writer's checkpoints (None on the other ranks)."""
    injections: tuple[FaultInjection, ...]
    """The faults MJLAB_HPC_FAULT injects."""
    node: str
    """The node it runs on."""


class _Ending:
    """How this start of a rank ends, recorded in one place.

    The rank's end record (what decisions read), its log's exit line (for people), and the
    writer's run.json for a failure or an interruption.
    """

    def __init__(self, run: RunDir, ctx: DistContext, resolved: ResolvedSpec, device: str):
        self.run = run
        self.ctx = ctx
        self.resolved = resolved
        self.device = device
        self.record: RankStart | None = None
        """This start's record, once written."""
        self.writer: RunWriter | None = None
        """Rank 0's writer, once acquired."""
        self.begun = False
        """The writer recorded this start in run.json."""

    def started(self, node: str) -> None:
        """Write this rank's start record."""
        oom = oom_count()  # (a reader under the same kernel tells an OOM kill from a SIGKILL)
        self.record = record_start(
            self.run,
            RankStart(
                run=self.run.path.name,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                node=node,
                pid=os.getpid(),
                device=self.device,
                at=time.time(),
                start_id=os.environ.get(START_ENV) or None,
                oom=oom,
            ),
        )

    def ended(
        self,
        how: Exit,
        detail: str,
        exc: BaseException | None = None,
        kind: FailureKind | None = None,
    ) -> None:
        """Write this start's end record (never raising: what ended it matters more).

        `kind`: what ended a failed start, decided here from the exception's type (None:
        from `exc`'s, for a failure).
        """
        if self.record is None:
            return
        if kind is None and exc is not None and how in ("failed", "out-of-memory"):
            kind = failure_kind(exc, self.run.path)
        end = RankExit(
            how=how,
            detail=detail,
            at=time.time(),
            error_type=type(exc).__name__ if exc is not None else None,
            message=str(exc)[:2000] if exc is not None else None,
            kind=kind,
        )
        try:
            record_end(self.run, self.record, end)
        except Exception as err:  # a full disk: the log may have room
            log.warning("the end record was not written: %s", err)

    def hung(self, detail: str) -> None:
        """The hang watchdog fired (`detail`): record it and give up the writer's lease."""
        self.ended("hung", detail)
        if self.writer is not None:
            self.writer.release()

    def failed(self, exc: BaseException) -> BaseException:
        """Record how `exc` ended this start; return what to raise."""
        run = self.run
        if isinstance(exc, ResumeRefused):
            self.ended("refused", f"refused: {exc}", exc)
            log.error("exit: refused: %s", exc)
        elif isinstance(exc, Stopped):
            self.ended("stopped", f"{exc}; checkpoint saved in {run.path}")
            log.info("exit: %s; checkpoint saved in %s", exc, run.path)
            exc.run_dir = str(run.path)
        elif isinstance(exc, PreflightFailed):
            # The failing node's ranks record the check and its figures: the healer leaves
            # that node out. The others' ends are consequences.
            here = exc.here
            detail = "; ".join(f"{f.check} check: {f.figures}" for f in here) or str(exc)
            self.ended(
                "preflight" if here else "failed", detail, exc, "preflight" if here else "peer-lost"
            )
            if self.writer is not None:  # the run's record names the first rank at fault
                first = exc.report.failed[0]
                failure = Failure(
                    kind="preflight",
                    error=str(exc),
                    rank=first.ranks[0],
                    host=first.node,
                    at=now_iso(),
                )
                _record_end(self.writer, "failed", failure=failure, resolved=self.resolved)
            log.error("exit: %s", exc)
        elif isinstance(exc, KeyboardInterrupt):
            detail = (
                "interrupted at once (a second Ctrl-C): nothing saved since the last checkpoint"
            )
            self.ended("interrupted", detail)
            log.error("exit: %s", detail)
            if self.writer is not None and self.begun:
                _record_end(self.writer, "interrupted")
            return Interrupted(str(run.path))
        else:
            self._failure(exc)
        return exc

    def _failure(self, exc: BaseException) -> None:
        problem = environment_problem(exc, self.run.path)
        kind = failure_kind(exc, self.run.path)
        error = problem or f"{type(exc).__name__}: {exc}".strip()
        if kind == "out-of-memory":
            first = error.splitlines()[0]
            error = f"{self.resolved.num_envs} envs per rank on {self.device}: {first}"
        if self.writer is not None:  # before the first iteration too: the run has a record
            failure = Failure(
                rank=self.ctx.rank,
                host=self.record.node if self.record else socket.gethostname(),
                kind=kind,
                error=error[:2000],
                at=now_iso(),
            )
            # First: on a full disk this gives up the writer's reserve, and the records
            # below then have room too.
            _record_end(self.writer, "failed", failure=failure, resolved=self.resolved)
        how: Exit = "out-of-memory" if kind == "out-of-memory" else "failed"
        self.ended(how, (error.splitlines() or [kind])[0], exc, kind)
        if problem is not None:  # the disk, not the code: one line, no traceback
            log.error("exit: failed (environment)\n%s", problem)
        else:
            log.exception("exit: failed (%s)", kind)


def _start(
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    seed: int,
    run: RunDir,
    rank_log: TextIO,
    rendezvous: tuple[float, float],
    ending: _Ending,
    kernel_cache: str = "",
) -> _Started:
    """Record this start, build the workload and resume where the run is."""
    spec = resolved.train
    injections = parse_faults()
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    ending.started(node)
    _log_start(resolved, ctx, device, seed, node, rendezvous)
    if kernel_cache:
        log.info("kernel cache: %s", kernel_cache)
    if ctx.is_main:  # (before the preflight: its failure is the run's record too)
        ending.writer = RunWriter.acquire(run, ctx.rank)
    if spec.preflight:  # before anything is built: a bad node costs seconds
        reached = progress_summary(run).iteration or 0
        drills = preflight_drills(injections, run, ctx.rank, reached)
        log.info("preflight passed: %s", preflight(ctx, device, node, drills).summary())
    checkpoints = Checkpoints(run.path, resolved.task) if ctx.is_main else None
    plan = plan_resume(run, resolved, ctx, checkpoints)
    work = build_workload(resolved, ctx, device, seed=seed, run=run, quiet=rank_log)
    first_obs = work.first_obs_digest()
    resized = read_record(run.path).resized_by_healer(ctx.world_size)
    start, environments = load_plan(
        plan, work, device, ctx, fresh_envs=spec.fresh_envs, resized=resized
    )
    if ending.writer is not None and checkpoints is not None:
        _begin(
            writer=ending.writer,
            checkpoints=checkpoints,
            work=work,
            resolved=resolved,
            ctx=ctx,
            device=device,
            plan=plan,
            start=start,
            environments=environments,
        )
    ending.begun = True
    return _Started(work, start, first_obs, checkpoints, injections, node)


def _log_start(
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    seed: int,
    node: str,
    rendezvous: tuple[float, float],
) -> None:
    """Say in the rank's log where and how it starts (for people: decisions read records)."""
    log.info(
        "%s on %s, host %s, pid %d, CPUs %s, seed %d, %d envs, CUDA_VISIBLE_DEVICES=%s%s",
        ctx.describe(),
        device,
        node,
        os.getpid(),
        ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        seed,
        resolved.num_envs,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        f", start {os.environ[START_ENV]}" if os.environ.get(START_ENV) else "",
    )
    if ctx.is_distributed:
        # Wall-clock times: from the last rank's call to everyone joined is the rendezvous.
        log.info(
            "process group of %d ranks: called at %.3f, joined in %.3f s",
            ctx.world_size,
            rendezvous[0],
            rendezvous[1] - rendezvous[0],
        )
    if device == "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") and resolved.train.gpu_ids:
        msg = (
            f"rank {ctx.rank}: GPUs {os.environ['CUDA_VISIBLE_DEVICES']} were allocated "
            "but CUDA is not usable here (no driver, or a CPU build of torch): training on CPU"
        )
        log.warning(msg)
        print(f"warning: {msg}", file=sys.stderr, flush=True)


def _loop(
    started: _Started,
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    run: RunDir,
    rank_log: TextIO,
    request: StopRequest,
    ending: _Ending,
) -> None:
    """Run the iterations to the end (or to a stop: Stopped), watched for hangs."""
    spec, writer, total = resolved.train, ending.writer, resolved.max_iterations
    display = ProgressDisplay(total, started.start, enabled=ctx.is_main)
    hooks: list[IterationHook] = [
        lambda r, s: log.info("iteration %d/%d %.0f steps/s", s.iteration, s.total, s.steps_per_s),
        lambda r, s: display.update(s),
    ]
    if writer is not None:
        hooks.append(_progress_writer(writer))
    hosts = _gather(started.node, ctx)
    watchdog = Watchdog(
        run,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout_s=spec.hang_timeout_s,
        rank_log=rank_log,
        host=started.node,
        on_fire=ending.hung,
        hosts=hosts,
        store=StoreAddress.of(ctx) if ctx.is_distributed else None,
        on_watch=lambda on: collective_timeout(None if on else spec.dist_timeout_s),
    )
    hooks.append(
        IterationBoundary(
            work=started.work,
            run=run,
            ctx=ctx,
            device=device,
            policy=CheckpointPolicy.of(spec),
            total=total,
            start=started.start,
            request=request,
            writer=writer,
            checkpoints=started.checkpoints,
            restarts=read_record(run.path).requeues_so_far(),
            watchdog=watchdog,
            injections=started.injections,
            stragglers=StragglerWatch(hosts) if ctx.is_distributed else None,
        )
    )
    try:
        with wp.ScopedDevice(device), watchdog:
            started.work.runner.learn_until(
                total, hooks, init_at_random_ep_len=started.work.random_ep_len
            )
            watchdog.disarm()
    finally:
        display.close()


def _finish(
    started: _Started, ctx: DistContext, device: str, run: RunDir, ending: _Ending
) -> RankResult:
    """Compare the ranks' parameters, write the writer's last records and this rank's end."""
    runner = started.work.runner
    digest = runner.param_digest()
    digests = _gather(digest, ctx)
    obs_digests = _gather(started.first_obs, ctx)
    if ending.writer is not None:
        _write_summary(
            ending.writer,
            runner,
            start=started.start,
            ctx=ctx,
            device=device,
            digests=digests,
            obs_digests=obs_digests,
        )
    iterations = runner.current_learning_iteration
    ending.ended("completed", f"completed {iterations} iterations")
    log.info("exit: completed %d iterations", iterations)
    return RankResult(
        rank=ctx.rank,
        world_size=ctx.world_size,
        run_dir=str(run.path),
        iterations=iterations,
        device=device,
        param_digest=digest,
        first_obs_digest=started.first_obs,
    )


def _record_end(
    writer: RunWriter,
    state: str,
    failure: Failure | None = None,
    resolved: ResolvedSpec | None = None,
) -> None:
    """Record in run.json that this start ended (`state`), even on a full disk.

    `resolved` is what the run was to train: kept when it failed before its start record.
    """

    def write() -> None:
        before = read_record(writer.run.path, set_aside=True)
        tail = progress_tail(writer.run, 1)
        after = on_end(
            before,
            tail[-1].iteration if tail else 0,
            state,
            failure=failure,
            spec=resolved.train if resolved is not None else None,
            effective=resolved.effective() if resolved is not None else None,
        )
        writer.write_record(after)

    with contextlib.suppress(Exception):  # the original error matters more
        writer.last_records(write)


def _write_summary(
    writer: RunWriter,
    runner: Any,
    start: int,
    ctx: DistContext,
    device: str,
    digests: list[Any],
    obs_digests: list[Any],
) -> None:
    """Write summary.json and mark the run completed (`digests`: every rank's, to compare)."""
    run = writer.run
    record = read_record(run.path, set_aside=True)
    restarts, reasons = record.restarts_told()
    summary = RunSummary(
        iterations=runner.current_learning_iteration,
        resumed_from=start,
        world_size=ctx.world_size,
        device=device,
        launch_mode=ctx.mode,
        job_id=ctx.job_id,
        restart_count=restarts,
        restart_reasons=reasons,
        param_digest_per_rank=tuple(digests),
        ranks_in_sync=len(set(digests)) == 1,
        first_obs_digest_per_rank=tuple(obs_digests),
    )
    writer.write_json(run.summary, summary.to_json())
    if len(set(digests)) != 1:
        log.error("ranks diverged: parameter digests %s", digests)
    ended = on_end(record, runner.current_learning_iteration)
    writer.write_record(ended)


def _progress_writer(writer: RunWriter) -> IterationHook:
    def hook(runner: Any, s: IterationStats) -> None:
        writer.append_line(writer.run.progress, progress_line(s.as_line()))

    return hook


def run_job(
    spec: ResolvedSpec, master_port: int | None, early_signals: Sequence[int]
) -> RankResult:
    """Run `train_rank` for a submitted job's task (`mjlab_hpc.rank.RankJob`).

    On a stop it exits at once as the stop asks (a requeue, or a stop for good): the
    checkpoint is on disk, and no result file is written (the job is not done).
    """
    try:
        return train_rank(spec, master_port=master_port, early_signals=early_signals)
    except Stopped as stopped:
        code = after_stop(stopped, spec.train.max_restarts)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once
        code = EXIT_INTERRUPTED
    # A normal interpreter exit spends seconds collecting garbage while the grace time runs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

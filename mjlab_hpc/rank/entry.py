"""One rank's training: rsl-rl PPO on one rank of a (possibly) distributed job.

`train_rank(spec)` is the one per-rank entry point, whatever launched the process (a plain
`mjlab-train`, our local launcher, torchrun, srun, submitit). It reads the distributed
context, joins the process group, agrees on the run directory, makes one process the writer,
builds the rank's workload (environments and runner) on its device, resumes from the newest
valid checkpoint, and runs PPO to the end or to a preemption stop. rsl-rl's own parameter
broadcast and gradient all-reduce are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
import warp as wp

from mjlab_hpc.rank.context import (
    DistContext,
    cuda_device_count,
    process_group,
    resolve_device,
    seed_for_rank,
    torch_threads,
)
from mjlab_hpc.rank.preemption import Stopped, StopRequest, agree, stop_reason, watch_signals
from mjlab_hpc.rank.progress import IterationStats, ProgressDisplay
from mjlab_hpc.rank.runner import IterationHook
from mjlab_hpc.rank.workload import Workload, build_workload, rank_state
from mjlab_hpc.rundir import record
from mjlab_hpc.rundir.checkpoint import latest_valid, prune
from mjlab_hpc.rundir.layout import RunDir, create_run_dir, latest_run, record_latest_run
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.spec import ResolvedSpec, TrainSpec

__all__ = ["RankResult", "agree_run_dir", "rank_device", "restore", "train_rank"]

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


def rank_device(spec: TrainSpec, ctx: DistContext) -> str:
    """The device this rank trains on."""
    choice = "cpu" if spec.gpu_ids is None or spec.num_procs > 1 else spec.device
    return resolve_device(
        choice,
        ctx.local_rank,
        ctx.local_world_size,
        cuda_count=0 if choice == "cpu" else cuda_device_count(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def agree_run_dir(spec: TrainSpec, ctx: DistContext, experiment: str) -> Path:
    """The one run directory of this run: given by the launcher (or --resume), else made by
    rank 0 and sent to the others through the process group."""
    if spec.run_dir:
        path = Path(spec.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()
    made = [""]
    if ctx.is_main:
        found = latest_run(spec.log_root, experiment) if spec.resume else None
        if spec.resume and found is None:
            log.warning("--resume: no earlier run of %s under %s", experiment, spec.log_root)
        made = [str(found or create_run_dir(spec.log_root, experiment, spec.run_name))]
    if ctx.is_distributed:
        dist.broadcast_object_list(made, src=0)
    return Path(made[0])


def _gather(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def _rank_logging(run: RunDir, rank: int) -> tuple[logging.Handler, TextIO]:
    run.logs.mkdir(parents=True, exist_ok=True)
    stream = open(run.rank_log(rank), "a", buffering=1)  # noqa: SIM115 (closed by train_rank)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler, stream


@dataclass
class _Boundary:
    """The per-iteration boundary every rank runs: agree on a stop request, checkpoint."""

    work: Workload
    ctx: DistContext
    device: str
    spec: TrainSpec
    total: int
    request: StopRequest
    writer: RunWriter | None

    def __call__(self, runner: Any, s: IterationStats) -> None:
        signum = agree(self.request, self.ctx.is_distributed, self.device)
        periodic = s.iteration % self.spec.save_interval == 0 or s.iteration == self.total
        if signum or periodic:
            t0 = time.time()
            states = (
                _gather_to_main(rank_state(self.work.env, self.device), self.ctx)
                if self.work.exact_resume
                else None
            )
            if self.writer is not None:
                self.work.save(self.writer.run.checkpoint(s.iteration), self.writer, states)
                prune(self.writer.run.path, self.spec.keep_checkpoints)
                if signum:
                    self._record_stop(signum, s.iteration, t0)
        if signum:
            raise Stopped(s.iteration, stop_reason(signum, self.spec.preempt_signal), signum)

    def _record_stop(self, signum: int, iteration: int, t0: float) -> None:
        assert self.writer is not None
        stop = {
            "reason": stop_reason(signum, self.spec.preempt_signal),
            "signal": signal.Signals(signum).name,
            "iteration": iteration,
            "job_id": self.ctx.job_id,
            "restart_count": self.ctx.restart_count,
            "signal_at": self.request.signaled_at,
            "checkpoint_at": time.time(),
            "checkpoint_s": round(time.time() - t0, 3),
        }
        run = self.writer.run
        self.writer.append_line(run.restarts, json.dumps(stop))
        self.writer.write_json(run.record, record.on_stop(record.read_record(run.path), stop))


def restore(work: Workload, run: RunDir, device: str) -> int:
    """Continue from the run's newest valid checkpoint; the iterations it had done (0: none)."""
    found = latest_valid(run.path, map_location=device)
    if found is None:
        return 0
    path, ckpt = found
    work.load(path, ckpt)
    log.info("resumed from %s at iteration %d", path.name, work.runner.current_learning_iteration)
    return int(work.runner.current_learning_iteration)


def train_rank(resolved: ResolvedSpec, master_port: int | None = None) -> RankResult:
    """Train on this rank until the spec's iterations are done; the per-rank entry point.

    Raises `Stopped` after a stop checkpoint when a preemption or time-limit signal arrived;
    the launcher decides whether to requeue.
    """
    wp.config.quiet = True
    wp.config.log_level = wp.LOG_WARNING  # kernel-load lines go nowhere useful on N ranks
    spec = resolved.train
    spec.validate()
    ctx = DistContext.from_env(master_port=master_port)
    device = rank_device(spec, ctx)
    torch.set_num_threads(torch_threads(spec.torch_threads, ctx, os.environ))
    if device.startswith("cuda"):
        # Offscreen rendering (videos) on this rank's GPU, as mjlab does.
        os.environ["MUJOCO_EGL_DEVICE_ID"] = str(ctx.local_rank)
    seed = seed_for_rank(spec.seed, ctx)
    num_envs = resolved.num_envs
    total = resolved.max_iterations
    experiment = resolved.experiment_name
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)

    # Signals are recorded from the start, so one that arrives while kernels compile or the
    # process group forms is acted on at the first iteration boundary.
    with (
        watch_signals((spec.preempt_signal, "TERM")) as request,
        process_group(ctx, device, spec.dist_timeout_s),
    ):
        run = RunDir(agree_run_dir(spec, ctx, experiment))
        handler, rank_log = _rank_logging(run, ctx.rank)
        writer: RunWriter | None = None
        try:
            node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
            log.info(
                "%s on %s, host %s, seed %d, %d envs, CUDA_VISIBLE_DEVICES=%s",
                ctx.describe(),
                device,
                node,
                seed,
                num_envs,
                os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
            )
            if device == "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") and spec.gpu_ids:
                msg = (
                    f"rank {ctx.rank}: GPUs {os.environ['CUDA_VISIBLE_DEVICES']} were allocated "
                    "but CUDA is not usable here (no driver, or a CPU build of torch): "
                    "training on CPU"
                )
                log.warning(msg)
                print(f"warning: {msg}", file=sys.stderr, flush=True)
            if ctx.is_main:
                writer = RunWriter.acquire(run, ctx.rank)
                record_latest_run(run.path)
            work = build_workload(resolved, ctx, device, seed, run, rank_log)
            runner = work.runner
            first_obs = work.first_obs_digest()
            start = restore(work, run, device)
            if writer is not None:
                started = record.on_start(
                    record.read_record(run.path),
                    spec=spec.to_dict(),
                    effective=resolved.effective(),
                    job_id=ctx.job_id,
                    restart_count=ctx.restart_count,
                    launch_mode=ctx.mode,
                    world_size=ctx.world_size,
                    num_nodes=ctx.num_nodes,
                    device=device,
                    resumed_from=start,
                    code_dir=Path.cwd(),
                )
                writer.write_json(run.record, started)
            if writer is not None and start == 0:
                work.dump_params(writer)
            display = ProgressDisplay(total, start, enabled=ctx.is_main)
            hooks: list[IterationHook] = [
                lambda r, s: log.info(
                    "iteration %d/%d %.0f steps/s", s.iteration, s.total, s.steps_per_s
                ),
                lambda r, s: display.update(s),
            ]
            if writer is not None:
                hooks.append(_progress_writer(writer))
            hooks.append(_Boundary(work, ctx, device, spec, total, request, writer))
            try:
                with wp.ScopedDevice(device):
                    runner.learn_until(total, hooks, init_at_random_ep_len=work.random_ep_len)
            finally:
                display.close()
            digest = runner.param_digest()
            digests = _gather(digest, ctx)
            obs_digests = _gather(first_obs, ctx)
            if writer is not None:
                writer.write_json(
                    run.summary,
                    {
                        "iterations": runner.current_learning_iteration,
                        "resumed_from": start,
                        "world_size": ctx.world_size,
                        "device": device,
                        "launch_mode": ctx.mode,
                        "job_id": ctx.job_id,
                        "restart_count": ctx.restart_count,
                        "param_digest_per_rank": digests,
                        "ranks_in_sync": len(set(digests)) == 1,
                        "first_obs_digest_per_rank": obs_digests,
                    },
                )
                if len(set(digests)) != 1:
                    log.error("ranks diverged: parameter digests %s", digests)
                ended = record.on_end(
                    record.read_record(run.path), runner.current_learning_iteration
                )
                writer.write_json(run.record, ended)
            log.info("done: %d iterations", runner.current_learning_iteration)
            return RankResult(
                rank=ctx.rank,
                world_size=ctx.world_size,
                run_dir=str(run.path),
                iterations=runner.current_learning_iteration,
                device=device,
                param_digest=digest,
                first_obs_digest=first_obs,
            )
        except Stopped as stop:
            stop.ctx = ctx
            log.info("%s; checkpoint saved in %s", stop, run.path)
            raise
        except BaseException:
            log.exception("rank %d failed", ctx.rank)
            if writer is not None:
                with contextlib.suppress(Exception):  # the original error matters more
                    before = record.read_record(run.path)
                    failed = record.on_end(before, before.get("iterations", 0), "failed")
                    writer.write_json(run.record, failed)
            raise
        finally:
            if writer is not None:
                writer.release()
            log.removeHandler(handler)
            rank_log.close()


def _progress_writer(writer: RunWriter) -> IterationHook:
    def hook(runner: Any, s: IterationStats) -> None:
        writer.append_line(writer.run.progress, json.dumps(s.as_record()))

    return hook

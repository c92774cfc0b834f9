"""The trainer: rsl-rl PPO on one rank of a (possibly) distributed job.

`train_rank(spec)` is the one per-rank entry point, whatever launched the process (a plain
`mjlab-train`, our local launcher, torchrun, srun, submitit). It reads the distributed
context, joins the process group, builds the environment on the rank's device and runs an
rsl-rl OnPolicyRunner whose process-group set-up comes from the context instead of rsl-rl's
NCCL-only code. rsl-rl's own parameter broadcast and gradient all-reduce are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import yaml
from rsl_rl.runners import OnPolicyRunner

from mjlab_hpc import runrecord
from mjlab_hpc.checkpoint import latest_valid, prune, save_checkpoint
from mjlab_hpc.distributed import (
    DistContext,
    cuda_device_count,
    process_group,
    resolve_device,
    seed_for_rank,
    torch_threads,
)
from mjlab_hpc.normalization import sync_normalizers
from mjlab_hpc.preemption import Stopped, StopRequest, agree, stop_reason, watch_signals
from mjlab_hpc.progress import IterationStats, ProgressDisplay
from mjlab_hpc.rundir import (
    RunDir,
    RunWriter,
    create_run_dir,
    latest_run,
    record_latest_run,
)
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.tasks import agent_config, resolve_task

log = logging.getLogger("mjlab_hpc")

IterationHook = Callable[["DistributedRunner", IterationStats], None]


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


class CollectiveClock:
    """Accumulates the time spent inside torch.distributed collectives.

    rsl-rl calls torch.distributed's functions directly, so the only place to time them without
    copying its algorithm is the module attribute; `timing()` wraps them for the duration of a
    block and always restores the originals.
    """

    NAMES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object", "barrier")

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in self.NAMES}

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            return timed

        try:
            for name, fn in originals.items():
                setattr(dist, name, wrap(fn))
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


class DistributedRunner(OnPolicyRunner):
    """rsl-rl's OnPolicyRunner with the process group taken from a DistContext.

    The process group itself is created by `process_group()` (gloo on CPU, NCCL on CUDA);
    this class only tells rsl-rl who it is. It also runs its own learn loop, the same as
    rsl-rl's, with a hook after every iteration (progress, checkpoints, stop requests) and
    iteration numbers that count completed iterations, so a resume continues exactly.
    """

    def __init__(
        self,
        env: Any,
        train_cfg: dict[str, Any],
        ctx: DistContext,
        log_dir: str | None,
        device: str,
        quiet: TextIO,
    ) -> None:
        self.ctx = ctx
        self.quiet = quiet
        with contextlib.redirect_stdout(quiet):
            super().__init__(env, train_cfg, log_dir=log_dir, device=device)
        if self.is_distributed:
            sync_normalizers(self.alg._raw_actor, self.alg._raw_critic)

    def _configure_multi_gpu(self) -> None:
        self.gpu_world_size = self.ctx.world_size
        self.gpu_global_rank = self.ctx.rank
        self.gpu_local_rank = self.ctx.local_rank
        self.is_distributed = self.ctx.is_distributed
        self.cfg["multi_gpu"] = (
            {
                "global_rank": self.ctx.rank,
                "local_rank": self.ctx.local_rank,
                "world_size": self.ctx.world_size,
            }
            if self.is_distributed
            else None
        )

    @property
    def is_writer(self) -> bool:
        return self.logger.writer is not None

    def learn_until(self, total_iterations: int, hooks: list[IterationHook]) -> None:
        """Run PPO iterations until `total_iterations` are completed in all."""
        self.alg.train_mode()
        if self.is_distributed:
            with contextlib.redirect_stdout(self.quiet):
                self.alg.broadcast_parameters()
        with contextlib.redirect_stdout(self.quiet):
            self.logger.init_logging_writer()
        start_it = self.current_learning_iteration
        self._continue_tensorboard(start_it)
        clock = CollectiveClock()
        t_start = time.perf_counter()
        try:
            with clock.timing() if self.is_distributed else contextlib.nullcontext():
                self._iterate(start_it, total_iterations, hooks, clock, t_start)
        finally:
            self._close_tensorboard()

    def _continue_tensorboard(self, start_it: int) -> None:
        # After a resume, drop events a killed predecessor logged past its last checkpoint, so
        # every curve continues at the right step without duplicates.
        writer = self.logger.writer
        if start_it > 0 and writer is not None and hasattr(writer, "add_scalar"):
            from torch.utils.tensorboard import SummaryWriter

            if isinstance(writer, SummaryWriter):
                writer.close()
                self.logger.writer = SummaryWriter(
                    log_dir=self.logger.log_dir, flush_secs=10, purge_step=start_it
                )

    def _close_tensorboard(self) -> None:
        writer = self.logger.writer
        if writer is None:
            return
        self.logger.stop_logging_writer()
        if hasattr(writer, "close"):
            writer.close()

    def _iterate(
        self,
        start_it: int,
        total_iterations: int,
        hooks: list[IterationHook],
        clock: CollectiveClock,
        t_start: float,
    ) -> None:
        obs = self.env.get_observations().to(self.device)
        for it in range(start_it, total_iterations):
            c0 = clock.seconds
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(self.cfg["num_steps_per_env"]):
                    actions = self.alg.act(obs)
                    obs, rewards, dones, extras = self.env.step(actions.to(self.env.device))
                    if self.cfg.get("check_for_nan", True):
                        from rsl_rl.utils import check_nan

                        check_nan(obs, rewards, dones)
                    obs, rewards, dones = (
                        obs.to(self.device),
                        rewards.to(self.device),
                        dones.to(self.device),
                    )
                    self.alg.process_env_step(obs, rewards, dones, extras)
                    self.logger.process_env_step(rewards, dones, extras, None)
                t1 = time.perf_counter()
                self.alg.compute_returns(obs)
            loss_dict = self.alg.update()
            t2 = time.perf_counter()
            self.current_learning_iteration = it + 1
            with contextlib.redirect_stdout(self.quiet):
                self.logger.log(
                    it=it,
                    start_it=start_it,
                    total_it=total_iterations,
                    collect_time=t1 - t0,
                    learn_time=t2 - t1,
                    loss_dict=loss_dict,
                    learning_rate=self.alg.learning_rate,
                    action_std=self.alg.get_policy().output_std,
                    rnd_weight=None,
                    print_minimal=True,
                )
            rew, length = self.logger.rewbuffer, self.logger.lenbuffer
            stats = IterationStats(
                iteration=it + 1,
                total=total_iterations,
                env_steps=self.cfg["num_steps_per_env"] * self.env.num_envs * self.ctx.world_size,
                collect_s=t1 - t0,
                learn_s=t2 - t1,
                collective_s=clock.seconds - c0,
                mean_reward=statistics.mean(rew) if rew else None,
                mean_episode_length=statistics.mean(length) if length else None,
                elapsed_s=time.perf_counter() - t_start,
            )
            for hook in hooks:
                hook(self, stats)

    def training_state(self, infos: dict | None = None) -> dict[str, Any]:
        """rsl-rl's checkpoint content: models (normalizers included), optimizer, iteration."""
        saved = self.alg.save()
        saved["iter"] = self.current_learning_iteration
        saved["infos"] = infos
        return saved

    def save(self, path: str, infos: dict | None = None) -> None:
        """Save atomically (rsl-rl's signature, for code that calls runner.save)."""
        save_checkpoint(Path(path), self.training_state(infos))

    def param_digest(self) -> str:
        """sha256 of the actor and critic parameters, to compare ranks bit for bit."""
        h = hashlib.sha256()
        for module in (self.alg.actor, self.alg.critic):
            for name, tensor in sorted(module.state_dict().items()):
                h.update(name.encode())
                h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


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
        import torch.distributed as dist

        dist.broadcast_object_list(made, src=0)
    return Path(made[0])


def _gather(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    if not ctx.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def rank_state(env: Any, device: str) -> dict[str, Any]:
    """Everything of one rank that an exact continuation needs besides the shared models:
    its worlds' simulator state and episode counters, and its random number generators."""
    state: dict[str, Any] = {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }
    if hasattr(env, "state_dict"):
        state["env"] = {k: v.cpu() for k, v in env.state_dict().items()}
    if device.startswith("cuda"):
        state["cuda_rng"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def restore_rank_state(env: Any, state: dict[str, Any], device: str) -> None:
    """Put back what `rank_state` saved."""
    if "env" in state and hasattr(env, "load_state_dict"):
        env.load_state_dict(state["env"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if device.startswith("cuda") and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], torch.device(device))


def restore(runner: DistributedRunner, env: Any, run: RunDir, ctx: DistContext, device: str) -> int:
    """Continue from the run's newest valid checkpoint; the iterations it had done (0: none)."""
    found = latest_valid(run.path, map_location=device)
    if found is None:
        return 0
    path, ckpt = found
    runner.alg.load(ckpt, None, strict=True)
    runner.current_learning_iteration = int(ckpt["iter"])
    states = ckpt.get("rank_states")
    if states and len(states) == ctx.world_size:
        restore_rank_state(env, states[ctx.rank], device)
    else:
        log.warning(
            "%s has no per-rank state for a world of %d ranks: models and optimizer restored, "
            "environments start fresh (the continuation is not bit-exact)",
            path.name,
            ctx.world_size,
        )
    log.info("resumed from %s at iteration %d", path.name, runner.current_learning_iteration)
    return runner.current_learning_iteration


def _build_env_staged(
    task: Any, num_envs: int, device: str, seed: int, use_graph: bool, ctx: DistContext
) -> Any:
    """Build the environment; on a node with several ranks, local rank 0 first.

    Building loads (on a cold cache: compiles) every Warp kernel. Local rank 0 compiles each
    module once into the node's kernel cache; the other ranks then load them from it instead
    of all compiling the same modules at once.
    """
    import warp as wp

    def build() -> Any:
        with wp.ScopedDevice(device):
            return task.make_env(num_envs, device, seed, use_graph)

    if not ctx.is_distributed or ctx.local_world_size == 1:
        return build()
    import torch.distributed as dist

    env = build() if ctx.local_rank == 0 else None
    dist.barrier()
    return env if env is not None else build()


def _rank_logging(run: RunDir, rank: int) -> tuple[logging.Handler, TextIO]:
    run.logs.mkdir(parents=True, exist_ok=True)
    stream = open(run.rank_log(rank), "a", buffering=1)  # noqa: SIM115 (closed by train_rank)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler, stream


def _dump_params(writer: RunWriter, spec: TrainSpec, agent_cfg: dict[str, Any], env: Any) -> None:
    writer.run.params.mkdir(parents=True, exist_ok=True)
    env_cfg = {
        "num_envs": env.num_envs,
        "decimation": env.cfg.decimation,
        "episode_length": env.cfg.episode_length,
        "action_scale": env.cfg.action_scale,
        "mjcf": env.cfg.xml,
    }
    for name, data in (("train", spec.to_dict()), ("agent", agent_cfg), ("env", env_cfg)):
        path = writer.run.params / f"{name}.yaml"
        writer.write_text(path, yaml.safe_dump(data, sort_keys=False))


@dataclass
class _Boundary:
    """The per-iteration boundary every rank runs: agree on a stop request, checkpoint."""

    runner: DistributedRunner
    env: Any
    ctx: DistContext
    device: str
    spec: TrainSpec
    total: int
    request: StopRequest
    writer: RunWriter | None

    def __call__(self, runner: DistributedRunner, s: IterationStats) -> None:
        signum = agree(self.request, self.ctx.is_distributed, self.device)
        periodic = s.iteration % self.spec.save_interval == 0 or s.iteration == self.total
        if signum or periodic:
            t0 = time.time()
            states = _gather_to_main(rank_state(self.env, self.device), self.ctx)
            if self.writer is not None:
                path = self.writer.run.checkpoint(s.iteration)
                state = runner.training_state({"world_size": self.ctx.world_size})
                state["rank_states"] = states
                self.writer.save_checkpoint(path, state)
                prune(self.writer.run.path, self.spec.keep_checkpoints)
                if signum:
                    stop = {
                        "reason": stop_reason(signum, self.spec.preempt_signal),
                        "signal": signal.Signals(signum).name,
                        "iteration": s.iteration,
                        "job_id": self.ctx.job_id,
                        "restart_count": self.ctx.restart_count,
                        "signal_at": self.request.signaled_at,
                        "checkpoint_at": time.time(),
                        "checkpoint_s": round(time.time() - t0, 3),
                    }
                    run = self.writer.run
                    self.writer.append_line(run.path / "restarts.jsonl", json.dumps(stop))
                    record = runrecord.on_stop(runrecord.read_record(run.path), stop)
                    self.writer.write_json(run.path / runrecord.RECORD_NAME, record)
        if signum:
            raise Stopped(s.iteration, stop_reason(signum, self.spec.preempt_signal), signum)


def train_rank(spec: TrainSpec, master_port: int | None = None) -> RankResult:
    """Train on this rank until the spec's iterations are done; the per-rank entry point.

    Raises `Stopped` after a stop checkpoint when a preemption or time-limit signal arrived;
    the launcher decides whether to requeue.
    """
    import warp as wp

    wp.config.quiet = True
    wp.config.log_level = wp.LOG_WARNING  # kernel-load lines go nowhere useful on N ranks
    spec.validate()
    task = resolve_task(spec)
    ctx = DistContext.from_env(master_port=master_port)
    device = rank_device(spec, ctx)
    torch.set_num_threads(torch_threads(spec.torch_threads, ctx, os.environ))
    if device.startswith("cuda"):
        # Offscreen rendering (videos) on this rank's GPU, as mjlab does.
        os.environ["MUJOCO_EGL_DEVICE_ID"] = str(ctx.local_rank)
    seed = seed_for_rank(spec.seed, ctx)
    num_envs = spec.num_envs or task.num_envs
    total = spec.max_iterations or task.max_iterations
    experiment = spec.experiment_name or task.name
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
            env = _build_env_staged(task, num_envs, device, seed, spec.use_graph, ctx)
            first_obs = tensor_digest(env.get_observations()["policy"])
            agent_cfg = agent_config(task, spec.save_interval, experiment)
            agent_cfg["seed"] = seed
            runner = DistributedRunner(
                env,
                dict(agent_cfg),
                ctx,
                log_dir=str(run.path) if ctx.is_main else None,
                device=device,
                quiet=rank_log,
            )
            start = restore(runner, env, run, ctx, device)
            if writer is not None:
                record = runrecord.on_start(
                    runrecord.read_record(run.path),
                    spec=spec.to_dict(),
                    job_id=ctx.job_id,
                    restart_count=ctx.restart_count,
                    launch_mode=ctx.mode,
                    world_size=ctx.world_size,
                    num_nodes=ctx.num_nodes,
                    device=device,
                    resumed_from=start,
                    code_dir=Path.cwd(),
                )
                writer.write_json(run.path / runrecord.RECORD_NAME, record)
            if writer is not None and start == 0:
                _dump_params(writer, spec, agent_cfg, env)
            display = ProgressDisplay(total, start, enabled=ctx.is_main)
            hooks: list[IterationHook] = [
                lambda r, s: log.info(
                    "iteration %d/%d %.0f steps/s", s.iteration, s.total, s.steps_per_s
                ),
                lambda r, s: display.update(s),
            ]
            if writer is not None:
                hooks.append(_progress_writer(writer))
            hooks.append(_Boundary(runner, env, ctx, device, spec, total, request, writer))
            try:
                with wp.ScopedDevice(device):
                    runner.learn_until(total, hooks)
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
                record = runrecord.on_end(
                    runrecord.read_record(run.path), runner.current_learning_iteration
                )
                writer.write_json(run.path / runrecord.RECORD_NAME, record)
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
                    record = runrecord.read_record(run.path)
                    record = runrecord.on_end(record, record.get("iterations", 0), "failed")
                    writer.write_json(run.path / runrecord.RECORD_NAME, record)
            raise
        finally:
            if writer is not None:
                writer.release()
            log.removeHandler(handler)
            rank_log.close()


def _progress_writer(writer: RunWriter) -> IterationHook:
    def hook(runner: DistributedRunner, s: IterationStats) -> None:
        writer.append_line(writer.run.progress, json.dumps(s.as_record()))

    return hook

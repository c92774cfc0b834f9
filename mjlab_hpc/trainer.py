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
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import yaml
from rsl_rl.runners import OnPolicyRunner

from mjlab_hpc.distributed import (
    DistContext,
    cuda_device_count,
    process_group,
    resolve_device,
    seed_for_rank,
    torch_threads,
)
from mjlab_hpc.normalization import sync_normalizers
from mjlab_hpc.progress import IterationStats, ProgressDisplay
from mjlab_hpc.rundir import RunDir, create_run_dir, write_json_atomic
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
        obs = self.env.get_observations().to(self.device)
        self.alg.train_mode()
        if self.is_distributed:
            with contextlib.redirect_stdout(self.quiet):
                self.alg.broadcast_parameters()
        with contextlib.redirect_stdout(self.quiet):
            self.logger.init_logging_writer()
        start_it = self.current_learning_iteration
        clock = CollectiveClock()
        t_start = time.perf_counter()
        with clock.timing() if self.is_distributed else contextlib.nullcontext():
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
                    env_steps=self.cfg["num_steps_per_env"]
                    * self.env.num_envs
                    * self.ctx.world_size,
                    collect_s=t1 - t0,
                    learn_s=t2 - t1,
                    collective_s=clock.seconds - c0,
                    mean_reward=statistics.mean(rew) if rew else None,
                    mean_episode_length=statistics.mean(length) if length else None,
                    elapsed_s=time.perf_counter() - t_start,
                )
                for hook in hooks:
                    hook(self, stats)
        if self.is_writer:
            self.logger.stop_logging_writer()

    def save(self, path: str, infos: dict | None = None) -> None:
        """Save through a temporary file and a rename, so no reader sees half a checkpoint."""
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        saved = self.alg.save()
        saved["iter"] = self.current_learning_iteration
        saved["infos"] = infos
        with open(tmp, "wb") as f:
            torch.save(saved, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

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
    """The one run directory of this run: given by the launcher, else made by rank 0 and sent
    to the others through the process group."""
    if spec.run_dir:
        path = Path(spec.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()
    made = [str(create_run_dir(spec.log_root, experiment, spec.run_name))] if ctx.is_main else [""]
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


def _rank_logging(run: RunDir, rank: int) -> tuple[logging.Handler, TextIO]:
    run.logs.mkdir(parents=True, exist_ok=True)
    stream = open(run.rank_log(rank), "a", buffering=1)  # noqa: SIM115 (closed by train_rank)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler, stream


def _dump_params(run: RunDir, spec: TrainSpec, agent_cfg: dict[str, Any], env: Any) -> None:
    run.params.mkdir(parents=True, exist_ok=True)
    env_cfg = {
        "num_envs": env.num_envs,
        "decimation": env.cfg.decimation,
        "episode_length": env.cfg.episode_length,
        "action_scale": env.cfg.action_scale,
        "mjcf": env.cfg.xml,
    }
    for name, data in (("train", spec.to_dict()), ("agent", agent_cfg), ("env", env_cfg)):
        (run.params / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def train_rank(spec: TrainSpec, master_port: int | None = None) -> RankResult:
    """Train on this rank until the spec's iterations are done; the per-rank entry point."""
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

    with process_group(ctx, device, spec.dist_timeout_s):
        run = RunDir(agree_run_dir(spec, ctx, experiment))
        handler, rank_log = _rank_logging(run, ctx.rank)
        try:
            log.info("%s on %s, seed %d, %d envs", ctx.describe(), device, seed, num_envs)
            with wp.ScopedDevice(device):
                env = task.make_env(num_envs, device, seed, spec.use_graph)
            first_obs = tensor_digest(env.get_observations()["policy"])
            agent_cfg = agent_config(task, spec.save_interval, experiment)
            agent_cfg["seed"] = seed
            if ctx.is_main:
                _dump_params(run, spec, agent_cfg, env)
            runner = DistributedRunner(
                env,
                dict(agent_cfg),
                ctx,
                log_dir=str(run.path) if ctx.is_main else None,
                device=device,
                quiet=rank_log,
            )
            display = ProgressDisplay(total, runner.current_learning_iteration, enabled=ctx.is_main)
            hooks: list[IterationHook] = [
                lambda r, s: log.info(
                    "iteration %d/%d %.0f steps/s", s.iteration, s.total, s.steps_per_s
                ),
                lambda r, s: display.update(s),
            ]
            if ctx.is_main:
                hooks.append(_progress_writer(run))
                hooks.append(_checkpointer(run, spec.save_interval, total))
            try:
                with wp.ScopedDevice(device):
                    runner.learn_until(total, hooks)
            finally:
                display.close()
            digest = runner.param_digest()
            digests = _gather(digest, ctx)
            obs_digests = _gather(first_obs, ctx)
            if ctx.is_main:
                write_json_atomic(
                    run.summary,
                    {
                        "iterations": runner.current_learning_iteration,
                        "world_size": ctx.world_size,
                        "device": device,
                        "launch_mode": ctx.mode,
                        "param_digest_per_rank": digests,
                        "ranks_in_sync": len(set(digests)) == 1,
                        "first_obs_digest_per_rank": obs_digests,
                    },
                )
                if len(set(digests)) != 1:
                    log.error("ranks diverged: parameter digests %s", digests)
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
        except BaseException:
            log.exception("rank %d failed", ctx.rank)
            raise
        finally:
            log.removeHandler(handler)
            rank_log.close()


def _progress_writer(run: RunDir) -> IterationHook:
    import json

    def hook(runner: DistributedRunner, s: IterationStats) -> None:
        with open(run.progress, "a") as f:
            f.write(json.dumps(s.as_record()) + "\n")

    return hook


def _checkpointer(run: RunDir, every: int, total: int) -> IterationHook:
    def hook(runner: DistributedRunner, s: IterationStats) -> None:
        if s.iteration % every == 0 or s.iteration == total:
            runner.save(str(run.checkpoint(s.iteration)))

    return hook

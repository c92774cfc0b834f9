"""What one rank trains, and how the run saves and restores it.

A built-in task trains with rsl-rl's runner; an mjlab task with mjlab's own runner for it
(its save, load and params; its --video, --enable-nan-guard and tracking motions). Every
checkpoint also holds each rank's whole environment state and random generators (`rank_state`,
written beside the model file), so a continuation is exact where the physics is
deterministic. A run started from another run's checkpoint (--agent.resume True) takes its
models, optimizer and normalizers, not its iteration count or environments.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import torch
import torch.distributed as dist
import warp as wp
import yaml

from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.normalization import NormalizerSync
from mjlab_hpc.rank.runner import DistributedRunner, runner_class
from mjlab_hpc.rundir.checkpoint import load_with, publish_file
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import versions
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.spec import SIMULATOR_PACKAGES, ResolvedSpec, TrainSpec
from mjlab_hpc.tasks import mjlab as mjlab_tasks
from mjlab_hpc.tasks.agent import agent_config, apply_agent_overrides
from mjlab_hpc.tasks.builtin import get_task
from mjlab_hpc.tasks.video import Recording

__all__ = [
    "BuiltinWorkload",
    "MjlabWorkload",
    "Workload",
    "build_staged",
    "build_workload",
    "make_mjlab_runner",
    "rank_state",
    "restore_rank_state",
]

log = logging.getLogger("mjlab_hpc")


class Workload(Protocol):
    """One rank's environment and runner, and the task-specific parts of the run."""

    env: Any
    runner: Any
    random_ep_len: bool
    """Spread the first episodes' lengths on a fresh start (mjlab's convention)."""
    fits: dict[str, Any]
    """What saved environment states must match to be restored here: environments per
    rank, seed, device type, the simulator's versions (checkpoints keep theirs in
    infos["environments"]); and what they belong to: the task, and the run (the name of its
    folder at its first start, kept by every checkpoint after)."""

    def dump_params(self, writer: RunWriter) -> None:
        """Write the run's params/ (on a fresh start)."""
        ...

    def save(self, path: Path, writer: RunWriter, infos: dict[str, Any]) -> None:
        """Put the model checkpoint on disk (`infos`: what its rank states fit, saved with
        it; its "environments" also head the checksum sidecar)."""
        ...

    def load(self, path: Path, ckpt: dict[str, Any], other_run: bool) -> None:
        """Restore models, optimizer and iteration from the verified checkpoint `ckpt` at
        `path` (another run's checkpoint: iteration 0)."""
        ...

    def env_state(self) -> Any:
        """This rank's environments' whole state, copied to the CPU."""
        ...

    def restore_env(self, state: Any) -> list[str]:
        """Put an `env_state` back into this rank's freshly built environments; what could
        not be put back (empty: everything)."""
        ...

    def first_obs_digest(self) -> str:
        """sha256 of this rank's first observations (to check that ranks differ)."""
        ...


def _first_obs_digest(env: Any) -> str:
    obs = env.get_observations()
    first = obs[next(iter(obs.keys()))]
    return hashlib.sha256(first.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def build_staged(build: Callable[[], Any], ctx: DistContext) -> Any:
    """Build on a node's local rank 0 first, then on its other ranks.

    Building loads (on a cold cache: compiles) every Warp kernel. Local rank 0 compiles each
    module once into the node's kernel cache; the other ranks then load them from it instead
    of all compiling the same modules at once.
    """
    if not ctx.is_distributed or ctx.local_world_size == 1:
        return build()
    made = build() if ctx.local_rank == 0 else None
    dist.barrier()
    return made if made is not None else build()


def rank_state(work: Workload, device: str) -> dict[str, Any]:
    """Return what an exact continuation needs of one rank, besides the shared models.

    That is its environments' whole state and its random number generators: torch's on the
    CPU and on the rank's GPU, numpy's and Python's. Warp has no global generator: its seeds
    are in the environments' state. Its logger's episode statistics go with them. All of it is
    plain data (numpy's generator state with its key as a list).
    """
    name, key, *rest = np.random.get_state()
    state: dict[str, Any] = {
        "env": work.env_state(),
        "episodes": work.runner.episode_state(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": (name, key.tolist(), *rest),
        "python_rng": random.getstate(),
    }
    if device.startswith("cuda"):
        state["cuda_rng"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def restore_rank_state(work: Workload, state: dict[str, Any], device: str) -> list[str]:
    """Put back what `rank_state` saved; what of the environments could not be put back."""
    problems = work.restore_env(state["env"])
    problems += work.runner.restore_episode_state(state.get("episodes") or {})  # older: none
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if device.startswith("cuda") and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], torch.device(device))
    return problems


def _fits(resolved: ResolvedSpec, device: str, run: RunDir) -> dict[str, Any]:
    installed = versions()
    packages = SIMULATOR_PACKAGES[resolved.source]
    return {
        "run": run.path.name,
        "task": resolved.task,
        "num_envs": resolved.num_envs,
        "seed": resolved.train.seed,
        "device": device.partition(":")[0],
        "versions": {name: installed.get(name) for name in packages},
    }


def build_workload(
    resolved: ResolvedSpec,
    ctx: DistContext,
    device: str,
    seed: int,
    run: RunDir,
    quiet: TextIO,
) -> Workload:
    """The workload of this rank (the writer's runner gets the run directory as log dir)."""
    build = MjlabWorkload if resolved.source == "mjlab" else BuiltinWorkload
    return build(resolved, ctx, device, seed, run, quiet)


class BuiltinWorkload:
    """A built-in task, trained with rsl-rl's runner."""

    random_ep_len = False

    def __init__(
        self,
        resolved: ResolvedSpec,
        ctx: DistContext,
        device: str,
        seed: int,
        run: RunDir,
        quiet: TextIO,
    ) -> None:
        self.spec = spec = resolved.train
        task = get_task(resolved.task)
        make_env = task.make_env
        assert make_env is not None  # every built-in task has one

        def build() -> Any:
            with wp.ScopedDevice(device):
                return make_env(resolved.num_envs, device, seed, spec.use_graph)

        self.env = build_staged(build, ctx)
        cfg = agent_config(task, spec.save_interval, resolved.experiment_name)
        self.cfg = cfg = apply_agent_overrides(cfg, spec.overrides)
        cfg["seed"] = seed
        self.runner = DistributedRunner(
            self.env,
            dict(cfg),
            log_dir=str(run.path) if ctx.is_main else None,
            device=device,
            ctx=ctx,
            quiet=quiet,
            normalizer_sync=spec.normalizer_sync,
        )
        self.fits = _fits(resolved, device, run)

    def dump_params(self, writer: RunWriter) -> None:
        env = self.env
        env_cfg = {
            "num_envs": env.num_envs,
            "decimation": env.cfg.decimation,
            "episode_length": env.cfg.episode_length,
            "action_scale": env.cfg.action_scale,
            "mjcf": env.cfg.xml,
        }
        _write_params(writer, self.spec, {"agent": self.cfg, "env": env_cfg})

    def save(self, path: Path, writer: RunWriter, infos: dict[str, Any]) -> None:
        state = self.runner.training_state(infos)
        writer.save_checkpoint(path, state, infos["environments"])

    def load(self, path: Path, ckpt: dict[str, Any], other_run: bool) -> None:
        self.runner.alg.load(ckpt, None, strict=True)
        self.runner.current_learning_iteration = 0 if other_run else int(ckpt["iter"])

    def env_state(self) -> Any:
        return {k: v.cpu() for k, v in self.env.state_dict().items()}

    def restore_env(self, state: Any) -> list[str]:
        self.env.load_state_dict(state)
        return []

    def first_obs_digest(self) -> str:
        return _first_obs_digest(self.env)


class MjlabWorkload:
    """An mjlab task, trained with mjlab's own runner for it: its save, load and params; its
    --video, --enable-nan-guard and tracking motions."""

    random_ep_len = True

    def __init__(
        self,
        resolved: ResolvedSpec,
        ctx: DistContext,
        device: str,
        seed: int,
        run: RunDir,
        quiet: TextIO,
    ) -> None:
        self.spec = spec = resolved.train
        self.device = device
        # Only the writer records videos (mjlab: rank 0), into the run directory.
        recording = (
            Recording(str(run.videos), spec.video_length, spec.video_interval)
            if spec.video and ctx.is_main
            else None
        )

        def build() -> Any:
            # mjlab prints its managers' tables while building: they belong in the rank's log.
            with contextlib.redirect_stdout(quiet):
                return mjlab_tasks.make_mjlab_runtime(
                    spec.task,
                    num_envs=spec.num_envs,
                    max_iterations=spec.max_iterations,
                    seed=seed,
                    device=device,
                    overrides=spec.overrides,
                    registry_name=spec.registry_name,
                    cpu_graph=spec.use_graph,
                    motion_file=resolved.motion_file,
                    recording=recording,
                    nan_guard=spec.enable_nan_guard,
                    nan_guard_dir=str(run.nan_dumps(ctx.rank)),
                )

        self.runtime = runtime = build_staged(build, ctx)
        if os.environ.get("MUJOCO_GL") == "disable":
            log.info("MuJoCo's rendering is off here (MUJOCO_GL=disable): nothing is rendered")
        if recording is not None:
            log.info(
                "recording videos of env 0 into %s: %d frames every %d env steps",
                recording.folder,
                recording.length,
                recording.interval,
            )
            # Close the renderer before MuJoCo's own exit handler ends EGL (handlers run last
            # registered first); a video being recorded is saved.
            atexit.register(_close_quietly, runtime.recorder)
        self.env = runtime.env
        log_dir = str(run.path) if ctx.is_main else None
        self.runner = make_mjlab_runner(
            runtime, ctx, log_dir, quiet=quiet, normalizer_sync=spec.normalizer_sync
        )
        self.fits = _fits(resolved, device, run)

    def dump_params(self, writer: RunWriter) -> None:
        writer.check()
        mjlab_tasks.dump_params(writer.run.path, self.runtime)  # params/env.yaml, agent.yaml
        _write_params(writer, self.spec, {})

    def save(self, path: Path, writer: RunWriter, infos: dict[str, Any]) -> None:
        # mjlab's own save (step counter, ONNX export), then the same fenced, checksummed
        # publication as ours.
        header = infos["environments"]
        self.runner.save_published(
            path, lambda tmp: publish_file(tmp, path, writer.check, header=header), infos
        )

    def load(self, path: Path, ckpt: dict[str, Any], other_run: bool) -> None:
        runner, runtime, device = self.runner, self.runtime, self.device
        load_with(lambda f: runner.load(f, map_location=device), path)  # weights only
        runner.current_learning_iteration = 0 if other_run else int(ckpt["iter"])
        if runtime.recorder is not None:  # videos go on where the last start stopped
            steps = runner.current_learning_iteration * runtime.agent_cfg.num_steps_per_env
            runtime.recorder.step_count = steps

    def env_state(self) -> Any:
        return mjlab_tasks.capture_env(self.env)

    def restore_env(self, state: Any) -> list[str]:
        return mjlab_tasks.restore_env(self.env, state, self.device)

    def first_obs_digest(self) -> str:
        return _first_obs_digest(self.env)


def _close_quietly(env: Any) -> None:
    with contextlib.suppress(Exception):
        env.close()


def _write_params(writer: RunWriter, spec: TrainSpec, extra: dict[str, Any]) -> None:
    writer.run.params.mkdir(parents=True, exist_ok=True)
    for name, data in {"train": spec.to_dict(), **extra}.items():
        writer.write_text(writer.run.params / f"{name}.yaml", yaml.safe_dump(data, sort_keys=False))


def make_mjlab_runner(
    runtime: mjlab_tasks.MjlabRuntime,
    ctx: DistContext,
    log_dir: str | None,
    quiet: TextIO | None = None,
    normalizer_sync: NormalizerSync = "iteration",
) -> Any:
    """Build the task's own runner class, driven by `ctx` and our learn loop.

    The task's class keeps its save, load and ONNX export (`runner_class`); it is built as
    mjlab builds it, on a fresh copy of the config. Pass log_dir=None on ranks other than the
    writer (rsl-rl then writes nothing).
    """
    cls = runner_class(runtime.runner_cls)
    return cls(
        runtime.env,
        runtime.runner_cfg(),
        log_dir,
        runtime.device,
        ctx=ctx,
        quiet=quiet or io.StringIO(),
        normalizer_sync=normalizer_sync,
        **runtime.runner_kwargs,
    )

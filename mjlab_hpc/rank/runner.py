"""The runner: rsl-rl's OnPolicyRunner driven by a DistContext, with our learn loop.

`ContextRunnerMixin` goes in front of any OnPolicyRunner class: rsl-rl's own for the built-in
tasks (`DistributedRunner`), or mjlab's task runners (`runner_class(base)`), which keeps their
own `save` (ONNX export, environment step counter) and `load`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import statistics
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TextIO

import torch
from rsl_rl.runners import OnPolicyRunner
from rsl_rl.utils import check_nan

from mjlab_hpc.convert import Range
from mjlab_hpc.errors import Diverged
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.normalization import NormalizerSync, agree_normalizers, sync_normalizers
from mjlab_hpc.rundir.checkpoint import save_checkpoint
from mjlab_hpc.rundir.durable import create_exclusive, temp_path, write_atomic, write_new
from mjlab_hpc.rundir.layout import WANDB_RECORD
from mjlab_hpc.rundir.progress import IterationStats
from mjlab_hpc.rundir.typed import Unread, plain, read_json

__all__ = [
    "CollectiveClock",
    "ContextRunnerMixin",
    "DistributedRunner",
    "IterationHook",
    "WandbBook",
    "runner_class",
    "state_digest",
]

log = logging.getLogger("mjlab_hpc")


IterationHook = Callable[[Any, IterationStats], None]

# rsl-rl's logger's episode statistics: the returns and lengths of the last 100 finished
# episodes (RND's two parts too), each env's sums so far, and the steps taken in all.
_EPISODE_BUFFERS = ("rewbuffer", "lenbuffer", "erewbuffer", "irewbuffer")
_EPISODE_SUMS = ("cur_reward_sum", "cur_episode_length", "cur_ereward_sum", "cur_ireward_sum")
_EPISODE_TOTALS = ("tot_timesteps",)


def _divergence(loss_dict: dict[str, Any], alg: Any) -> str | None:
    """What is no longer finite after an update (None: all is)."""
    for name, value in loss_dict.items():
        if (
            isinstance(value, (int, float, torch.Tensor))
            and not torch.isfinite(torch.as_tensor(value)).all()
        ):
            return f"the {name} loss is {float(torch.as_tensor(value).float().mean())}"
    for label, module in (("actor", alg._raw_actor), ("critic", alg._raw_critic)):
        for name, param in module.named_parameters():
            if not torch.isfinite(param).all():
                return f"the {label}'s {name} holds non-finite values"
    std = getattr(alg.get_policy(), "output_std", None)  # a policy without noise has none
    if std is not None and not (torch.isfinite(std).all() and (std > 0).all()):
        return f"the action noise (std) is {torch.as_tensor(std).detach().flatten()[:4].tolist()}"
    return None


class CollectiveClock:
    """Accumulates the time spent inside torch.distributed's collectives.

    rsl-rl calls torch.distributed's functions directly, so the only place to time them without
    copying its algorithm is the module attribute; `timing()` wraps them for the duration of a
    block and always restores the originals.
    """

    NAMES = (
        "all_reduce",
        "all_gather",
        "broadcast",
        "broadcast_object_list",
        "all_gather_object",
        "barrier",
    )

    def __init__(self) -> None:
        self.seconds = 0.0
        """Seconds inside collectives while timing."""
        self.calls = 0
        """Collectives made while timing."""

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
                    self.calls += 1

            return timed

        try:
            for name, fn in originals.items():
                setattr(dist, name, wrap(fn))
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


class ContextRunnerMixin:
    """Drives an rsl-rl OnPolicyRunner by a DistContext, with our learn loop.

    Put it before an OnPolicyRunner (or a subclass such as mjlab's runners) in the bases:
    rank and world size then come from the DistContext instead of rsl-rl's NCCL-only set-up.
    The process group itself is created by `process_group()` (gloo on CPU, NCCL on CUDA);
    this only tells rsl-rl who it is, so its parameter broadcast and gradient all-reduce work
    on both. The loop is rsl-rl's, with a hook after every iteration (progress, checkpoints,
    stop requests) and iteration numbers that count completed iterations, so a resume
    continues exactly. Construct with the base's arguments plus `ctx=`, `quiet=` (where
    rsl-rl's console output goes: the rank's log) and `normalizer_sync=` (how often the
    ranks' observation normalizers agree: `mjlab_hpc.rank.normalization`).
    """

    ctx: DistContext
    quiet: TextIO
    # Provided by OnPolicyRunner:
    alg: Any
    env: Any
    cfg: dict[str, Any]
    logger: Any
    device: str
    is_distributed: bool
    current_learning_iteration: int

    def __init__(
        self,
        env: Any,
        train_cfg: dict,
        *args: Any,
        ctx: DistContext,
        quiet: TextIO,
        normalizer_sync: NormalizerSync = "iteration",
        **kwargs: Any,
    ) -> None:
        self.ctx = ctx
        self.quiet = quiet
        with contextlib.redirect_stdout(quiet):
            super().__init__(env, train_cfg, *args, **kwargs)  # type: ignore[call-arg]
        if self.is_distributed:
            sync_normalizers(self.alg._raw_actor, self.alg._raw_critic, every=normalizer_sync)

    def _configure_multi_gpu(self) -> None:
        ctx = self.ctx
        if ctx.is_distributed:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"{ctx.describe()}: join the process group first")
        self.gpu_world_size = ctx.world_size
        self.gpu_global_rank = ctx.rank
        self.gpu_local_rank = ctx.local_rank
        self.is_distributed = ctx.is_distributed
        self.cfg["multi_gpu"] = (
            {"global_rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size}
            if ctx.is_distributed
            else None
        )

    def learn_until(
        self,
        total_iterations: int,
        hooks: list[IterationHook],
        init_at_random_ep_len: bool = False,
    ) -> None:
        """Run PPO iterations until `total_iterations` are completed in all.

        `init_at_random_ep_len` (mjlab's convention for a fresh start) spreads the first
        episodes' lengths so that resets do not all happen together.
        """
        if init_at_random_ep_len and self.current_learning_iteration == 0:
            self.env.episode_length_buf = torch.randint_like(
                self.env.episode_length_buf, high=int(self.env.max_episode_length)
            )
        self.alg.train_mode()
        if self.is_distributed:
            with contextlib.redirect_stdout(self.quiet):
                self.alg.broadcast_parameters()
        start_it = self.current_learning_iteration
        book = self._wandb_book()
        tags = tuple(self.cfg.get("wandb_tags") or ())
        with contextlib.redirect_stdout(self.quiet), _wandb_identity(book, tags):
            self.logger.init_logging_writer()
        self._continue_tensorboard(start_it)
        if book is not None:
            _skip_logged_steps(self.logger.writer, book)
        clock = CollectiveClock()
        t_start = time.perf_counter()
        try:
            with clock.timing() if self.is_distributed else contextlib.nullcontext():
                self._iterate(start_it, total_iterations, hooks, clock, t_start)
        finally:
            self._close_tensorboard()

    def _continue_tensorboard(self, start_it: int) -> None:
        # After a resume, drop events a killed predecessor logged past its last checkpoint, so
        # every curve continues at the right step without duplicates. The writer itself stays
        # (rsl-rl's W&B writer is a SummaryWriter too): its event file is reopened with a purge.
        writer = self.logger.writer
        if start_it > 0 and writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            if isinstance(writer, SummaryWriter):
                SummaryWriter.close(writer)
                writer.purge_step = start_it

    def _wandb_book(self) -> WandbBook | None:
        """The run's W&B record when this process logs to W&B (the writer, logger `wandb`)."""
        logger = self.cfg.get("logger", "tensorboard")
        kind = logger if isinstance(logger, str) else str(logger.get("class_name", ""))
        log_dir = getattr(self.logger, "log_dir", None)
        if kind != "wandb" and not kind.endswith("WandbLogWriter"):
            return None
        if log_dir is None or getattr(self.logger, "disable_logs", False):
            return None
        return WandbBook.open(Path(log_dir))

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
            c0, n0 = clock.seconds, clock.calls
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(self.cfg["num_steps_per_env"]):
                    actions = self.alg.act(obs)
                    obs, rewards, dones, extras = self.env.step(actions.to(self.env.device))
                    if self.cfg.get("check_for_nan", True):
                        check_nan(obs, rewards, dones)
                    obs, rewards, dones = (
                        obs.to(self.device),
                        rewards.to(self.device),
                        dones.to(self.device),
                    )
                    self.alg.process_env_step(obs, rewards, dones, extras)
                    self.logger.process_env_step(rewards, dones, extras, None)
                if self.is_distributed:
                    agree_normalizers(self.alg._raw_actor, self.alg._raw_critic)
                t1 = time.perf_counter()
                self.alg.compute_returns(obs)
            loss_dict = self.alg.update()
            t2 = time.perf_counter()
            if (what := _divergence(loss_dict, self.alg)) is not None:
                raise Diverged(it + 1, what, float(self.alg.learning_rate))
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
                collectives=clock.calls - n0,
                mean_reward=statistics.mean(rew) if rew else None,
                mean_episode_length=statistics.mean(length) if length else None,
                elapsed_s=time.perf_counter() - t_start,
            )
            for hook in hooks:
                hook(self, stats)

    def episode_state(self) -> dict[str, Any]:
        """The logger's episode statistics, which progress.jsonl's mean reward and length are.

        Each rank saves them with its environments: a continuation then logs what a run that
        never stopped logs (only the writer's logger keeps any).
        """
        logger = self.logger
        state: dict[str, Any] = {}
        for name in (*_EPISODE_BUFFERS, *_EPISODE_SUMS, *_EPISODE_TOTALS):
            value = getattr(logger, name, None)
            if isinstance(value, torch.Tensor):
                state[name] = value.detach().cpu().clone()
            elif value is not None:
                state[name] = list(value) if name in _EPISODE_BUFFERS else value
        return state

    def restore_episode_state(self, state: dict[str, Any]) -> list[str]:
        """Put back what `episode_state` saved; what could not be put back.

        Statistics it lacks (a state saved before they were) stay empty.
        """
        logger, problems = self.logger, []
        for name, value in state.items():
            here = getattr(logger, name, None)
            if name in _EPISODE_BUFFERS and here is not None:
                here.clear()
                here.extend(float(x) for x in value)
            elif name in _EPISODE_SUMS and isinstance(here, torch.Tensor):
                if here.shape != value.shape:
                    problems.append(
                        f"logger.{name}: saved {tuple(value.shape)}, here {tuple(here.shape)}"
                    )
                    continue
                here.copy_(value)
            elif name in _EPISODE_TOTALS and here is not None:
                setattr(logger, name, value)
        return problems

    def training_state(self, infos: dict | None = None) -> dict[str, Any]:
        """rsl-rl's checkpoint content: models (normalizers included), optimizer, iteration."""
        saved = self.alg.save()
        saved["iter"] = self.current_learning_iteration
        saved["infos"] = infos
        return saved

    def save_published(
        self, path: Path, publish: Callable[[Path], None], infos: dict | None = None
    ) -> None:
        """Save with the runner's own `save`, then `publish` the file as `path`.

        mjlab's `save` adds the environment's step counter and an ONNX export. It writes to a
        temporary file beside `path`, which `publish(tmp)` renames to `path`. Its W&B upload
        waits for the real name (W&B runs are searched for model_<n>.pt).
        """
        tmp = temp_path(path)
        write_new(tmp, b"", sync=False)  # ours (O_EXCL): the runner's save cannot follow a link
        upload, uploads = self.logger.save_model, []
        self.logger.save_model = lambda _path, it: uploads.append(it)
        try:
            self.save(str(tmp), infos)  # type: ignore[attr-defined]
        finally:
            vars(self.logger).pop("save_model", None)
        publish(tmp)
        for it in uploads:
            upload(str(path), it)

    def param_digest(self) -> str:
        """sha256 of the actor and critic parameters, to compare ranks bit for bit."""
        return state_digest(self.alg.actor, self.alg.critic)


@dataclass(frozen=True)
class _WandbRecord:
    """`wandb_run.json`: the run's W&B run and the last step handed to it."""

    id: str
    """The W&B run id."""
    last_step: Annotated[int, Range(-1)] = -1
    """The last step handed to W&B (-1: none)."""


class WandbBook:
    """Keeps one W&B run per run directory, and the last step handed to it.

    The W&B run's id is made once and kept in <run>/wandb_run.json with the last step. Every
    start of the run (requeue, --resume, a restart after a crash) resumes that W&B run
    (WANDB_RUN_ID, WANDB_RESUME=allow) and logs no step W&B already has: iterations computed
    again after a crash are trained but not logged again.
    """

    def __init__(self, path: Path, run_id: str, last_step: int) -> None:
        self.path = path
        self.run_id = run_id
        self.last_step = last_step
        self.logged_before = last_step
        """Steps up to this one were handed to W&B by an earlier start."""

    @classmethod
    def open(cls, run_dir: Path) -> WandbBook:
        """The run's record, made on its first start (the first writer to create it wins)."""
        path = run_dir / WANDB_RECORD
        new_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        create_exclusive(path, json.dumps({"id": new_id, "last_step": -1}).encode())
        try:
            data = read_json(_WandbRecord, path, run_dir)
        except Unread as exc:  # a new W&B run rather than a traceback
            log.warning("%s: a new W&B run begins", exc)
            data = _WandbRecord(new_id)
            write_atomic(path, json.dumps(plain(data)).encode())
        return cls(path, data.id, data.last_step)

    def handing(self, step: int) -> bool:
        """Whether `step` goes to W&B; a new step is recorded before it is handed over.

        A crash then loses a step at worst, and never duplicates one.
        """
        if step <= self.logged_before:
            return False
        if step > self.last_step:
            self.last_step = step
            write_atomic(self.path, json.dumps({"id": self.run_id, "last_step": step}).encode())
        return True


@contextlib.contextmanager
def _wandb_identity(book: WandbBook | None, tags: tuple[str, ...] = ()) -> Iterator[None]:
    """Set W&B's variables while rsl-rl's writer calls wandb.init.

    They name the run's one W&B run, and add mjlab's --agent.wandb-tags (mjlab's train passes
    them the same way, in WANDB_TAGS).
    """
    if book is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_TAGS")}
    os.environ.update(WANDB_RUN_ID=book.run_id, WANDB_RESUME="allow")
    if tags:
        known = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
        os.environ["WANDB_TAGS"] = ",".join(sorted({*known, *tags}))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _skip_logged_steps(writer: Any, book: WandbBook) -> None:
    """Make rsl-rl's W&B writer hand W&B only steps it does not have (tensorboard gets all)."""
    if writer is None or not hasattr(writer, "save_video"):
        return
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    # Online, a resumed W&B run knows its last step too (offline it starts at 0).
    if wandb.run is not None:
        book.logged_before = max(book.logged_before, int(wandb.run.starting_step) - 1)
    add_scalar, save_video = writer.add_scalar, writer.save_video
    logged_videos = getattr(writer, "logged_videos", None)
    if isinstance(logged_videos, set) and book.logged_before >= 0:
        # Videos of earlier starts were uploaded then (rsl-rl uploads each file once).
        logged_videos.update(p.name for p in Path(book.path.parent).rglob("*.mp4"))

    def scalar(tag: str, value: Any, global_step: int | None = None, *args: Any, **kw: Any) -> None:
        if global_step is None or book.handing(global_step):
            add_scalar(tag, value, global_step, *args, **kw)
        elif isinstance(writer, SummaryWriter):
            SummaryWriter.add_scalar(writer, tag, value, global_step, *args, **kw)

    def video(path: Path, it: int) -> None:
        if book.handing(it):
            save_video(path, it)

    writer.add_scalar, writer.save_video = scalar, video


def state_digest(*modules: torch.nn.Module) -> str:
    """sha256 of the modules' state dicts (parameters and buffers), module by module."""
    h = hashlib.sha256()
    for module in modules:
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class DistributedRunner(ContextRunnerMixin, OnPolicyRunner):
    """rsl-rl's OnPolicyRunner for the built-in tasks."""

    def save(self, path: str, infos: dict | None = None) -> None:
        """Save atomically (rsl-rl's signature, for code that calls runner.save)."""
        save_checkpoint(Path(path), self.training_state(infos))


def runner_class(base: type) -> type:
    """Return `base` (an OnPolicyRunner subclass) driven by a DistContext and our learn loop.

    `base` is, for example, mjlab's velocity runner. Construct the result as `base`, plus
    `ctx=` and `quiet=`.
    """
    if not (isinstance(base, type) and issubclass(base, OnPolicyRunner)):
        raise TypeError(f"{base!r} is not an rsl-rl OnPolicyRunner subclass")
    if issubclass(base, ContextRunnerMixin):
        return base
    name = f"Distributed{base.__name__}"
    return type(name, (ContextRunnerMixin, base), {"__module__": __name__, "__qualname__": name})

"""A vectorised MuJoCo Warp environment implementing rsl-rl's VecEnv.

The physics state lives in mujoco_warp arrays; torch reads and writes it through zero-copy
views (`wp.to_torch`), so actions, observations, rewards and resets never copy the state.
Physics substeps replay a captured Warp graph. Per-step torch work is fixed-shape (masks and
`torch.where`, no boolean indexing), so it never synchronises on data.

On CUDA, Warp works on its own stream (CUDA cannot capture a graph on torch's legacy default
stream) and torch on its current one; each physics step waits for torch's writes to the shared
state and torch waits for the step, through events (as mjlab's `sim/sim.py` orders them).
"""

from __future__ import annotations

import abc
import contextlib
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mujoco
import mujoco_warp as mjw
import torch
import warp as wp
from rsl_rl.env import VecEnv
from tensordict import TensorDict

__all__ = ["EnvConfig", "WarpVecEnv", "graph_unusable"]

log = logging.getLogger(__name__)

# mujoco_warp's solver loops are conditional graph nodes, which need a 12.4 driver (mjlab's
# `_GRAPH_CAPTURE_MIN_DRIVER`).
_MIN_GRAPH_DRIVER = (12, 4)


def graph_unusable(is_cuda: bool, mempool: bool, driver: tuple[int, int] | None) -> str | None:
    """Say why a Warp graph cannot step the worlds on this device (None: it can).

    CPU graphs always can. CUDA graphs need Warp's memory pool (allocations inside a capture)
    and a driver that runs conditional nodes.
    """
    if not is_cuda:
        return None
    if driver is None:
        return "the CUDA driver's version is unknown"
    reasons = []
    if not mempool:
        reasons.append("Warp's memory pool is off on this device")
    if tuple(driver) < _MIN_GRAPH_DRIVER:
        reasons.append(f"CUDA driver {driver[0]}.{driver[1]} < 12.4")
    return ", ".join(reasons) or None


@contextlib.contextmanager
def _gc_suspended() -> Iterator[None]:
    # A stale graph that the collector frees during a capture would record its destruction
    # into the new graph, which then breaks on replay (mjlab pull request 821).
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class EnvConfig:
    """Physics and episode settings shared by the built-in tasks."""

    xml: str
    """MJCF of one world."""
    decimation: int
    """Physics substeps per policy step."""
    episode_length: int
    """Policy steps before a time-out."""
    action_scale: float = 1.0
    nconmax: int | None = None
    """Contacts per world to allocate (None: mujoco_warp's default)."""
    njmax: int | None = None
    """Constraints per world to allocate (None: mujoco_warp's default)."""


class WarpVecEnv(VecEnv, abc.ABC):
    """Many worlds of one MJCF model, stepped together on one device.

    Every Warp / MuJoCo Warp call of the environment runs inside `wp.ScopedDevice(device)`.
    Subclasses define the task through torch functions of the state views.
    """

    def __init__(
        self, cfg: EnvConfig, num_envs: int, device: str, seed: int, use_graph: bool = True
    ) -> None:
        self.cfg = cfg
        self.num_envs = num_envs
        self.device = device
        self.max_episode_length = cfg.episode_length
        self.wp_device = wp.get_device(device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

        self.mj_model = mujoco.MjModel.from_xml_string(cfg.xml)
        self.num_actions = self.mj_model.nu
        with wp.ScopedDevice(self.wp_device):
            self.model = mjw.put_model(self.mj_model)
            self.data = mjw.make_data(
                self.mj_model, nworld=num_envs, nconmax=cfg.nconmax, njmax=cfg.njmax
            )
        # Zero-copy views of the state the tasks read and write.
        self.qpos = wp.to_torch(self.data.qpos)
        self.qvel = wp.to_torch(self.data.qvel)
        self.ctrl = wp.to_torch(self.data.ctrl)
        self.qacc_warmstart = wp.to_torch(self.data.qacc_warmstart)
        self.time = wp.to_torch(self.data.time)
        self.qpos0 = torch.tensor(self.mj_model.qpos0, dtype=torch.float32, device=device)

        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=device)
        self._all = torch.ones(num_envs, dtype=torch.bool, device=device)
        # Warp's own stream of the device (None on CPU), as torch sees it, for the events
        # that order the two.
        self._warp_stream: torch.cuda.ExternalStream | None = None
        if self.wp_device.is_cuda:
            self._warp_stream = torch.cuda.ExternalStream(
                wp.get_stream(self.wp_device).cuda_stream, device=torch.device(device)
            )
        self._graph: Any = None
        """The captured substeps (None: plain stepping)."""
        self.graph_off_reason: str | None = None if use_graph else "not asked for"
        """Why the worlds step without a graph (None: a graph steps them)."""
        self._warmup()
        if use_graph:
            self._capture()
        wp.synchronize_device(self.wp_device)  # the state made on Warp's stream, before torch
        self._reset_worlds(self._all)
        self._obs = self._observations()

    def _substeps(self) -> None:
        for _ in range(self.cfg.decimation):
            mjw.step(self.model, self.data)

    def _warmup(self) -> None:
        # Loads (or compiles) every kernel once: a graph can only capture loaded modules.
        with wp.ScopedDevice(self.wp_device):
            mjw.step(self.model, self.data)

    def _capture(self) -> None:
        """Capture the substeps on Warp's stream.

        Where that cannot be done, the worlds step without a graph, and a warning says why.
        """
        why = graph_unusable(
            is_cuda=self.wp_device.is_cuda,
            mempool=self.wp_device.is_cuda and wp.is_mempool_enabled(self.wp_device),
            driver=wp.get_cuda_driver_version() if self.wp_device.is_cuda else None,
        )
        if why is None:
            try:
                with (
                    _gc_suspended(),
                    wp.ScopedDevice(self.wp_device),
                    wp.ScopedCapture() as capture,
                ):
                    self._substeps()
                self._graph = capture.graph
            except Exception as exc:  # a driver or Warp that refuses: still trainable
                why = f"capture failed: {exc}"
        if why is not None:
            self.graph_off_reason = why
            log.warning("%s: physics steps without a graph (%s)", self.device, why)

    @contextlib.contextmanager
    def _on_warp_stream(self) -> Iterator[None]:
        """Run Warp work after torch's queued writes, and torch's later work after it."""
        with wp.ScopedDevice(self.wp_device):
            if self._warp_stream is None:
                yield
                return
            torch_stream = torch.cuda.current_stream(self._warp_stream.device)
            self._warp_stream.wait_stream(torch_stream)
            yield
            torch_stream.wait_stream(self._warp_stream)

    def simulate(self) -> None:
        """Advance every world by `decimation` physics steps."""
        with self._on_warp_stream():
            if self._graph is not None:
                wp.capture_launch(self._graph)
            else:
                self._substeps()

    def get_observations(self) -> TensorDict:
        """Observations of the current state, grouped for rsl-rl."""
        return self._wrap(self._obs)

    def step(self, actions: torch.Tensor) -> tuple[TensorDict, torch.Tensor, torch.Tensor, dict]:
        """Apply actions, simulate, score, and reset finished worlds."""
        self.ctrl.copy_(actions.clamp(-1.0, 1.0) * self.cfg.action_scale)
        self.simulate()
        # rsl-rl may replace this buffer (init_at_random_ep_len): read the attribute each step.
        self.episode_length_buf += 1
        reward, terminated = self._reward_and_termination()
        time_out = self.episode_length_buf >= self.max_episode_length
        done = terminated | time_out
        self._reset_worlds(done)
        self._obs = self._observations()
        extras = {"time_outs": time_out, "log": {}}
        return self._wrap(self._obs), reward, done, extras

    def _wrap(self, obs: torch.Tensor) -> TensorDict:
        return TensorDict({"policy": obs}, batch_size=[self.num_envs], device=self.device)

    def _reset_worlds(self, mask: torch.Tensor) -> None:
        """Re-initialise the worlds where `mask` is set (fixed-shape: no data-dependent sync)."""
        qpos, qvel = self._initial_state()
        m = mask.unsqueeze(1)
        self.qpos.copy_(torch.where(m, qpos, self.qpos))
        self.qvel.copy_(torch.where(m, qvel, self.qvel))
        self.qacc_warmstart.masked_fill_(m, 0.0)
        self.time.masked_fill_(mask, 0.0)
        self.episode_length_buf.masked_fill_(mask, 0)

    def _uniform(self, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        u = torch.rand(shape, generator=self.generator, device=self.device)
        return low + (high - low) * u

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything an exact continuation of this rank's worlds needs."""
        return {
            "qpos": self.qpos.clone(),
            "qvel": self.qvel.clone(),
            "ctrl": self.ctrl.clone(),
            "qacc_warmstart": self.qacc_warmstart.clone(),
            "time": self.time.clone(),
            "episode_length_buf": self.episode_length_buf.clone(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` saved (same task, same number of worlds)."""
        for name in ("qpos", "qvel", "ctrl", "qacc_warmstart", "time"):
            getattr(self, name).copy_(state[name].to(self.device))
        self.episode_length_buf = state["episode_length_buf"].to(self.device).clone()
        self.generator.set_state(state["generator"].cpu())
        self._obs = self._observations()

    @abc.abstractmethod
    def _initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh (qpos, qvel) for every world; only the reset worlds take them."""

    @abc.abstractmethod
    def _observations(self) -> torch.Tensor:
        """Policy observations, shape (num_envs, obs_dim)."""

    @abc.abstractmethod
    def _reward_and_termination(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward, terminated) after the physics step, before resets."""

"""The built-in tasks (no mjlab needed): their environments, defaults and PPO settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

__all__ = ["BUILTIN_TASKS", "TaskInfo", "get_task"]

if TYPE_CHECKING:  # the environments import torch and warp: only when one is made
    from mjlab_hpc.tasks.base import EnvConfig, WarpVecEnv


@dataclass(frozen=True)
class TaskInfo:
    """A task as listed: its defaults, and for a built-in task its environment and PPO settings."""

    name: str
    """The name TASK arguments use."""
    description: str
    """One line for `mjlab-hpc list-tasks`."""
    make_env: Callable[[int, str, int, bool], WarpVecEnv] | None
    """Builds the environment (None for mjlab tasks: mjlab builds those)."""
    num_envs: int
    """Default environments per rank."""
    max_iterations: int
    """Default PPO iterations."""
    agent: dict[str, Any] = field(default_factory=dict)
    """Its settings in place of the default rsl-rl runner config's (`agent_config`):
    `num_steps_per_env`, `actor_hidden`, `critic_hidden` and any PPO setting (`gamma`, ...)."""
    experiment: str = ""
    """Experiment folder name (default: the task's name)."""
    source: Literal["built-in", "mjlab"] = "built-in"
    """Where the task comes from."""
    physics: Callable[[], EnvConfig] | None = None
    """Its environment's physics (the MJCF, contacts and constraints per world); None for
    mjlab tasks."""
    max_world_bytes: int = 1 << 16
    """A bound on the bytes one world of its model takes in MuJoCo Warp (tests check it
    against `tasks.memory.world_bytes`): a request that fits with it needs no measuring."""

    @property
    def experiment_name(self) -> str:
        """The experiment folder of its runs."""
        return self.experiment or self.name


def _cartpole(num_envs: int, device: str, seed: int, use_graph: bool) -> WarpVecEnv:
    from mjlab_hpc.tasks.cartpole import CartpoleEnv

    return CartpoleEnv(num_envs, device, seed, use_graph)


def _ant(num_envs: int, device: str, seed: int, use_graph: bool) -> WarpVecEnv:
    from mjlab_hpc.tasks.ant import AntEnv

    return AntEnv(num_envs, device, seed, use_graph)


def _cartpole_physics() -> EnvConfig:
    from mjlab_hpc.tasks.cartpole import CARTPOLE_CFG

    return CARTPOLE_CFG


def _ant_physics() -> EnvConfig:
    from mjlab_hpc.tasks.ant import ANT_CFG

    return ANT_CFG


BUILTIN_TASKS: dict[str, TaskInfo] = {
    "cartpole": TaskInfo(
        name="cartpole",
        description="Cartpole balance (1 action, no contacts); the default task.",
        make_env=_cartpole,
        physics=_cartpole_physics,
        num_envs=64,
        max_iterations=60,
        # Long rollouts of few envs and a shorter horizon: it learns to balance for whole
        # episodes well within its default iterations (docs/performance.md).
        agent={
            "actor_hidden": (32, 32),
            "critic_hidden": (32, 32),
            "num_steps_per_env": 48,
            "gamma": 0.98,
        },
    ),
    "ant": TaskInfo(
        name="ant",
        description="Ant quadruped running on flat ground (8 actions, contact-rich).",
        make_env=_ant,
        physics=_ant_physics,
        num_envs=1024,
        max_iterations=1000,
        agent={"actor_hidden": (256, 128, 64), "critic_hidden": (256, 128, 64)},
    ),
}


def get_task(name: str) -> TaskInfo:
    """Return the built-in task called `name` (KeyError with the known names otherwise)."""
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; built-in tasks: {', '.join(sorted(BUILTIN_TASKS))}"
        ) from None

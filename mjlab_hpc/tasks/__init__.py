"""Built-in tasks (no mjlab needed) and how to make their environments and PPO settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the environments import torch and warp: only when one is made
    from mjlab_hpc.tasks.base import WarpVecEnv


@dataclass(frozen=True)
class TaskInfo:
    """A built-in task: its environment, defaults and rsl-rl PPO settings."""

    name: str
    description: str
    make_env: Callable[[int, str, int, bool], WarpVecEnv]
    num_envs: int
    max_iterations: int
    agent: dict[str, Any] = field(default_factory=dict)
    """Overrides of the default rsl-rl runner config (see `agent_config`)."""


def _cartpole(num_envs: int, device: str, seed: int, use_graph: bool) -> WarpVecEnv:
    from mjlab_hpc.tasks.cartpole import CartpoleEnv

    return CartpoleEnv(num_envs, device, seed, use_graph)


def _ant(num_envs: int, device: str, seed: int, use_graph: bool) -> WarpVecEnv:
    from mjlab_hpc.tasks.ant import AntEnv

    return AntEnv(num_envs, device, seed, use_graph)


BUILTIN_TASKS: dict[str, TaskInfo] = {
    "cartpole": TaskInfo(
        name="cartpole",
        description="Cartpole balance (1 action, no contacts); the default task.",
        make_env=_cartpole,
        num_envs=1024,
        max_iterations=100,
        agent={"actor_hidden": (32, 32), "critic_hidden": (32, 32), "learning_rate": 1e-3},
    ),
    "ant": TaskInfo(
        name="ant",
        description="Ant quadruped running on flat ground (8 actions, contact-rich).",
        make_env=_ant,
        num_envs=1024,
        max_iterations=1000,
        agent={"actor_hidden": (256, 128, 64), "critic_hidden": (256, 128, 64)},
    ),
}


def agent_config(task: TaskInfo, save_interval: int, experiment_name: str) -> dict[str, Any]:
    """The rsl-rl OnPolicyRunner config (5.x layout) for a built-in task."""
    a = task.agent
    return {
        "num_steps_per_env": a.get("num_steps_per_env", 24),
        "save_interval": save_interval,
        "experiment_name": experiment_name,
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "logger": "tensorboard",
        "check_for_nan": True,
        "actor": {
            "class_name": "rsl_rl.models.MLPModel",
            "hidden_dims": list(a.get("actor_hidden", (128, 128))),
            "activation": "elu",
            "obs_normalization": True,
            "distribution_cfg": {
                "class_name": "rsl_rl.modules.distribution.GaussianDistribution",
                "init_std": 1.0,
            },
        },
        "critic": {
            "class_name": "rsl_rl.models.MLPModel",
            "hidden_dims": list(a.get("critic_hidden", (128, 128))),
            "activation": "elu",
            "obs_normalization": True,
        },
        "algorithm": {
            "class_name": "rsl_rl.algorithms.PPO",
            "num_learning_epochs": 5,
            "num_mini_batches": 4,
            "clip_param": 0.2,
            "gamma": 0.99,
            "lam": 0.95,
            "value_loss_coef": 1.0,
            "entropy_coef": 0.005,
            "learning_rate": a.get("learning_rate", 1e-3),
            "max_grad_norm": 1.0,
            "use_clipped_value_loss": True,
            "schedule": "adaptive",
            "desired_kl": 0.01,
            "rnd_cfg": None,
            "symmetry_cfg": None,
        },
    }


def get_task(name: str) -> TaskInfo:
    """The built-in task called `name` (KeyError with the known names otherwise)."""
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; built-in tasks: {', '.join(sorted(BUILTIN_TASKS))}"
        ) from None


def resolve_task(spec: Any) -> TaskInfo:
    """The task a spec names (KeyError naming the known tasks otherwise)."""
    return get_task(spec.task)

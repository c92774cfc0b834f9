"""rsl-rl agent configs of the built-in tasks, and `--agent.*` overrides applied to them."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from mjlab_hpc.errors import SpecError
from mjlab_hpc.tasks.builtin import TaskInfo

__all__ = ["agent_config", "apply_agent_overrides"]


def agent_config(task: TaskInfo, save_interval: int, experiment_name: str) -> dict[str, Any]:
    """Return the rsl-rl OnPolicyRunner config (5.x layout) for a built-in task.

    The task's own settings (`TaskInfo.agent`) replace these defaults.
    """
    a = task.agent
    # No value clipping (returns of tens to hundreds cannot follow a value clipped to move
    # 0.2 per epoch) and no entropy bonus: both built-in tasks learn faster and steadier
    # without them (docs/performance.md).
    algorithm = {
        "class_name": "rsl_rl.algorithms.PPO",
        "num_learning_epochs": 5,
        "num_mini_batches": 4,
        "clip_param": 0.2,
        "gamma": 0.99,
        "lam": 0.95,
        "value_loss_coef": 1.0,
        "entropy_coef": 0.0,
        "learning_rate": 1e-3,
        "max_grad_norm": 1.0,
        "use_clipped_value_loss": False,
        "schedule": "adaptive",
        "desired_kl": 0.01,
        "rnd_cfg": None,
        "symmetry_cfg": None,
    }
    algorithm.update((k, v) for k, v in a.items() if k in algorithm)
    return {
        "num_steps_per_env": a.get("num_steps_per_env", 24),
        "save_interval": save_interval,
        "experiment_name": experiment_name,
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "logger": "tensorboard",
        "check_for_nan": True,
        # mjlab's names: start a new run from a checkpoint of another run (--agent.resume True).
        "resume": False,
        "load_run": ".*",
        "load_checkpoint": "model_.*.pt",
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
        "algorithm": algorithm,
    }


def _override_pairs(overrides: tuple[str, ...]) -> list[tuple[str, str]]:
    """Pair `--agent.key VALUE` / `--agent.key=VALUE` arguments into (flag, value)."""
    pairs: list[tuple[str, str]] = []
    items = list(overrides)
    while items:
        arg = items.pop(0)
        flag, eq, value = arg.partition("=")
        if not eq and items and not items[0].startswith("--"):
            value = items.pop(0)
        elif not eq:
            raise SpecError(flag, "needs a value (--agent.KEY VALUE)")
        pairs.append((flag, value))
    return pairs


def apply_agent_overrides(cfg: dict[str, Any], overrides: tuple[str, ...]) -> dict[str, Any]:
    """Return a built-in task's rsl-rl config with `--agent.KEY VALUE` overrides applied.

    KEY is a setting at the top level (`num_steps_per_env`) or in exactly one of `algorithm`,
    `actor`, `critic` (`learning_rate`), or a dotted path (`algorithm.gamma`); dashes count as
    underscores and values are YAML (`1e-3`, `[64,64]`, `true`). SpecError names a flag that
    is not an agent setting.
    """
    out = copy.deepcopy(cfg)
    for flag, raw in _override_pairs(overrides):
        if not flag.startswith("--agent."):
            raise SpecError(
                flag, "built-in tasks take --agent.* overrides only (--env.* is for mjlab tasks)"
            )
        path = flag.removeprefix("--agent.").replace("-", "_").split(".")
        value = _parse_value(flag, raw)
        if len(path) == 1:
            key = path[0]
            homes = (
                [out]
                if key in out
                else [out[s] for s in ("algorithm", "actor", "critic") if key in out[s]]
            )
            if len(homes) != 1:
                known = sorted(
                    {k for k, v in out.items() if not isinstance(v, dict)}
                    | {k for s in ("algorithm", "actor", "critic") for k in out[s]}
                )
                problem = "is ambiguous" if homes else "is not an agent setting"
                raise SpecError(flag, f"{key!r} {problem}; settings: {', '.join(known)}")
            homes[0][key] = _same_kind(flag, homes[0][key], value, raw)
            continue
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                raise SpecError(flag, f"{part!r} is not an agent section")
            node = node[part]
        if path[-1] not in node:
            raise SpecError(flag, f"{path[-1]!r} is not a setting of {'.'.join(path[:-1])}")
        node[path[-1]] = _same_kind(flag, node[path[-1]], value, raw)
    return out


def _parse_value(flag: str, raw: str) -> Any:
    """Read a value as YAML (`1e-3`, `[64,64]`, `true`); SpecError naming the flag if not."""
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise SpecError(flag, f"{raw!r} is not a value (YAML: {problem})") from None
    # YAML 1.1 reads `3e-4` (no decimal point) as a string: numbers win over strings here.
    if isinstance(parsed, str):
        for kind in (int, float):
            try:
                return kind(raw)
            except ValueError:
                pass
    return parsed


def _same_kind(flag: str, old: Any, new: Any, raw: str) -> Any:
    """Return `new` where it can replace `old`, or raise SpecError naming the flag.

    A whole number replaces a whole number, a number a number, a list a list, and so on. The
    error comes before the config reaches rsl-rl.
    """
    if old is None or new is None:
        return new
    if isinstance(old, dict):
        raise SpecError(flag, "names a section: set one of its settings (--agent.SECTION.KEY)")
    if isinstance(old, bool):
        ok, what = isinstance(new, bool), "true or false"
    elif isinstance(old, int):
        ok, what = isinstance(new, int) and not isinstance(new, bool), "a whole number"
    elif isinstance(old, float):
        ok, what = isinstance(new, int | float) and not isinstance(new, bool), "a number"
    elif isinstance(old, str):
        return raw  # as typed: `2026-11-23` is a run's name here, not a date
    elif isinstance(old, list | tuple):
        ok, what = isinstance(new, list | tuple), "a list"
        new = list(new) if ok else new
    else:
        return new
    if not ok:
        raise SpecError(flag, f"{raw!r} is not {what} (it replaces {old!r})")
    return new

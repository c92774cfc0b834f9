"""rsl-rl's own PPO on two real processes in a real gloo process group, as our runner drives it:
each rank updates from its own rollout, and the averaged gradients and the agreed learning rate
leave both ranks with the same parameters (the KL all-reduce, the learning-rate broadcast and
the gradient all-reduce of every mini-batch, counted by our collective clock)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import run_two_ranks

from mjlab_hpc.rank.runner import CollectiveClock, state_digest
from mjlab_hpc.tasks.agent import agent_config
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS

NUM_ENVS, OBS_DIM, NUM_ACTIONS = 32, 6, 2


def _train_cfg(algorithm: Any, rank: int, adaptive: bool) -> dict[str, Any]:
    cfg = copy.deepcopy(agent_config(BUILTIN_TASKS["cartpole"], 1000, "t"))
    cfg["algorithm"]["class_name"] = algorithm
    cfg["num_steps_per_env"] = 16
    if not adaptive:
        cfg["algorithm"]["schedule"] = "fixed"
    cfg["multi_gpu"] = {"global_rank": rank, "local_rank": rank, "world_size": 2}
    return cfg


def _one_update(algorithm: Any, rank: int, adaptive: bool) -> dict[str, Any]:
    """Build the algorithm from one seed, collect a rollout of this rank's own data, update."""
    import torch
    from rsl_rl.algorithms import PPO
    from tensordict import TensorDict

    def observe() -> TensorDict:
        return TensorDict({"policy": torch.randn(NUM_ENVS, OBS_DIM)}, batch_size=[NUM_ENVS])

    cfg = _train_cfg(algorithm, rank, adaptive)
    env = SimpleNamespace(num_envs=NUM_ENVS, num_actions=NUM_ACTIONS)
    torch.manual_seed(0)  # the same initial parameters on both ranks
    obs = observe()
    alg = PPO.construct_algorithm(obs, env, cfg, "cpu")
    torch.manual_seed(100 + rank)  # but different data
    with torch.inference_mode():
        for _ in range(cfg["num_steps_per_env"]):
            alg.act(obs)
            obs = observe()
            alg.process_env_step(obs, torch.randn(NUM_ENVS), torch.rand(NUM_ENVS) < 0.05, {})
        alg.compute_returns(obs)
    clock = CollectiveClock()
    with clock.timing():
        losses = alg.update()
    return {
        "class": type(alg).__name__,
        "digest": state_digest(alg.actor, alg.critic),
        "exp_avg": alg.optimizer.state_dict()["state"][0]["exp_avg"].tolist(),
        # The trained weights alone (normalizer statistics are each rank's own here).
        "weights": state_digest(alg.actor.mlp, alg.actor.distribution, alg.critic.mlp),
        "lr": alg.learning_rate,
        "losses": losses,
        "collectives": clock.calls,
    }


def _updates(rank: int) -> dict[bool, dict[str, Any]]:
    return {
        adaptive: _one_update("rsl_rl.algorithms.PPO", rank, adaptive) for adaptive in (True, False)
    }


@pytest.mark.timeout(120)
def test_two_ranks_update_to_the_same_parameters() -> None:
    got = run_two_ranks(_updates)
    batches = 5 * 4  # learning epochs x mini-batches of the cartpole config
    for adaptive in (True, False):
        a, b = got[0][adaptive], got[1][adaptive]
        # Averaged gradients and one learning rate: the ranks' weights stay identical.
        assert (a["weights"], a["lr"], a["exp_avg"]) == (b["weights"], b["lr"], b["exp_avg"])
        # KL all-reduce + learning-rate broadcast + gradient all-reduce per mini-batch.
        assert a["collectives"] == b["collectives"] == (3 if adaptive else 1) * batches
    # The adaptive schedule did move the learning rate (so the averaged KL was used).
    assert got[0][True]["lr"] != 1e-3

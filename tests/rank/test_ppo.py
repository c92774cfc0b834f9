"""FoldedPPO against rsl-rl's own PPO, on two real processes in a real gloo process group:
the same rollouts give bit-identical parameters, learning rates and losses, with one
collective per mini-batch instead of three."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import run_two_ranks

from mjlab_hpc.rank.ppo import CLASS_NAME, FoldedPPO, fold_collectives
from mjlab_hpc.rank.runner import CollectiveClock, state_digest
from mjlab_hpc.tasks import BUILTIN_TASKS, agent_config

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


def _updates(rank: int) -> dict[tuple[str, bool], dict[str, Any]]:
    return {
        (name, adaptive): _one_update(algorithm, rank, adaptive)
        for adaptive in (True, False)
        for name, algorithm in (("stock", "rsl_rl.algorithms.PPO"), ("folded", CLASS_NAME))
    }


@pytest.mark.timeout(120)
def test_folded_ppo_matches_rsl_rl_bit_for_bit() -> None:
    got = run_two_ranks(_updates)
    batches = 5 * 4  # learning epochs x mini-batches of the cartpole config
    for adaptive in (True, False):
        for rank in (0, 1):
            stock, folded = got[rank][("stock", adaptive)], got[rank][("folded", adaptive)]
            assert (stock["class"], folded["class"]) == ("PPO", "FoldedPPO")
            assert folded["digest"] == stock["digest"], (rank, adaptive)
            assert folded["exp_avg"] == stock["exp_avg"]
            assert folded["lr"] == stock["lr"] and folded["losses"] == stock["losses"]
            # KL all-reduce + LR broadcast + gradient all-reduce, folded into one.
            assert stock["collectives"] == (3 if adaptive else 1) * batches
            assert folded["collectives"] == batches
        # Averaged gradients and one learning rate: the ranks' weights stay identical.
        a, b = got[0][("folded", adaptive)], got[1][("folded", adaptive)]
        assert (a["weights"], a["lr"]) == (b["weights"], b["lr"])
    # The adaptive schedule did move the learning rate (so the folded KL was used).
    assert got[0][("folded", True)]["lr"] != 1e-3


def test_fold_collectives_replaces_only_rsl_rl_ppo() -> None:
    cfg = {"algorithm": {"class_name": "PPO", "gamma": 0.9}, "num_steps_per_env": 4}
    folded = fold_collectives(cfg)
    assert folded["algorithm"] == {"class_name": CLASS_NAME, "gamma": 0.9}
    assert cfg["algorithm"]["class_name"] == "PPO"  # the caller's config is not changed
    for name in ("rsl_rl.algorithms.PPO", "rsl_rl.algorithms:PPO"):
        assert (
            fold_collectives({"algorithm": {"class_name": name}})["algorithm"]["class_name"]
            == CLASS_NAME
        )
    custom = {"algorithm": {"class_name": CLASS_NAME}}
    assert fold_collectives(custom) is custom
    assert issubclass(FoldedPPO, __import__("rsl_rl.algorithms").algorithms.PPO)

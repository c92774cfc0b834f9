"""rsl-rl's own PPO on two real processes in a real gloo process group, as our runner drives it.

Each rank updates from its own rollout. The averaged gradients and the agreed learning rate
leave both ranks with the same parameters. Our collective clock counts the KL all-reduce, the
learning-rate broadcast and the gradient all-reduce of every mini-batch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import run_two_ranks

from mjlab_hpc.rank.normalization import agree_normalizers, sync_normalizers
from mjlab_hpc.rank.runner import CollectiveClock, state_digest
from mjlab_hpc.tasks.agent import agent_config
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS

NUM_ENVS, OBS_DIM, NUM_ACTIONS = 32, 6, 2


def _train_cfg(algorithm: Any, rank: int, adaptive: bool) -> dict[str, Any]:
    agent = agent_config(BUILTIN_TASKS["cartpole"], save_interval=1000, experiment_name="t")
    cfg = copy.deepcopy(agent)
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


def _updates(rank: int) -> dict[str, Any]:
    return {
        "updates": {
            adaptive: _one_update("rsl_rl.algorithms.PPO", rank, adaptive)
            for adaptive in (True, False)
        },
        "equivalence": _both_ways(rank),
    }


@pytest.fixture(scope="module")
def got() -> dict[int, Any]:
    """Both tests' work in one pair of rank processes (starting them is most of the time)."""
    return run_two_ranks(_updates)


@pytest.mark.timeout(120)
def test_two_ranks_update_to_the_same_parameters(got: dict[int, Any]) -> None:
    batches = 5 * 4  # learning epochs x mini-batches of the cartpole config
    for adaptive in (True, False):
        a, b = got[0]["updates"][adaptive], got[1]["updates"][adaptive]
        # Averaged gradients and one learning rate: the ranks' weights stay identical.
        assert (a["weights"], a["lr"], a["exp_avg"]) == (b["weights"], b["lr"], b["exp_avg"])
        # KL all-reduce + learning-rate broadcast + gradient all-reduce per mini-batch.
        assert a["collectives"] == b["collectives"] == (3 if adaptive else 1) * batches
    # The adaptive schedule did move the learning rate (so the averaged KL was used).
    assert got[0]["updates"][True]["lr"] != 1e-3


# --- 2 ranks x E environments against 1 process x 2E, given the same rollouts -------------

STEPS, BATCHES = 16, 4  # steps per rollout; mini-batches (the cartpole config's 4)


def _rollouts() -> dict[str, Any]:
    """Both ranks' rollouts as one process with 2 x NUM_ENVS environments sees them: rank r's
    environments are columns r*NUM_ENVS.. of every tensor. Observations of uneven scales and
    offsets, so that the normalizers matter."""
    import torch

    g = torch.Generator().manual_seed(7)
    n = 2 * NUM_ENVS
    scale = torch.tensor([3.0, 0.5, 1.0, 2.0, 0.2, 5.0])
    offset = torch.tensor([1.0, -2.0, 0.0, 0.5, 3.0, -1.0])
    return {
        "obs": torch.randn(STEPS + 1, n, OBS_DIM, generator=g) * scale + offset,
        "actions": torch.randn(STEPS, n, NUM_ACTIONS, generator=g),
        "rewards": torch.randn(STEPS, n, generator=g) + 1.0,
        "dones": torch.rand(STEPS, n, generator=g) < 0.05,
        "time_outs": torch.rand(STEPS, n, generator=g) < 0.02,
    }


def _permutations() -> tuple[list[Any], Any]:
    """Each rank's mini-batch permutation of its STEPS x NUM_ENVS samples, and the one of the
    2 x NUM_ENVS process whose k-th mini-batch is the union of the ranks' k-th mini-batches
    (a rank's flat sample t*NUM_ENVS + e is the process's t*2*NUM_ENVS + r*NUM_ENVS + e)."""
    import torch

    n = STEPS * NUM_ENVS
    ranks = [torch.randperm(n, generator=torch.Generator().manual_seed(100 + r)) for r in (0, 1)]
    size = n // BATCHES
    union = []
    for k in range(BATCHES):
        for r, perm in enumerate(ranks):
            part = perm[k * size : (k + 1) * size]
            union.append(part // NUM_ENVS * 2 * NUM_ENVS + r * NUM_ENVS + part % NUM_ENVS)
    return ranks, torch.cat(union)


def _fresh_ppo(rank: int | None, num_envs: int) -> Any:
    """rsl-rl's PPO with the cartpole config, the same initial parameters on every side;
    `rank` None: one process without a process group."""
    import torch
    from rsl_rl.algorithms import PPO
    from tensordict import TensorDict

    cfg = _train_cfg("rsl_rl.algorithms.PPO", rank or 0, adaptive=True)
    cfg["num_steps_per_env"] = STEPS
    if rank is None:
        cfg["multi_gpu"] = None
    obs = TensorDict({"policy": torch.zeros(num_envs, OBS_DIM)}, batch_size=[num_envs])
    torch.manual_seed(0)
    return PPO.construct_algorithm(
        obs, SimpleNamespace(num_envs=num_envs, num_actions=NUM_ACTIONS), cfg, "cpu"
    )


@contextlib.contextmanager
def _recorded(alg: Any, perm: Any) -> Iterator[dict[str, list[float]]]:
    """While rsl-rl's update runs: its mini-batch permutation is `perm`, and every mini-batch's
    gradient norm before clipping (actor, then critic) and learning rate are recorded."""
    import torch

    seen: dict[str, list[float]] = {"norms": [], "lr": []}
    randperm, clip, step = torch.randperm, torch.nn.utils.clip_grad_norm_, alg.optimizer.step

    def fixed(n: int, **kw: Any) -> Any:
        assert n == perm.numel(), (n, perm.numel())
        seen.setdefault("permutations", []).append(n)
        return perm.clone()

    def clip_recorded(*args: Any, **kw: Any) -> Any:
        norm = clip(*args, **kw)
        seen["norms"].append(float(norm))
        return norm

    def step_recorded(*args: Any, **kw: Any) -> Any:
        seen["lr"].append(alg.optimizer.param_groups[0]["lr"])
        return step(*args, **kw)

    torch.randperm, torch.nn.utils.clip_grad_norm_ = fixed, clip_recorded
    alg.optimizer.step = step_recorded
    try:
        yield seen
    finally:
        torch.randperm, torch.nn.utils.clip_grad_norm_ = randperm, clip
        del alg.optimizer.step
    assert seen.pop("permutations") == [perm.numel()]


def _params(alg: Any) -> dict[str, list]:
    """The actor's and the critic's parameters and normalizer statistics, as lists."""
    models = {"actor": alg.actor, "critic": alg.critic}
    return {
        f"{m}.{k}": v.tolist()
        for m, model in models.items()
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }


def _iteration(alg: Any, cols: slice, perm: Any, *, agree: bool, per_rank_advantages: bool) -> dict:
    """One PPO iteration as our runner drives it (rollout, normalizer agreement, returns,
    update) on the scripted rollouts' columns `cols`: the actions are the script's (their
    log-probabilities under the policy recomputed), not sampled. `per_rank_advantages`: the
    process normalizes each rank's half of the advantages on its own, as the ranks do."""
    import torch
    from tensordict import TensorDict

    data = _rollouts()

    def observe(t: int) -> TensorDict:
        x = data["obs"][t, cols]
        return TensorDict({"policy": x}, batch_size=[x.shape[0]])

    with torch.inference_mode():
        for t in range(STEPS):
            alg.act(observe(t))
            actions = data["actions"][t, cols]
            alg.transition.actions = actions
            alg.transition.actions_log_prob = alg.actor.get_output_log_prob(actions).detach()
            extras = {"time_outs": data["time_outs"][t, cols]}
            alg.process_env_step(
                observe(t + 1), data["rewards"][t, cols], data["dones"][t, cols], extras
            )
        if agree:
            agree_normalizers(alg._raw_actor, alg._raw_critic)
        alg.compute_returns(observe(STEPS))
        if per_rank_advantages:
            st = alg.storage
            raw = st.returns - st.values
            for half in (slice(0, NUM_ENVS), slice(NUM_ENVS, None)):
                a = raw[:, half]
                st.advantages[:, half] = (a - a.mean()) / (a.std() + 1e-8)
    with _recorded(alg, perm) as seen:
        alg.update()
    return {
        "params": _params(alg),
        "exp_avg": [
            s["exp_avg"].flatten().tolist() for s in alg.optimizer.state_dict()["state"].values()
        ],
        **seen,
    }


def _both_ways(rank: int) -> dict[str, Any]:
    """Rank `rank`'s update with step-wise and with per-iteration normalizer agreement; on rank
    0 also the one-process references (after the ranks' work: they make no collectives)."""
    ranks, union = _permutations()
    cols = slice(rank * NUM_ENVS, (rank + 1) * NUM_ENVS)
    out: dict[str, Any] = {}
    for every in ("step", "iteration"):
        alg = _fresh_ppo(rank, NUM_ENVS)
        sync_normalizers(alg._raw_actor, alg._raw_critic, every=every)
        out[every] = _iteration(
            alg, cols, ranks[rank], agree=every == "iteration", per_rank_advantages=False
        )
    if rank == 0:
        import torch

        alg = _fresh_ppo(None, 2 * NUM_ENVS)
        out["initial"] = _params(alg)
        both = slice(None)
        out["one"] = _iteration(alg, both, union, agree=False, per_rank_advantages=True)
        # What differs by construction: rsl-rl normalizes the advantages over the process's
        # whole rollout; and a different shuffle (the scale of any of these differences).
        out["one_union_advantages"] = _iteration(
            _fresh_ppo(None, 2 * NUM_ENVS), both, union, agree=False, per_rank_advantages=False
        )
        other = torch.randperm(union.numel(), generator=torch.Generator().manual_seed(5))
        out["one_reshuffled"] = _iteration(
            _fresh_ppo(None, 2 * NUM_ENVS), both, other, agree=False, per_rank_advantages=True
        )
    return out


def _flat(params: dict[str, Any], keys: list[str]) -> Any:
    import torch

    return torch.cat([torch.tensor(params[k]).flatten() for k in keys])


@pytest.mark.timeout(120)
def test_two_ranks_update_as_one_process_with_both_rollouts(got: dict[int, Any]) -> None:
    """Given the same rollouts, one PPO update on 2 ranks x E environments gives the parameters
    of one process with 2E environments whose k-th mini-batch is the union of the ranks' k-th
    mini-batches: gradient averaging, the normalizers' merge (step-wise), the adaptive learning
    rate and the gradient clipping agree to float32 rounding.

    Tolerance: the ranks average two means over 128 samples where the process takes one mean
    over 256, in float32 (what training uses); the sums' order differs, so every gradient
    differs by a few float32 roundings (~1e-7 relative), and Adam's 20 steps keep that
    relative. Measured: parameters within 1.2e-7, 6e-7 of the update's size; the bound is
    1e-5 of it. A wrong average (a sum over ranks, a KL that is not averaged) shows in the
    gradient norms before clipping, in Adam's moments or in the learning rates."""
    import torch

    one = got[0]["equivalence"]["one"]
    keys = sorted(one["params"])
    weights = [k for k in keys if "obs_normalizer" not in k]
    ref = _flat(one["params"], weights)
    update = (ref - _flat(got[0]["equivalence"]["initial"], weights)).norm()

    def off(side: dict[str, Any]) -> float:
        """How far a side's trained weights are from the process's, per unit of the update."""
        return float((_flat(side["params"], weights) - ref).norm() / update)

    for rank in (0, 1):
        side = got[rank]["equivalence"]["step"]
        assert off(side) < 1e-5, off(side)
        for key in keys:  # the normalizers' statistics included
            a, b = torch.tensor(side["params"][key]), torch.tensor(one["params"][key])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        a, b = torch.tensor(side["exp_avg"][0]), torch.tensor(one["exp_avg"][0])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
        # The ranks' learning rate passes through a float32 broadcast: equal to its rounding.
        assert side["lr"] == pytest.approx(one["lr"], rel=1e-6)
        assert side["norms"] == pytest.approx(one["norms"], rel=1e-5)
    # The adaptive schedule moved the learning rate, and the clipping of the gradient norm
    # to 1.0 was in force (the critic's), so both were compared while they acted.
    assert len(set(one["lr"])) > 1 and max(one["norms"]) > 1.0
    # What differs by construction, measured against the scale of a different shuffle:
    # per-iteration agreement (a rank's rollout sees its own normalizer, not both ranks'
    # observations) and rsl-rl's advantages normalized per rank, not over the whole batch.
    shuffle = off(got[0]["equivalence"]["one_reshuffled"])
    for side in ("iteration", "one_union_advantages"):
        assert 1e-3 < off(got[0]["equivalence"][side]) < shuffle / 2, (side, shuffle)


def test_a_diverged_update_is_named() -> None:
    import torch

    from mjlab_hpc.errors import Diverged
    from mjlab_hpc.rank.runner import _divergence

    alg = _fresh_ppo(None, 4)
    alg._raw_actor, alg._raw_critic = alg.actor, alg.critic  # as our runner's PPO has them
    assert _divergence({"surrogate": 0.1, "value": torch.tensor(2.0)}, alg) is None
    assert "value loss is inf" in str(_divergence({"value": float("inf")}, alg))
    weight = next(alg.actor.parameters())
    with torch.no_grad():
        weight[0] = float("nan")
    assert "actor's" in str(_divergence({}, alg))
    message = str(Diverged(7, "the value loss is nan", 3e-4))
    assert "iteration 7" in message and "learning rate" in message and "0.0003" in message

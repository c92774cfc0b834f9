"""Built-in tasks on real MuJoCo Warp worlds (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
import warp as wp

from mjlab_hpc.tasks import base
from mjlab_hpc.tasks.base import WarpVecEnv, graph_unusable
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS, get_task

wp.config.quiet = True
pytestmark = pytest.mark.training  # steps real worlds (kernels compile on a cold cache)


def make(task: str, n: int, seed: int = 0, graph: bool = True) -> WarpVecEnv:
    with wp.ScopedDevice("cpu"):
        return get_task(task).make_env(n, "cpu", seed, graph)


def rollout(env: WarpVecEnv, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        a = torch.randn(env.num_envs, env.num_actions, generator=g)
        obs, rew, done, extras = env.step(a)
        out += [obs["policy"].clone(), rew.clone(), done.clone(), extras["time_outs"].clone()]
    return out


@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_graph_replay_is_bit_identical(task: str) -> None:
    a = rollout(make(task, 16, graph=True), 40, seed=1)
    b = rollout(make(task, 16, graph=False), 40, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("cuda", "pool", "driver", "why"),
    [
        (False, False, None, None),  # CPU graphs need neither
        (True, True, (13, 0), None),
        (True, True, (12, 4), None),
        (True, False, (13, 0), "Warp's memory pool is off on this device"),
        (True, True, (12, 2), "CUDA driver 12.2 < 12.4"),
        (True, False, (11, 8), "memory pool is off on this device, CUDA driver 11.8 < 12.4"),
        (True, True, None, "the CUDA driver's version is unknown"),
    ],
)
def test_when_a_graph_can_step_the_worlds(
    cuda: bool, pool: bool, driver: tuple[int, int] | None, why: str | None
) -> None:
    got = graph_unusable(cuda, pool, driver)
    assert got == why if why is None else why in str(got)


class _RefusedCapture:
    """A capture that the device refuses, as torch's legacy default stream made every CUDA
    capture fail ("unknown stream"): a CPU capture never fails, so this one is staged."""

    def __enter__(self) -> None:
        raise RuntimeError("Warp error: unknown stream")

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_refused_capture_steps_plainly_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(base.wp, "ScopedCapture", _RefusedCapture)
    with caplog.at_level(logging.WARNING, logger="mjlab_hpc"):
        env = make("cartpole", 16, graph=True)
        refused = rollout(env, 30, seed=2)
    assert env._graph is None
    assert env.graph_off_reason == "capture failed: Warp error: unknown stream"
    said = [r.getMessage() for r in caplog.records if "without a graph" in r.getMessage()]
    reason = "capture failed: Warp error: unknown stream"
    assert said == [f"cpu: physics steps without a graph ({reason})"]
    monkeypatch.undo()
    plain = rollout(make("cartpole", 16, graph=False), 30, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(refused, plain, strict=True))


@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_vecenv_contract(task: str) -> None:
    env = make(task, 8)
    obs = env.get_observations()
    assert obs["policy"].shape[0] == 8 and obs["policy"].dtype == torch.float32
    _, rew, done, extras = env.step(torch.zeros(8, env.num_actions))
    assert rew.shape == (8,) and done.shape == (8,) and extras["time_outs"].shape == (8,)
    assert torch.isfinite(obs["policy"]).all()


def test_cartpole_episodes_end_and_reset() -> None:
    env = make("cartpole", 32)
    # Full force one way: every pole falls well before the time limit.
    dones = torch.zeros(32, dtype=torch.bool)
    for _ in range(100):
        _, _, done, extras = env.step(torch.ones(32, 1))
        dones |= done
        assert not extras["time_outs"].any()
    assert dones.all()
    # Reset worlds start near upright, with a fresh episode counter.
    assert (env.episode_length_buf < 100).all()


def test_time_out_at_episode_length() -> None:
    env = make("cartpole", 4)
    env.episode_length_buf.fill_(env.max_episode_length - 1)
    _, _, done, extras = env.step(torch.zeros(4, 1))
    assert extras["time_outs"].all() and done.all()
    assert (env.episode_length_buf == 0).all()


def test_seeds_give_different_worlds() -> None:
    a = make("cartpole", 8, seed=1).get_observations()["policy"]
    b = make("cartpole", 8, seed=2).get_observations()["policy"]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_state_dict_continues_exactly(task: str) -> None:
    env = make(task, 8, seed=3)
    rollout(env, 10, seed=5)
    state = env.state_dict()
    after = rollout(env, 20, seed=6)
    other = make(task, 8, seed=99)
    other.load_state_dict(state)
    again = rollout(other, 20, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(after, again, strict=True))


def test_ant_has_contacts() -> None:
    env = make("ant", 4)
    for _ in range(30):
        env.step(torch.zeros(4, env.num_actions))
    # Standing on the floor: the legs touch it, the torso rests above it.
    assert int(env.data.nacon.numpy()[0]) > 0
    assert ((env.qpos[:, 2] > 0.26) & (env.qpos[:, 2] < 1.0)).all()


def test_unknown_task() -> None:
    with pytest.raises(KeyError, match="built-in tasks: ant, cartpole"):
        get_task("nope")

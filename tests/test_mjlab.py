"""mjlab's registered tasks through mjlab_hpc.mjlab_tasks (skipped when mjlab is not installed).

Run with a venv that has the [mjlab] extra. The first run compiles Warp kernels (minutes);
later runs load them from the kernel cache.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

import torch

from mjlab_hpc import mjlab_tasks as mt
from mjlab_hpc.distributed import DistContext

CARTPOLE = "Mjlab-Cartpole-Balance"
G1_FLAT = "Mjlab-Velocity-Flat-Unitree-G1"
# No network here: rsl-rl's default for mjlab tasks is wandb.
TB = ["--agent.logger", "tensorboard"]


def _runtime(task: str = CARTPOLE, num_envs: int | None = 8, overrides=(), **kw):
    return mt.make_mjlab_runtime(
        task,
        num_envs=num_envs,
        max_iterations=kw.pop("max_iterations", None),
        seed=kw.pop("seed", 7),
        device="cpu",
        overrides=list(overrides),
        **kw,
    )


def test_registry_lists_tasks() -> None:
    tasks = mt.list_mjlab_tasks()
    assert mt.mjlab_available()
    assert CARTPOLE in tasks
    assert G1_FLAT in tasks
    assert mt.is_mjlab_task(CARTPOLE)
    assert not mt.is_mjlab_task("cartpole")
    assert not mt.is_mjlab_task("Mjlab-No-Such-Task")


@pytest.mark.slow
def test_cartpole_runtime_steps() -> None:
    rt = _runtime(max_iterations=3, seed=11)
    try:
        env = rt.env
        assert env.num_envs == 8
        assert rt.agent_cfg.max_iterations == 3
        assert rt.train_cfg["max_iterations"] == 3
        assert rt.agent_cfg.seed == 11 and rt.env_cfg.seed == 11
        assert rt.runner_cls.__name__ == "MjlabOnPolicyRunner"
        obs = env.get_observations()
        for _ in range(5):
            actions = torch.zeros(env.num_envs, env.num_actions)
            obs, rewards, dones, extras = env.step(actions)
        assert rewards.shape == (8,) and dones.shape == (8,)
        assert all(v.shape[0] == 8 for v in obs.values())
        assert "time_outs" in extras
    finally:
        rt.close()


@pytest.mark.slow
def test_cpu_graph_replay_matches_plain_stepping() -> None:
    results = []
    for cpu_graph in (False, True):
        rt = _runtime(num_envs=8, cpu_graph=cpu_graph)
        try:
            assert rt.env.unwrapped.sim.use_cuda_graph is cpu_graph
            gen = torch.Generator().manual_seed(0)
            for _ in range(20):
                obs, rewards, dones, _ = rt.env.step(
                    2 * torch.rand(8, rt.env.num_actions, generator=gen) - 1
                )
            results.append((obs["actor"].clone(), rewards.clone(), dones.clone()))
        finally:
            rt.close()
    for plain, graph in zip(*results, strict=True):
        assert torch.equal(plain, graph)


@pytest.mark.slow
def test_overrides_apply_and_bad_ones_are_named() -> None:
    rt = _runtime(
        num_envs=8,
        overrides=["--env.scene.num-envs", "4", "--agent.max-iterations", "9", *TB],
    )
    try:
        assert rt.env.num_envs == 4  # the override wins over num_envs=8
        assert rt.train_cfg["max_iterations"] == 9
        assert rt.train_cfg["logger"] == "tensorboard"
    finally:
        rt.close()

    env_cfg, agent_cfg, _, _ = mt.load_mjlab_cfgs(CARTPOLE)
    _, agent = mt.apply_overrides(env_cfg, agent_cfg, ["--agent.actor.hidden-dims", "(32,16)"])
    assert tuple(agent.actor.hidden_dims) == (32, 16)

    bad = {
        "--env.scene.num-envz": ["--env.scene.num-envz", "4"],
        "--agent.max-iterations": ["--agent.max-iterations", "many"],
        "--agent.logger": ["--agent.logger", "nowhere"],
        "--num-envs": ["--num-envs", "4"],
        "--agent.seed": ["--agent.seed", "3"],
    }
    env_cfg, agent_cfg, _, _ = mt.load_mjlab_cfgs(CARTPOLE)
    for flag, args in bad.items():
        with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
            mt.apply_overrides(env_cfg, agent_cfg, args)
    with pytest.raises(KeyError, match="Mjlab-No-Such-Task"):
        _runtime("Mjlab-No-Such-Task")


@pytest.mark.slow
def test_one_process_training_and_checkpoint_reload(tmp_path: Path) -> None:
    ctx = DistContext.from_env({})
    rt = _runtime(num_envs=16, max_iterations=2, overrides=TB)
    try:
        cls = mt.distributed_runner_class(rt.runner_cls)
        assert issubclass(cls, rt.runner_cls) and issubclass(cls, mt.ContextMultiGpuMixin)
        assert mt.distributed_runner_class(rt.runner_cls) is cls
        env_yaml, agent_yaml = mt.dump_params(tmp_path, rt)
        assert "num_envs: 16" in env_yaml.read_text()
        assert "max_iterations: 2" in agent_yaml.read_text()

        runner = mt.make_runner(rt, ctx, str(tmp_path))
        assert isinstance(runner, cls)
        assert not runner.is_distributed and runner.gpu_world_size == 1
        runner.learn(num_learning_iterations=rt.agent_cfg.max_iterations)
        checkpoints = sorted(tmp_path.glob("model_*.pt"))
        assert [p.name for p in checkpoints] == ["model_0.pt", "model_1.pt"]
        assert list(tmp_path.glob("events.out.tfevents.*"))

        fresh = mt.make_runner(rt, ctx, None)
        infos = fresh.load(str(checkpoints[-1]))
        assert fresh.current_learning_iteration == 1
        assert "env_state" in infos  # mjlab's runner keeps the env's step counter
        for a, b in zip(
            runner.alg.actor.state_dict().values(),
            fresh.alg.actor.state_dict().values(),
            strict=True,
        ):
            assert torch.equal(a, b)

        # The pattern of trainer.DistributedRunner: its own __init__ sets self.ctx first.
        class ContextRunner(mt.ContextMultiGpuMixin, rt.runner_cls):
            def __init__(self, env, train_cfg, ctx, log_dir, device) -> None:
                self.ctx = ctx
                super().__init__(env, train_cfg, log_dir=log_dir, device=device)

        other = ContextRunner(rt.env, rt.runner_cfg(), ctx, None, "cpu")
        assert other.gpu_world_size == 1 and other.cfg["multi_gpu"] is None
    finally:
        rt.close()


def test_mixin_needs_a_process_group_when_distributed() -> None:
    from rsl_rl.runners import OnPolicyRunner

    ctx = DistContext.from_env(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    )
    cls = mt.distributed_runner_class(OnPolicyRunner)
    runner = cls.__new__(cls)
    runner.ctx, runner.cfg = ctx, {}
    with pytest.raises(RuntimeError, match="process group"):
        runner._configure_multi_gpu()
    with pytest.raises(TypeError):
        mt.distributed_runner_class(dict)


@pytest.mark.slow
def test_g1_velocity_builds_and_steps() -> None:
    t0 = time.perf_counter()
    rt = _runtime(G1_FLAT, num_envs=2)
    built = time.perf_counter() - t0
    try:
        assert rt.runner_cls.__name__ == "VelocityOnPolicyRunner"
        env = rt.env
        obs, rewards, _, _ = env.step(torch.zeros(env.num_envs, env.num_actions))
        assert rewards.shape == (2,)
        assert set(obs.keys()) >= {"actor", "critic"}
    finally:
        rt.close()
    stepped = time.perf_counter() - t0
    print(f"\n{G1_FLAT}: built in {built:.1f} s, first step done at {stepped:.1f} s")


def test_tracking_task_needs_a_motion_file() -> None:
    assert mt.is_tracking_task("Mjlab-Tracking-Flat-Unitree-G1")
    assert not mt.is_tracking_task(CARTPOLE)
    with pytest.raises(ValueError, match="motion-file"):
        _runtime("Mjlab-Tracking-Flat-Unitree-G1", num_envs=2)


def test_fetch_motion_once_runs_the_fetch_on_the_writer_only(tmp_path: Path) -> None:
    marker = tmp_path / "motion.json"
    calls: list[int] = []
    results: list[str] = []

    def fetch() -> str:
        calls.append(1)
        time.sleep(0.3)
        return "/data/motion.npz"

    # A stale marker of an earlier incarnation must not be taken.
    marker.write_text(json.dumps({"key": "old", "path": "/stale.npz"}))
    waiters = [
        threading.Thread(
            target=lambda: results.append(
                mt.fetch_motion_once(fetch, marker, is_writer=False, key="k1", poll_s=0.05)
            )
        )
        for _ in range(3)
    ]
    for t in waiters:
        t.start()
    assert mt.fetch_motion_once(fetch, marker, is_writer=True, key="k1") == "/data/motion.npz"
    for t in waiters:
        t.join(5)
    assert calls == [1]
    assert results == ["/data/motion.npz"] * 3

    def broken() -> str:
        raise OSError("no network")

    with pytest.raises(OSError):
        mt.fetch_motion_once(broken, marker, is_writer=True, key="k2")
    with pytest.raises(RuntimeError, match="no network"):
        mt.fetch_motion_once(broken, marker, is_writer=False, key="k2", timeout_s=1)
    with pytest.raises(TimeoutError):
        mt.fetch_motion_once(fetch, marker, is_writer=False, key="k3", timeout_s=0.2, poll_s=0.05)

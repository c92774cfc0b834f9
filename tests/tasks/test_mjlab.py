"""mjlab's registered tasks through mjlab_hpc.mjlab_tasks.

Skipped when mjlab is not installed, except under CI=true, where that fails. Run with a venv
that has the [mjlab] extra. The first run compiles Warp kernels (minutes); later runs load
them from the kernel cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import mjlab  # noqa: F401  (make install brings the extra: on CI a missing mjlab fails)
else:
    pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

import torch
from helpers import BIN, cli_env, episode_metrics, only_run
from rsl_rl.runners import OnPolicyRunner

from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.runner import ContextRunnerMixin, runner_class
from mjlab_hpc.rank.workload import make_mjlab_runner
from mjlab_hpc.rundir.checkpoint import Checkpoints, load_verified, load_with
from mjlab_hpc.tasks import mjlab as mt

pytestmark = pytest.mark.mjlab

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
    # A negative number after a space is a value, as mjlab's train reads it.
    _, agent = mt.apply_overrides(
        env_cfg,
        agent_cfg,
        ["--agent.algorithm.entropy-coef", "-0.01", "--agent.clip-actions", "-1e3"],
    )
    assert agent.algorithm.entropy_coef == -0.01 and agent.clip_actions == -1000.0

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
        cls = runner_class(rt.runner_cls)
        assert issubclass(cls, rt.runner_cls) and issubclass(cls, ContextRunnerMixin)
        env_yaml, agent_yaml = mt.dump_params(tmp_path, rt)
        assert "num_envs: 16" in env_yaml.read_text()
        assert "max_iterations: 2" in agent_yaml.read_text()

        runner = make_mjlab_runner(rt, ctx, log_dir=str(tmp_path))
        assert isinstance(runner, rt.runner_cls) and isinstance(runner, ContextRunnerMixin)
        assert not runner.is_distributed and runner.gpu_world_size == 1
        runner.learn_until(2, hooks=[])
        runner.save(str(tmp_path / "model_2.pt"))  # mjlab's own save, as its train script's
        OnPolicyRunner.save(runner, str(tmp_path / "model_1.pt"))  # rsl-rl's plain format
        assert list(tmp_path.glob("events.out.tfevents.*"))

        # Both verify and load weights-only, as a resume or --agent.resume True reads them.
        assert Checkpoints(tmp_path).valid() == [tmp_path / "model_1.pt", tmp_path / "model_2.pt"]
        assert load_verified(tmp_path / "model_1.pt")["iter"] == 2
        fresh = make_mjlab_runner(rt, ctx, log_dir=None)
        infos = load_with(fresh.load, tmp_path / "model_2.pt")
        assert fresh.current_learning_iteration == 2
        assert "env_state" in infos  # mjlab's runner keeps the env's step counter
        for a, b in zip(
            runner.alg.actor.state_dict().values(),
            fresh.alg.actor.state_dict().values(),
            strict=True,
        ):
            assert torch.equal(a, b)
    finally:
        rt.close()


def test_runner_needs_a_process_group_when_distributed() -> None:
    from rsl_rl.runners import OnPolicyRunner

    ctx = DistContext.from_env(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    )
    cls = runner_class(OnPolicyRunner)
    runner = cls.__new__(cls)
    runner.ctx, runner.cfg = ctx, {}
    with pytest.raises(RuntimeError, match="process group"):
        runner._configure_multi_gpu()
    with pytest.raises(TypeError):
        runner_class(dict)


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
    assert mt.load_mjlab_cfgs("Mjlab-Tracking-Flat-Unitree-G1")[3]  # a tracking task
    assert not mt.load_mjlab_cfgs(CARTPOLE)[3]
    with pytest.raises(ValueError, match="motion-file"):
        _runtime("Mjlab-Tracking-Flat-Unitree-G1", num_envs=2)


# --- through the toolkit's CLIs -----------------------------------------------------------

TB_ARGS = ["--agent.logger", "tensorboard"]


def _cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def _only_run(root: Path) -> Path:
    return only_run(root).path


@pytest.mark.slow
def test_cartpole_two_ranks_local_executor_in_sync(tmp_path: Path) -> None:
    cmd = [str(BIN / "mjlab-submit"), CARTPOLE, "--executor", "local", "--gpus-per-node", "0"]
    cmd += ["--tasks-per-node", "2", "--num-envs", "32", "--max-iterations", "2"]
    cmd += ["--torch-threads", "1", "--log-root", str(tmp_path), "--follow", *TB_ARGS]
    proc = _cli(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = _only_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["iterations"] == 2
    assert len(set(summary["param_digest_per_rank"])) == 1  # identical parameters
    assert len(set(summary["first_obs_digest_per_rank"])) == 2  # different seeds
    assert {p.name for p in (run / "params").iterdir()} >= {"env.yaml", "agent.yaml"}


@pytest.mark.slow
def test_mjlabs_default_logger_on_two_ranks(tmp_path: Path) -> None:
    """mjlab's own command as its users type it (no --agent.logger: W&B, offline here) on 2
    ranks: it trains, and exactly one W&B run exists, made by the writer (wandb >= 0.29
    removed the start_method setting that rsl-rl-lib 5.4.2 passes: constraints.txt pins it)."""
    env = {**cli_env(), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    cmd = [str(BIN / "mjlab-train"), CARTPOLE, "--num-procs", "2", "--env.scene.num-envs", "16"]
    cmd += ["--agent.max-iterations", "2", "--torch-threads", "1"]
    cmd += ["--log-root", str(tmp_path / "logs")]
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 2 iterations" in proc.stdout
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs


@pytest.mark.slow
def test_g1_velocity_trains_a_few_iterations(tmp_path: Path) -> None:
    cmd = [str(BIN / "mjlab-train"), G1_FLAT, "--num-envs", "2", "--max-iterations", "2"]
    proc = _cli([*cmd, "--torch-threads", "1", "--log-root", str(tmp_path), *TB_ARGS])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = _only_run(tmp_path)
    assert [r["iteration"] for r in map(json.loads, (run / "progress.jsonl").open())] == [1, 2]
    assert (run / "model_2.pt").exists()
    assert (run / f"{run.name}.onnx").exists()  # the velocity runner's own ONNX export


@pytest.mark.slow
def test_mjlab_task_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    common = [str(BIN / "mjlab-train"), CARTPOLE, "--num-envs", "16", "--torch-threads", "1"]
    common += TB_ARGS
    base = [*common, "--log-root", str(tmp_path / "logs")]
    first = _cli([*base, "--max-iterations", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    again = _cli([*base, "--max-iterations", "4", "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    run = _only_run(tmp_path / "logs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["iterations"] == 4
    ckpt = load_verified(run / "model_4.pt")  # weights only
    # mjlab's runner saved the environment's step counter; it continued from the resume.
    assert ckpt["infos"]["env_state"]["common_step_counter"] > 0
    iterations = [r["iteration"] for r in map(json.loads, (run / "progress.jsonl").open())]
    assert iterations == [1, 2, 3, 4]
    # The metrics logged after the resume are those of a run that never stopped.
    root = tmp_path / "uninterrupted"
    whole = _cli([*common, "--log-root", str(root), "--max-iterations", "4"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    logged = episode_metrics(only_run(tmp_path / "logs"))
    assert logged == episode_metrics(only_run(root))
    assert any(reward is not None for _, reward, _ in logged[2:]), logged


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env.scene.num-envz", "4"], "num-envz"),
        (["--agent.seed", "3"], "--seed"),
        (["--bogus"], "unknown argument"),
    ],
)
def test_bad_mjlab_overrides_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _cli([str(BIN / "mjlab-train"), CARTPOLE, "--log-root", str(tmp_path), *args])
    assert proc.returncode == 2, proc.stderr
    assert message in " ".join(proc.stderr.split())
    assert not any(tmp_path.iterdir())

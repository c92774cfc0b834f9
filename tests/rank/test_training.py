"""Real PPO training through every launcher.

The launchers: one process, the built-in multi-process launcher, torchrun on one node and on
two "nodes" over loopback. Every run steps real MuJoCo Warp worlds and real process groups.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import BIN, cli_env, only_run, progress_records

from mjlab_hpc.launch.local import free_port
from mjlab_hpc.rundir.checkpoint import load_verified
from mjlab_hpc.rundir.layout import RunDir

pytestmark = pytest.mark.training


def train_args(log_root: Path, iters: int = 3, envs: int = 64) -> list[str]:
    args = ["--num-envs", str(envs), "--max-iterations", str(iters), "--log-root", str(log_root)]
    return [*args, "--torch-threads", "1", "--save-interval", "2"]


def check_synced_run(run: RunDir, world: int, iters: int) -> dict:
    summary = json.loads(run.summary.read_text())
    assert summary["world_size"] == world
    assert summary["iterations"] == iters
    # Gradients averaged, normalizers synced: every rank ends with bit-identical parameters.
    assert len(set(summary["param_digest_per_rank"])) == 1
    assert summary["ranks_in_sync"] is True
    # Different seeds per rank: the ranks saw different observations.
    assert len(set(summary["first_obs_digest_per_rank"])) == world
    assert [r["iteration"] for r in progress_records(run)] == list(range(1, iters + 1))
    assert sorted(p.name for p in run.logs.glob("rank*.log")) == [
        f"rank{k}.log" for k in range(world)
    ]
    # Exactly one process became the writer: one fencing token was ever issued.
    assert [p.name for p in (run.path / ".writer.lock.tokens").iterdir()] == ["1"]
    return summary


def load_params(path: Path) -> dict[str, torch.Tensor]:
    ckpt = load_verified(path)  # weights only, as a resume loads it
    return {**ckpt["actor_state_dict"], **ckpt["critic_state_dict"]}


def test_single_process_learns(tmp_path: Path) -> None:
    """With cartpole's defaults (64 envs, 60 iterations) one process ends balancing the pole
    for nearly whole episodes (500 at most), and stays there, within 60 s of training."""
    args = ["--log-root", str(tmp_path), "--torch-threads", "1", "--save-interval", "2"]
    proc = subprocess.run(
        [BIN / "mjlab-train", "cartpole", *args, "--seed", "1"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    progress = progress_records(run)
    last = progress[-1]
    assert last["iteration"] == 60
    assert min(r["mean_reward"] for r in progress[-5:]) >= 450, progress[-5:]
    assert last["elapsed_s"] <= 60, last
    # Layout: params, checkpoints every save-interval and at the end, tensorboard events.
    assert {p.name for p in run.params.iterdir()} == {"train.yaml", "agent.yaml", "env.yaml"}
    assert [p.name for p in run.checkpoints()][-2:] == ["model_58.pt", "model_60.pt"]
    assert list(run.path.glob("events.out.tfevents.*"))
    # Plain progress lines (stdout is not a terminal) from the main rank; the closing line
    # says what was reached and where the reward stayed.
    assert "[train] it 60/60" in proc.stdout
    low = min(r["mean_reward"] for r in progress[-10:])
    assert f"reward {last['mean_reward']:.2f} ({low:.2f}-" in proc.stdout
    assert "over the last 10 iterations); run directory" in proc.stdout


def test_two_ranks_builtin_launcher(tmp_path: Path) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-train", "cartpole", *train_args(tmp_path), "--num-procs", "2"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run(tmp_path)
    summary = check_synced_run(run, world=2, iters=3)
    assert summary["launch_mode"] == "submitit-local"
    # rank 0's progress was streamed to the launcher's terminal.
    assert "[train] it 3/3" in proc.stdout
    # The writer's final checkpoint holds the parameters every rank agreed on.
    assert load_params(run.checkpoint(3))


def test_three_ranks_torchrun(tmp_path: Path) -> None:
    torchrun = [BIN / "torchrun", "--nproc_per_node=3", f"--master_port={free_port()}"]
    proc = subprocess.run(
        [*torchrun, "--no_python", "mjlab-train", "cartpole", *train_args(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_synced_run(only_run(tmp_path), world=3, iters=3)
    assert summary["launch_mode"] == "torchrun"
    # Only rank 0 talks: one progress line per iteration, not three.
    assert proc.stdout.count("[train] it 3/3") == 1
    # --resume: every rank decides the same run from the same arguments (and rank 0 tells
    # the others); it goes on there with the run's own settings, no second run is made.
    torchrun[2] = f"--master_port={free_port()}"
    resume = ["cartpole", "--resume", "--log-root", str(tmp_path), "--max-iterations", "5"]
    more = subprocess.run(
        [*torchrun, "--no_python", "mjlab-train", *resume],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    run = only_run(tmp_path)
    summary = json.loads(run.summary.read_text())
    assert (summary["resumed_from"], summary["iterations"], summary["world_size"]) == (3, 5, 3)
    assert json.loads(run.record.read_text())["spec"]["num_envs"] == 64


def test_two_nodes_torchrun_loopback(tmp_path: Path) -> None:
    port = free_port()
    per_node = ["--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    train = ["--no_python", "mjlab-train", "cartpole", *train_args(tmp_path)]
    procs = [
        subprocess.Popen(
            [BIN / "torchrun", "--nnodes=2", f"--node_rank={n}", *per_node, *train],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run = only_run(tmp_path)
    check_synced_run(run, world=2, iters=3)
    heads = [run.rank_log(k).read_text().splitlines()[0] for k in range(2)]
    assert "node 0/2" in heads[0] and "node 1/2" in heads[1]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["cartpole", "--num-envs", "0"], {}, "--num-envs: must be >= 1"),
        (["nope"], {}, "unknown task 'nope'"),
        (["cartpole", "--gpu-ids", "0", "1"], {}, "--gpu-ids"),
        (["cartpole", "--num-procs", "2", "--gpu-ids", "0"], {}, "--num-procs"),
        (
            ["cartpole"],
            {
                "RANK": "3",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "rank 3 is outside",
        ),
        (
            ["cartpole", "--num-procs", "2"],
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "already one rank",
        ),
        (["cartpole", "--run-name", "a/b"], {}, "--run-name"),
    ],
)
def test_bad_input_exits_2_before_work(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-train", *args, "--log-root", str(tmp_path)],
        env=cli_env() | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in " ".join(proc.stderr.split()), proc.stderr
    assert not any(tmp_path.iterdir())  # nothing was created


def test_agent_overrides_reach_training(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            BIN / "mjlab-train",
            "cartpole",
            *train_args(tmp_path, iters=1, envs=32),
            "--agent.num-steps-per-env",
            "8",
            "--agent.learning_rate=3e-4",
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert progress_records(run)[0]["env_steps"] == 8 * 32
    agent = run.params / "agent.yaml"
    assert "learning_rate: 0.0003" in agent.read_text()
    assert "overrides:" in (run.params / "train.yaml").read_text()

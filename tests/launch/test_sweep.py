"""Sweeps, without Slurm.

Covers parsing --sweep flags, the cartesian product with typed values, agent settings as
overrides, refusing every bad sweep before anything is created, and dry runs of the job array.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env

from mjlab_hpc.cli.submit import main as submit_main
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.validate.sweep import sweep_elements


def hpc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BIN / "mjlab-hpc", *args], env=cli_env(), capture_output=True, text=True, timeout=120
    )


def test_sweep_is_the_cartesian_product_with_typed_values() -> None:
    base = TrainSpec(task="cartpole", run_name="lr")
    elements = sweep_elements(base, ["seed=0,1", "num-envs=64,128", "use_graph=false"])
    assert [e.overrides for e in elements] == [
        (("seed", "0"), ("num_envs", "64"), ("use_graph", "false")),
        (("seed", "0"), ("num_envs", "128"), ("use_graph", "false")),
        (("seed", "1"), ("num_envs", "64"), ("use_graph", "false")),
        (("seed", "1"), ("num_envs", "128"), ("use_graph", "false")),
    ]
    last = elements[-1].train
    assert (last.seed, last.num_envs, last.use_graph) == (1, 128, False)
    assert last.run_name == "lr_seed=1_num_envs=128_use_graph=false"
    assert [e.index for e in elements] == [0, 1, 2, 3]
    timeout = sweep_elements(base, ["dist_timeout_s=2.5"])[0].train.dist_timeout_s
    assert timeout == 2.5


def test_agent_keys_become_agent_overrides() -> None:
    axes = ["agent.learning_rate=1e-3,3e-4", "seed=2"]
    base = TrainSpec(overrides=("--agent.num-steps-per-env", "8"))
    elements = sweep_elements(base, axes)
    assert [e.train.overrides for e in elements] == [
        ("--agent.num-steps-per-env", "8", "--agent.learning_rate=1e-3"),
        ("--agent.num-steps-per-env", "8", "--agent.learning_rate=3e-4"),
    ]
    assert elements[1].train.run_name == "learning_rate=3e-4_seed=2"
    assert [e.resolved.num_envs for e in elements] == [64, 64]


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--sweep", "seed"], "--sweep", "not KEY=V1,V2"),
        (["--sweep", "seed="], "--sweep", "empty value"),
        (["--sweep", "seed=1,,2"], "--sweep", "empty value"),
        (["--sweep", "seed=1,1"], "--sweep", "repeats"),
        (["--sweep", "lr=1,2"], "--sweep", "not a training option"),
        (["--sweep", "run_name=a,b"], "--sweep", "cannot be swept"),
        (["--sweep", "seed=a,b"], "--sweep", "not an integer"),
        (["--sweep", "use-graph=maybe"], "--sweep", "not true or false"),
        (["--sweep", "normalizer-sync=sometimes"], "--sweep", "use one of"),
        (["--sweep", "device=cuda,cpu"], "--sweep", "cannot be swept"),
        (["--sweep", "seed=4,04"], "--sweep", "are the same value"),
        (["--sweep", "seed=\u0663,3"], "--sweep", "not an integer"),
        (["--sweep", "dist-timeout-s=nan,1"], "--sweep", "not a number"),
        (["--sweep", "num_envs=8,0"], "--sweep", "--num-envs"),
        (["--sweep", "seed=1", "--sweep", "seed=2"], "--sweep", "swept twice"),
        (["--sweep", "agent.nope=1e-3"], "--sweep", "not an agent setting"),
        (["--sweep", "seed=1,2", "--array-parallelism", "0"], "--array-parallelism", ">= 1"),
        (["--array-parallelism", "2"], "--array-parallelism", "with --sweep"),
        (["--sweep", "seed=1,2", "--run-dir", "/tmp/x"], "--run-dir", "one run directory"),
    ],
)
def test_bad_sweep_exits_2_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], flag: str, words: str
) -> None:
    code = submit_main(["cartpole", "--executor", "local", "--log-root", str(tmp_path), *args])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert f"error: {flag}" in err and words in err
    assert not any(tmp_path.iterdir())


def test_sweep_dry_run_prints_the_job_array(tmp_path: Path) -> None:
    """No Slurm at all (PATH holds only the venv): the elements and the array's script."""
    cmd = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run", "--nodes", "2"]
    cmd += ["--gpus-per-node", "0", "--sweep", "seed=0,1,2", "--sweep", "num-envs=64,128"]
    cmd += ["--array-parallelism", "2", "--log-root", str(tmp_path)]
    proc = subprocess.run(
        cmd,
        env=cli_env(base={"PATH": str(BIN)}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "#SBATCH --array=0-5%2" in out and "#SBATCH --nodes=2" in out
    elements = [line for line in out.splitlines() if "_seed=" in line and line.startswith("# ")]
    assert len(elements) == 6
    assert elements[0].split()[1:3] == ["0", "seed=0"] and elements[0].endswith("num_envs=64")
    assert elements[5].split()[1] == "5" and elements[5].endswith("_seed=2_num_envs=128")
    assert "/.sweeps/" in out and "%A_%a_%t_log.out" in out
    assert not any(tmp_path.iterdir())


def test_render_refuses_sweeps() -> None:
    proc = hpc("render", "train", "cartpole", "--sweep", "seed=1,2")
    assert proc.returncode == 2 and "--sweep" in proc.stderr


def test_agent_sweep_of_a_builtin_task_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's own example: a learning-rate sweep of a built-in task."""
    args = ["cartpole", "--executor", "slurm", "--dry-run", "--gpus-per-node", "0"]
    args += ["--log-root", str(tmp_path), "--sweep", "seed=0,1"]
    args += ["--sweep", "agent.learning_rate=1e-3,3e-4"]
    code = submit_main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("learning_rate=") >= 4  # 2 x 2 elements, each named by its values
    assert not any(tmp_path.iterdir())

"""What was written to disk by mjlab_hpc 0.1.0 keeps working: a requeued job's pickle names
`mjlab_hpc.launch.RankJob(train=TrainSpec)`, agent configs name `mjlab_hpc.ppo:FoldedPPO`.

`tests/data/old_submitted_0.1.0.pkl` was written by the 0.1.0 code (commit d7b9738) exactly as
submitit writes `<run>/submitit/<job>_submitted.pkl`: `DelayedSubmission(RankJob(TrainSpec(
task="cartpole", num_envs=16, max_iterations=4, seed=5, run_dir="run", torch_threads=1,
save_interval=2)))`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run
from submitit.core.utils import DelayedSubmission

from mjlab_hpc.rank.job import RankJob
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.spec import ResolvedSpec, TrainSpec

OLD_PICKLE = Path(__file__).resolve().parent.parent / "data" / "old_submitted_0.1.0.pkl"
ARGS = ["cartpole", "--num-envs", "16", "--seed", "5", "--torch-threads", "1",
        "--save-interval", "2"]  # fmt: skip


def test_old_pickle_unpickles_into_the_new_job() -> None:
    job = DelayedSubmission.load(OLD_PICKLE).function
    assert isinstance(job, RankJob)
    assert isinstance(job.spec, TrainSpec) and job.spec.run_dir == "run"
    resolved = job.resolved()
    assert isinstance(resolved, ResolvedSpec)
    assert (resolved.num_envs, resolved.max_iterations, resolved.experiment_name) == (
        16, 4, "cartpole"
    )  # fmt: skip


def test_old_agent_class_name_resolves() -> None:
    from rsl_rl.utils import resolve_callable

    from mjlab_hpc.rank.ppo import FoldedPPO

    assert resolve_callable("mjlab_hpc.ppo:FoldedPPO") is FoldedPPO


@pytest.mark.training
def test_old_pickle_resumes_exactly(tmp_path: Path) -> None:
    """A run stopped at iteration 2, continued by the 0.1.0 job's pickle as a requeue would:
    it resumes from the checkpoint and ends with the parameters of an uninterrupted run."""
    first = subprocess.run(
        [BIN / "mjlab-train", *ARGS, "--max-iterations", "2", "--run-dir", "run"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copy(OLD_PICKLE, tmp_path / "job.pkl")
    code = (
        "from submitit.core.utils import DelayedSubmission\n"
        "result = DelayedSubmission.load('job.pkl').result()\n"
        "print('ITERATIONS', result.iterations)\n"
    )
    again = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ITERATIONS 4" in again.stdout
    summary = json.loads(RunDir(tmp_path / "run").summary.read_text())
    assert summary["resumed_from"] == 2 and summary["iterations"] == 4
    ref = subprocess.run(
        [BIN / "mjlab-train", *ARGS, "--max-iterations", "4", "--log-root", str(tmp_path / "ref")],
        env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-2000:]
    reference = json.loads(only_run(tmp_path / "ref").summary.read_text())
    assert summary["param_digest_per_rank"] == reference["param_digest_per_rank"]

"""What a cluster does on purpose is not a fault, on the real Slurm test cluster with real
signals: a job suspended and resumed (`scontrol suspend`, as gang scheduling and
PreemptMode=SUSPEND do) past the writer's lease and the hang timeout goes on as if nothing
happened; every signal a user or admin can send (`scancel --signal`, to the steps, the batch
shell or both; `scontrol requeue`; a time limit cut below the signal delay) has its one
documented meaning (docs/preemption.md, "Signals"), is recorded with its true cause, and
never excludes a node.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, reference_digests, runs_under, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_OK
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.state import read_record

pytestmark = pytest.mark.slurm

COMMON = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1",
          "--save-interval", "5", "--max-iterations", "12"]  # fmt: skip
REFERENCE = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1",
             "--save-interval", "100", "--max-iterations", "12"]  # fmt: skip
# Longer than the writer's lease (30 s) and the hang timeout below.
SUSPEND_S = 32


def follow(cluster: SlurmCluster, args: list[str], root: Path,
           extra: dict[str, str] | None = None) -> subprocess.Popen[str]:  # fmt: skip
    """`mjlab-submit ... --follow` in the background."""
    cmd = [BIN / "mjlab-submit", *args, "--gpus-per-node", "0", "--time", "10", "--log-root",
           str(root), "--follow"]  # fmt: skip
    return subprocess.Popen(cmd, env=cli_env(extra, base=cluster.environ()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def the_run(root: Path) -> RunDir:
    return wait_for(lambda: runs_under(root) and RunDir(runs_under(root)[0]), 60, "the run")


def job_of(run: RunDir) -> str:
    """The Slurm job of a single run (submitit names its files after it)."""
    found = wait_for(lambda: sorted((run.path / "submitit").glob("*_submission.sh")), 60, "job")
    return found[0].name.split("_")[0]


def iteration(run: RunDir) -> int:
    return int((run.read_progress() or [{}])[-1].get("iteration", 0))


def suspended(cluster: SlurmCluster, job: str, seconds: float) -> None:
    """`scontrol suspend` the job for `seconds`, then `scontrol resume` it."""
    cluster.run(["scontrol", "suspend", job])
    try:
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        assert state == "SUSPENDED", state
        time.sleep(seconds)
    finally:
        cluster.run(["scontrol", "resume", job])


def test_a_suspended_job_resumes_as_if_nothing_happened(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job suspended for longer than the writer's lease and --hang-timeout-s, once
    while its ranks start and once after iteration 4: no fault, no restart, no iteration
    computed again, the parameters of a run that never stopped; --follow stays with it
    through both and ends with its done line."""
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--hang-timeout-s", "20"]
    proc = follow(slurm_cluster, args, tmp_path)
    try:
        run = the_run(tmp_path)
        wait_for(lambda: run.rank_log(0).exists() and "rank 0/2" in run.rank_log(0).read_text(),
                 120, "rank 0 to start")  # fmt: skip
        job = job_of(run)
        assert iteration(run) == 0
        suspended(slurm_cluster, job, SUSPEND_S)
        wait_for(lambda: iteration(run) >= 4, 180, "iteration 4")
        suspended(slurm_cluster, job, SUSPEND_S)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_OK and "done: 12 iterations" in out, out[-2000:] + err[-2000:]
    record = read_record(run.path)
    assert record.get("faults", []) == [] and record.get("restarts", []) == [], record
    assert len(record["starts"]) == 1 and record["state"] == "completed", record["starts"]
    assert [p["iteration"] for p in run.read_progress()] == list(range(1, 13))
    summary = json.loads(run.summary.read_text())
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert "exit: completed" in run.rank_log(1).read_text()
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=0" in shown, shown

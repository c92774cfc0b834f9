"""slurmctld away for tens of seconds (a restart, a failover, an upgrade), on the real cluster.

The controller is stopped for real (`cluster.sh ctld-stop`: the slurmds, the jobs and
accounting go on) at the worst moments: while the batch script heals a crash (its next srun
needs slurmctld), and right after `scontrol requeue` (the ranks' stop asks Slurm what the
SIGTERM was). Neither costs a restart or the stop's checkpoint, and each run ends with the
parameters of a run that never stopped.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, progress_records, reference_digests, runs_under, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_OK
from mjlab_hpc.rundir.ends import rank_ends
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.slurm

CARTPOLE = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1"]
COMMON = [*CARTPOLE, "--save-interval", "5", "--max-iterations", "12"]
REFERENCE = [*CARTPOLE, "--save-interval", "100", "--max-iterations", "12"]
ONE_NODE = ["--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "0", "--time", "10"]
# After a requeue: past KillWait (2 s here), within the first try of slurmstepd to say the
# killed step ended (longer, and it tries again only a minute later, then drains the node).
AWAY_AT_STOP_S = 6


def follow(cluster: SlurmCluster, root: Path, extra: dict[str, str] | None = None):
    cmd = [BIN / "mjlab-submit", *COMMON, *ONE_NODE, "--log-root", str(root), "--follow"]
    env = cli_env(extra, base=cluster.environ())
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def the_run(root: Path) -> RunDir:
    return wait_for(lambda: runs_under(root) and RunDir(runs_under(root)[0]), 60, "the run")


def job_of(run: RunDir) -> str:
    found = wait_for(lambda: sorted((run.path / "submitit").glob("*_submission.sh")), 60, "job")
    return found[0].name.split("_")[0]


def controller_away(cluster: SlurmCluster, seconds: float) -> None:
    with cluster.controller_down():
        time.sleep(seconds)


def ended(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_OK, out[-2000:] + err[-2000:]
    return out, err


def test_slurmctld_away_while_a_crash_heals(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """Rank 1 raises after iteration 6 and slurmctld stops as it ends: the heal's next srun
    cannot reach slurmctld, so the batch script tries it again (no fault, no restart counted)
    until slurmctld is back. One fault, healed in the allocation, no requeue; the run ends
    with the parameters of a run that never failed."""
    proc = follow(slurm_cluster, tmp_path, {"MJLAB_HPC_FAULT": "raise@6:rank1:once"})
    run = the_run(tmp_path)
    job = job_of(run)
    wait_for(lambda: any(e.how == "failed" for e in rank_ends(run.path)), 240, "the crash", 0.05)

    def said() -> str:
        return "".join(p.read_text() for p in (run.path / "submitit").glob(f"{job}_*log.err"))

    # The heal met slurmctld away: in its own Slurm calls, or in its srun (which, with a quick
    # healer, comes first), and waited for it without a fault or a restart.
    waited = ("mjlab-hpc heal: slurmctld unreachable", "srun could not reach slurmctld")
    with slurm_cluster.controller_down():
        wait_for(lambda: any(w in said() for w in waited), 150, "the heal waiting for slurmctld")
        time.sleep(10)
    ended(proc)
    (fault,) = read_record(run.path).faults
    assert (fault.reason, fault.kind, fault.iteration) == ("crash", "in-allocation", 6), fault
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=0" in shown, shown


def test_a_requeue_then_slurmctld_away_keeps_the_stop_checkpoint(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """`scontrol requeue` and slurmctld stopped at once: the ranks write the stop checkpoint
    and its record before they ask Slurm anything (which cannot answer before KillWait's
    SIGKILL), the next start resumes from that checkpoint, no node is drained, and the run
    ends with the parameters of a run that never stopped."""
    proc = follow(slurm_cluster, tmp_path)
    run = the_run(tmp_path)
    job = job_of(run)
    wait_for(lambda: len(progress_records(run)) >= 2, 240, "iteration 2")
    slurm_cluster.run(["scontrol", "requeue", job])
    controller_away(slurm_cluster, AWAY_AT_STOP_S)
    ended(proc)
    record = read_record(run.path)
    assert record.faults == (), record.faults
    (stop,) = record.restarts
    assert stop.kind == "requeue" and stop.reason in ("requeue", "preemption"), stop
    assert record.starts[1].resumed_from_iteration == stop.iteration, record.starts
    assert stop.iteration is not None and 2 <= stop.iteration < 12, stop
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    # Ours took less than KillWait (2 s here) to the stop's record. A longer outage drains the
    # node with any job (an `srun sleep` too, 22.05): a step killed while slurmctld is away
    # cannot say it ended before UnkillableStepTimeout ("Kill task failed").
    assert stop.checkpoint_at is not None and stop.signal_at is not None
    assert stop.checkpoint_at - stop.signal_at < 2, stop
    drained = slurm_cluster.run(["sinfo", "-h", "-N", "-t", "drain", "-o", "%N"]).stdout.split()
    for node in drained:
        slurm_cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

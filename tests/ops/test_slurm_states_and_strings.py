"""Slurm's states told truly and user strings kept in their place, on the real two-node Slurm
test cluster and the real CLIs.

The cases: user strings in Slurm's filename patterns, a job that fails at launch, pending
reasons, a healer that must not strand a job that requires its node, truthful states, cancel
and restart counts with slurmctld stopped for real, and a stop signal to `--follow`. Then the
small ones: a closed pipe, sbatch's one-letter keys, bytes vs characters.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, progress_records, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.ops.runs import list_runs
from mjlab_hpc.rundir.layout import CANCEL_RECORD, RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.slurm

SMALL = ["--num-envs", "4", "--torch-threads", "1", "--gpus-per-node", "0", "--time", "10"]


def cli(
    cluster: SlurmCluster, cwd: Path, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = cli_env(base=cluster.environ())
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def submit(cluster: SlurmCluster, cwd: Path, *args: str) -> str:
    proc = cli(cluster, cwd, str(BIN / "mjlab-submit"), "cartpole", *SMALL, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next(w for w in proc.stdout.split() if w.isdigit() and len(w) > 3)


def status(cluster: SlurmCluster, cwd: Path, *args: str) -> dict:
    proc = cli(cluster, cwd, str(BIN / "mjlab-hpc"), "status", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--run-name", "a%j"),
        ("--experiment-name", "x%x"),
        ("--run-name", "p%%q"),
        ("--log-root", "logs%20x"),
        ("--run-name", "t%t"),
    ],
)
def test_slurm_filename_patterns_are_refused_everywhere(
    slurm_cluster: SlurmCluster, tmp_path: Path, flag: str, value: str
) -> None:
    for args in (
        [BIN / "mjlab-submit", "cartpole", *SMALL, flag, value],
        [BIN / "mjlab-submit", "cartpole", *SMALL, "--dry-run", flag, value],
        [BIN / "mjlab-submit", "cartpole", *SMALL, "--executor", "local", flag, value],
        [BIN / "mjlab-hpc", "render", "train", "cartpole", *SMALL, flag, value],
    ):
        proc = cli(slurm_cluster, tmp_path, *map(str, args))
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and said.startswith(f"error: {flag}:"), proc.stderr[-2000:]
        assert "holds '%'" in said and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing submitted


def test_a_job_that_fails_at_launch_says_so(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = submit(slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+4")
    (run,) = list_runs(tmp_path / "logs")
    # Slurm cannot open the job's output (a folder stands where the file goes), as with a log
    # root the nodes cannot write: the job fails before any rank starts.
    for ext in ("out", "err"):
        (run / "submitit" / f"{job}_0_log.{ext}").mkdir()
    wait_for(lambda: slurm_cluster.sacct_state(job) == "FAILED", 90, "the launch failure")
    row = status(slurm_cluster, tmp_path, "--log-root", "logs")
    assert row["state"] == "FAILED" and row["reason"] == "JobLaunchFailure", row
    assert "before any rank started (Slurm: JobLaunchFailure)" in row["cause"]
    logs = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", job)
    assert logs.returncode == 1, logs.stdout + logs.stderr
    assert "JobLaunchFailure" in logs.stdout and "no traceback" in logs.stdout


def test_pending_reasons_are_shown(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = submit(slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+300")
    try:
        slurm_cluster.run(["scontrol", "hold", job])
        row = wait_for(
            lambda: (r := status(slurm_cluster, tmp_path, job))["reason"] == "JobHeldAdmin" and r,
            30,
            "the hold",
        )
        assert row["state"] == "PENDING", row
        logs = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", job)
        assert "PENDING: JobHeldAdmin" in logs.stdout, logs.stdout + logs.stderr
        table = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "status", job)
        assert "PENDING (JobHeldAdmin)" in table.stdout, table.stdout
    finally:
        slurm_cluster.run(["scancel", job])


def test_with_slurmctld_gone_the_records_come_first_and_cancel_marks_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """slurmctld stopped for real while one job runs and one waits. The running job's run
    completes (its record says so; accounting still says RUNNING): status says COMPLETED,
    from the record, and what Slurm says. A cancel of the waiting job fails and marks nothing;
    a job id no run names is not called unknown to Slurm. Back up, Slurm agrees."""
    running = submit(slurm_cluster, tmp_path, "--max-iterations", "4", "--run-name", "running")
    waiting = submit(
        slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+300", "--run-name", "waiting"
    )
    runs = {p.name.rsplit("_", 1)[1]: p for p in list_runs(tmp_path / "logs")}
    try:
        wait_for(lambda: progress_records(RunDir(runs["running"])), 150, "the first iteration")
        with slurm_cluster.controller_down():
            wait_for(
                lambda: read_record(runs["running"]).state == "completed",
                150,
                "the run's end",
            )
            table = cli(
                slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "status", str(runs["running"])
            )
            assert "COMPLETED (run record; sacct says RUNNING)" in " ".join(table.stdout.split())
            proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "cancel", waiting)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "nothing was cancelled" in proc.stdout and "Unable to contact" in proc.stdout
            assert not (runs["waiting"] / CANCEL_RECORD).exists()
            unknown = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", "999999")
            assert unknown.returncode == 2 and "Slurm could not be asked" in unknown.stderr
        assert status(slurm_cluster, tmp_path, waiting)["state"] == "PENDING"
        slurm_cluster.wait_job(running, timeout=120)
        assert status(slurm_cluster, tmp_path, running)["state"] == "COMPLETED"
    finally:
        slurm_cluster.run(["scancel", waiting], check=False)


def test_a_stop_signal_to_follow_ends_once_the_ranks_are_done(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """SIGTERM to `mjlab-submit --follow` a while into the job: it is cancelled with a
    checkpoint, the launcher says so while the job ends, and exits seconds after the
    checkpoint (submitit refreshes its cached state only every half of the job's age, up to a
    minute: the launcher asks Slurm itself once a stop was asked)."""
    cmd = [str(BIN / "mjlab-submit"), "cartpole", *SMALL, "--max-iterations", "100000"]
    follow = subprocess.Popen(
        [*cmd, "--log-root", "logs", "--follow"],
        cwd=tmp_path,
        env=cli_env(base=slurm_cluster.environ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run = wait_for(lambda: list_runs(tmp_path / "logs"), 60, "the run")[0]
        wait_for(lambda: progress_records(RunDir(run)), 150, "the first iteration")
        time.sleep(20)  # submitit's cached state is now refreshed every ~15 s
        follow.send_signal(signal.SIGTERM)
        wait_for(lambda: read_record(run).state == "stopped", 60, "the checkpoint")
        stopped = time.monotonic()
        _, err = follow.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if follow.poll() is None:
            follow.kill()
    said = " ".join(err.split())
    assert follow.returncode == 3, said[-2000:]
    # "; waiting for the job to end" too, unless the job ended as the checkpoint was recorded
    assert "checkpoint saved at iteration" in said, said[-2000:]
    assert took < 12, (took, said[-2000:])


def test_the_healer_keeps_a_node_the_job_requires(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A rank killed on node2, in a job that requires node2: excluding it would leave the job
    pending for ever (BadConstraints); it starts again on node2 and completes."""
    args = ["--max-iterations", "4", "--sbatch-arg", "nodelist=node2"]
    job = submit(slurm_cluster, tmp_path, *args, "--setup", "export MJLAB_HPC_FAULT=kill@2:once")
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED"
    (run,) = list_runs(tmp_path / "logs")
    record = read_record(run, strict=True)
    (fault,) = record.faults
    # Restarted in its allocation (issue 31) or requeued: either way on node2, not excluding it.
    assert fault.kind in ("in-allocation", "requeue") and not fault.excluded_nodes, fault
    assert "requires node2" in str(fault.not_excluded), fault
    assert record.state == "completed"
    row = status(slurm_cluster, tmp_path, job)
    assert row["restarts"] == 1, row


def test_small_ones(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # sbatch's one-letter keys are judged as their long options.
    submit_small = [str(BIN / "mjlab-submit"), "cartpole", *SMALL]
    for key, names in (("o", "output"), ("J", "--job-name"), ("t", "--time")):
        proc = cli(slurm_cluster, tmp_path, *submit_small, "--dry-run", "--sbatch-arg", f"{key}=x")
        assert proc.returncode == 2 and names in proc.stderr, proc.stderr
        assert "not an sbatch option" not in proc.stderr
    # A name too long in bytes, not characters: the message counts what the limit counts.
    proc = cli(slurm_cluster, tmp_path, *submit_small, "--dry-run", "--run-name", "é" * 200)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "400 bytes (200 characters) is too long" in said, said
    # CPUs per task beyond a node's: named as the flag that asked for too much.
    proc = cli(slurm_cluster, tmp_path, *submit_small, "--cpus-per-task", "99")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --cpus-per-task:"), proc.stderr
    # A submission Slurm refuses: its message once, and no folder left behind.
    proc = cli(slurm_cluster, tmp_path, *submit_small, "--sbatch-arg", "reservation=nope")
    assert proc.returncode == 1 and proc.stderr.count("Requested reservation is invalid") == 1
    assert list(tmp_path.iterdir()) == []
    # status --json into a reader that goes away: no BrokenPipeError traceback.
    job = submit(slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+300")
    piped = subprocess.run(
        f"{BIN / 'mjlab-hpc'} status --json | head -c 1",
        shell=True,
        cwd=tmp_path,
        env=cli_env(base=slurm_cluster.environ()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
    slurm_cluster.run(["scancel", job])

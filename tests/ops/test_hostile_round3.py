"""Hostile use, round 3 (issue 35), on the real two-node Slurm test cluster and the real CLIs:
user strings in Slurm's filename patterns, a job that fails at launch, pending reasons, a
healer that must not strand a job that requires its node, truthful cancel and restart counts,
and the small ones (a closed pipe, sbatch's one-letter keys, bytes vs characters).

Where slurmctld must look down to a command, a stand-in on PATH answers as Slurm's own client
does then ("Unable to contact slurm controller"), as tests/ops/test_slurm_ops.py does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.ops.runs import list_runs
from mjlab_hpc.rundir.layout import CANCEL_RECORD
from mjlab_hpc.rundir.state import read_record

pytestmark = pytest.mark.slurm

SMALL = ["--num-envs", "4", "--torch-threads", "1", "--gpus-per-node", "0", "--time", "10"]
DOWN = (
    '#!/bin/sh\necho "{0}: error: Unable to contact slurm controller (connect failure)" >&2\n'
    "exit 1\n"
)


def cli(cluster: SlurmCluster, cwd: Path, *args: str, path_first: Path | None = None,
        timeout: float = 180) -> subprocess.CompletedProcess[str]:  # fmt: skip
    env = cli_env(base=cluster.environ())
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def submit(cluster: SlurmCluster, cwd: Path, *args: str) -> str:
    proc = cli(cluster, cwd, str(BIN / "mjlab-submit"), "cartpole", *SMALL, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next(w for w in proc.stdout.split() if w.isdigit() and len(w) > 3)


def status(cluster: SlurmCluster, cwd: Path, *args: str, path_first: Path | None = None) -> dict:
    proc = cli(cluster, cwd, str(BIN / "mjlab-hpc"), "status", "--json", *args,
               path_first=path_first)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert len(rows) == 1, rows
    return rows[0]


def down(tmp: Path, *names: str) -> Path:
    """Stand-ins for Slurm's clients as they answer while slurmctld is down."""
    folder = tmp / "down"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text(DOWN.format(name))
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--run-name", "a%j"), ("--experiment-name", "x%x"), ("--run-name", "p%%q"),
     ("--log-root", "logs%20x"), ("--run-name", "t%t")],
)  # fmt: skip
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
            lambda: (r := status(slurm_cluster, tmp_path, job))["reason"] == "JobHeldAdmin"
            and r,
            30, "the hold",
        )  # fmt: skip
        assert row["state"] == "PENDING", row
        logs = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", job)
        assert "PENDING: JobHeldAdmin" in logs.stdout, logs.stdout + logs.stderr
        table = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "status", job)
        assert "PENDING (JobHeldAdmin)" in table.stdout, table.stdout
    finally:
        slurm_cluster.run(["scancel", job])


def test_cancel_while_slurmctld_is_down_marks_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job = submit(slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+300")
    try:
        (run,) = list_runs(tmp_path / "logs")
        stand_ins = down(tmp_path, "scancel", "scontrol")
        proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "cancel", job,
                   path_first=stand_ins)  # fmt: skip
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "nothing was cancelled" in proc.stdout and "Unable to contact" in proc.stdout
        assert not (run / CANCEL_RECORD).exists()
        assert status(slurm_cluster, tmp_path, job)["state"] == "PENDING"
        # A job id no run names, while slurmctld cannot be asked: not "Slurm does not know it".
        unknown = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", "999999",
                      path_first=down(tmp_path, "scontrol", "squeue"))  # fmt: skip
        assert unknown.returncode == 2 and "Slurm could not be asked" in unknown.stderr
    finally:
        slurm_cluster.run(["scancel", job])


def test_the_healer_keeps_a_node_the_job_requires(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A rank killed on node2, in a job that requires node2: excluding it would leave the job
    pending for ever (BadConstraints); it is requeued on node2 and completes."""
    job = submit(slurm_cluster, tmp_path, "--max-iterations", "4", "--sbatch-arg",
                 "nodelist=node2", "--setup", "export MJLAB_HPC_FAULT=kill@2:once")  # fmt: skip
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED"
    (run,) = list_runs(tmp_path / "logs")
    record = read_record(run, strict=True)
    (fault,) = record["faults"]
    assert fault["kind"] == "requeue" and not fault.get("excluded_nodes"), fault
    assert "requires node2" in fault["not_excluded"], fault
    assert record["state"] == "completed"
    row = status(slurm_cluster, tmp_path, job)
    assert row["restarts"] == 1, row


def test_small_ones(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # sbatch's one-letter keys are judged as their long options.
    for key, names in (("o", "output"), ("J", "--job-name"), ("t", "--time")):
        proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-submit"), "cartpole", *SMALL,
                   "--dry-run", "--sbatch-arg", f"{key}=x")  # fmt: skip
        assert proc.returncode == 2 and names in proc.stderr, proc.stderr
        assert "not an sbatch option" not in proc.stderr
    # A name too long in bytes, not characters: the message counts what the limit counts.
    proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-submit"), "cartpole", *SMALL,
               "--dry-run", "--run-name", "é" * 200)  # fmt: skip
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "400 bytes (200 characters) is too long" in said, said
    # CPUs per task beyond a node's: named as the flag that asked for too much.
    proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-submit"), "cartpole", *SMALL,
               "--cpus-per-task", "99")  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("error: --cpus-per-task:"), proc.stderr
    # A submission Slurm refuses: its message once, and no folder left behind.
    proc = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-submit"), "cartpole", *SMALL,
               "--sbatch-arg", "reservation=nope")  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.count("Requested reservation is invalid") == 1
    assert list(tmp_path.iterdir()) == []
    # status --json into a reader that goes away: no BrokenPipeError traceback.
    job = submit(slurm_cluster, tmp_path, "--sbatch-arg", "begin=now+300")
    piped = subprocess.run(f"{BIN / 'mjlab-hpc'} status --json | head -c 1", shell=True,
                           cwd=tmp_path, env=cli_env(base=slurm_cluster.environ()),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
    slurm_cluster.run(["scancel", job])

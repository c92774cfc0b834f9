"""Out of memory on the real Slurm test cluster (issue 35, class 4).

A request whose CPU ranks' worlds cannot fit a node (its RealMemory, from sinfo) is refused
before anything is submitted, naming the flag. A rank the kernel's OOM killer ends on a node
(node2's slurmd in a memory cgroup, as a job's --mem is enforced with cgroups) is named as
such by the healer. Its node is not blamed, the job is not requeued, and status and logs say
so.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, memory_cgroup
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_BAD_INPUT
from mjlab_hpc.ops.runs import list_runs
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.tasks.memory import world_bytes
from mjlab_hpc.validate import resolve

pytestmark = [pytest.mark.slurm, pytest.mark.training]

SUBMIT = [str(BIN / "mjlab-submit"), "cartpole", "--torch-threads", "1", "--gpus-per-node", "0"]
SUBMIT += ["--time", "10", "--log-root", "logs"]


def cli(cluster: SlurmCluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args),
        cwd=cwd,
        env=cli_env(base=cluster.environ()),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cpu_ranks_that_cannot_fit_a_node_are_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The test cluster's nodes have RealMemory=4096 (MB): one rank of 3 GiB of cartpole worlds
    fits, two do not."""
    per_world = world_bytes(resolve(TrainSpec(task="cartpole")))
    envs = int(3 * 2**30 / per_world)
    proc = cli(slurm_cluster, tmp_path, *SUBMIT, "--num-envs", str(envs), "--tasks-per-node", "2")
    said = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_BAD_INPUT, proc.stdout[-2000:] + said[-2000:]
    assert said.startswith("error: --tasks-per-node:") and "(RealMemory)" in said, said
    assert "use at most 1 rank, or at most --num-envs" in said
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing submitted


def test_a_rank_killed_for_memory_is_named_and_its_node_not_blamed(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    per_world = world_bytes(resolve(TrainSpec(task="cartpole")))
    envs = 2**30 // per_world  # 1 GiB of worlds: accepted (RealMemory 4096 MB), and more
    slurmd = (slurm_cluster.state_dir / "run" / "slurmd-node2.pid").read_text().strip()
    with memory_cgroup("mjlab-node2", int(1.25 * 2**30)) as group:
        (group / "cgroup.procs").write_text(slurmd)  # its jobs' steps start inside
        args = ["--num-envs", str(envs), "--max-iterations", "3", "--sbatch-arg", "nodelist=node2"]
        proc = cli(slurm_cluster, tmp_path, *SUBMIT, *args)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        job = next(w for w in proc.stdout.split() if w.isdigit() and len(w) > 3)
        assert slurm_cluster.wait_job(job, timeout=300) == "FAILED"
    (run,) = list_runs(tmp_path / "logs")
    record = read_record(run, strict=True)
    (fault,) = record.faults
    assert fault.reason == "out-of-memory" and fault.kind == "failed", fault
    assert not fault.excluded_nodes and fault.hosts == ("node2",), fault
    assert record.failure is not None and record.failure.kind == "out-of-memory"
    assert "killed by the kernel's OOM killer" in str(record.failure.error)
    attempts = slurm_cluster.run(
        ["sacct", "-n", "-P", "-X", "--duplicates", "-j", job, "-o", "State"]
    ).stdout.split()
    assert attempts == ["FAILED"], attempts  # not requeued
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "ExcNodeList=(null)" in shown
    status = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "status", "--json", job)
    (row,) = json.loads(status.stdout)
    assert row["state"] == "FAILED" and row["restarts"] == 0, row
    assert "rank 0 on node2 ran out of memory" in row["cause"], row
    logs = cli(slurm_cluster, tmp_path, str(BIN / "mjlab-hpc"), "logs", job)
    assert "ran out of memory" in logs.stdout and "lower --num-envs" in logs.stdout, logs.stdout

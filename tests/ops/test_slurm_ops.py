"""mjlab-hpc status, logs and cancel, and sweeps, on the real two-node Slurm test cluster.

The jobs start together (one fixture): a job whose rank 1 (on node2) raises, a long job
watched and cancelled, and a three-element job array throttled to two at a time.

Accounting switched off is simulated with stand-ins on PATH that fail as Slurm's own clients
do: `sacct` ("accounting storage is disabled") and, for a job slurmctld has forgotten,
`squeue` ("Invalid job id specified").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import BIN, cli_env, fault_env, progress_records, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.ops.cancel import cancel_slurm
from mjlab_hpc.ops.runs import list_runs
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.slurm.client import SlurmClient

pytestmark = pytest.mark.slurm

SMALL = ["--num-envs", "32", "--torch-threads", "1", "--gpus-per-node", "0", "--time", "10"]

NO_ACCOUNTING = '#!/bin/sh\necho "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1\n'
FORGOTTEN = '#!/bin/sh\necho "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n'


@dataclass(frozen=True)
class ClusterJobs:
    root: Path
    failing: tuple[str, Path]
    """Job id and log root of a 2-node job whose rank 1 raises at iteration 3."""
    long: tuple[str, Path]
    """Job id and log root of a 2-node job of 5000 iterations (watched, then cancelled)."""
    sweep: tuple[str, Path]
    """Array job id and log root of a sweep seed=0,1,2, at most two elements at once."""


def env_for(cluster: SlurmCluster, extra: dict[str, str] | None = None) -> dict[str, str]:
    return cli_env(extra, base=cluster.environ())


def stand_ins(tmp: Path, **scripts: str) -> str:
    """A directory of fake Slurm clients, to put first on PATH."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        (tmp / name).write_text(text)
        (tmp / name).chmod(0o755)
    return str(tmp)


def hpc(cluster: SlurmCluster, *args: str, path_first: str | None = None, timeout: float = 120):
    env = env_for(cluster)
    if path_first:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        [BIN / "mjlab-hpc", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def status_json(cluster: SlurmCluster, *args: str, path_first: str | None = None) -> list[dict]:
    proc = hpc(cluster, "status", "--json", *args, path_first=path_first)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def only_run(root: Path) -> Path:
    runs = wait_for(lambda: list_runs(root), 30, f"a run under {root}")
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def cluster_jobs(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterJobs]:
    root = tmp_path_factory.mktemp("slurm-ops")
    two_nodes = ["cartpole", "--nodes", "2", "--tasks-per-node", "1", *SMALL]
    one_node = ["cartpole", "--nodes", "1", *SMALL]
    sweep = ["--sweep", "seed=0,1,2", "--array-parallelism", "2"]
    commands = {
        "failing": (
            [*two_nodes, "--max-iterations", "50", "--max-restarts", "0"],
            fault_env(root / "fault", rank=1, iteration=3),
        ),
        "long": ([*two_nodes, "--max-iterations", "5000"], {}),
        # Each element raises once: healed per element (the array's script is ours).
        "sweep": (
            [*one_node, "--max-iterations", "3", *sweep],
            {"MJLAB_HPC_FAULT": "raise@2:rank0:once"},
        ),
    }
    procs = {}
    for name, (args, extra) in commands.items():
        out = open(root / f"{name}.out", "w")  # noqa: SIM115 (closed below)
        procs[name] = (
            subprocess.Popen(
                [BIN / "mjlab-submit", *args, "--log-root", str(root / name)],
                env=env_for(slurm_cluster, extra),
                stdout=out,
                stderr=subprocess.STDOUT,
            ),
            out,
        )
    ids = {}
    for name, (proc, out) in procs.items():
        code = proc.wait(timeout=120)
        out.close()
        text = (root / f"{name}.out").read_text()
        assert code == 0, text
        m = re.search(r"job(?: array)?\s+(\d+) \(slurm\)", text)
        assert m, text
        ids[name] = m.group(1)
    jobs = ClusterJobs(
        root,
        failing=(ids["failing"], root / "failing"),
        long=(ids["long"], root / "long"),
        sweep=(ids["sweep"], root / "sweep"),
    )
    try:
        yield jobs
    finally:
        # Not a bare scancel: the ranks would answer its SIGTERM with a requeue.
        client = SlurmClient(env=slurm_cluster.environ())
        cancel_slurm(list(ids.values()), runs=[], slurm=client, grace_s=30)


def test_status_then_cancel_on_slurm(
    slurm_cluster: SlurmCluster, cluster_jobs: ClusterJobs, tmp_path: Path
) -> None:
    """A running 2-node job: status shows it RUNNING with its iteration, from squeue also
    without accounting; cancel ends it for good (no requeue although the ranks answer
    scancel's SIGTERM with a checkpoint) and leaves no rank process; status then says
    CANCELLED, from sacct, and from the run record once Slurm has forgotten the job."""
    job, log_root = cluster_jobs.long
    run = only_run(log_root)
    wait_for(lambda: len(progress_records(RunDir(run))) >= 3, 180, "iteration 3")
    before = len(progress_records(RunDir(run)))
    row = status_json(slurm_cluster, job, "--log-root", str(log_root))[0]
    after = len(progress_records(RunDir(run)))
    assert row["run_dir"] == str(run) and row["job_ids"] == [job] and row["kind"] == "slurm"
    assert row["state"] == "RUNNING" and row["state_source"] == "squeue" and row["active"]
    assert row["nodes"] == 2 and row["ranks"] == 2
    assert before <= row["iteration"] <= after and row["total"] == 5000

    no_sacct = stand_ins(tmp_path / "no-sacct", sacct=NO_ACCOUNTING)
    row = status_json(slurm_cluster, str(run), path_first=no_sacct)[0]
    assert row["state"] == "RUNNING" and row["state_source"] == "squeue"
    table = hpc(slurm_cluster, "status", str(run), path_first=no_sacct)
    assert "RUNNING" in table.stdout and "sacct failed" in table.stdout

    # The ranks (both "nodes" are this machine) and srun, whose command line names the folder.
    procs = local_processes(run)
    assert len([p for p in procs if p.role == "rank"]) == 2, procs
    proc = hpc(slurm_cluster, "cancel", str(run), "--grace-s", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"slurm job {job}: cancelled" in proc.stdout
    wait_for(lambda: not local_processes(run), 60, "no rank process left")
    assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"
    # slurmctld may still say COMPLETING while the last step ends; a requeue by rank 0
    # would show as PENDING or RUNNING instead.
    deadline = time.monotonic() + 30
    while True:
        info = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
        if "JobState=CANCELLED" in info or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "JobState=CANCELLED" in info and "Restarts=0" in info, info
    row = status_json(slurm_cluster, str(run))[0]
    assert row["state"] == "CANCELLED" and not row["active"]
    assert row["state_source"] in ("sacct", "squeue")
    # A cancel is no restart (it was counted as one when its SIGTERM passed for a preemption).
    stop = row["interruptions"][-1]
    assert (stop["reason"], stop["kind"]) == ("cancelled", "stop") and row["restarts"] == 0, row
    forgotten = stand_ins(tmp_path / "forgotten", sacct=NO_ACCOUNTING, squeue=FORGOTTEN)
    row = status_json(slurm_cluster, str(run), path_first=forgotten)[0]
    assert row["state"] == "CANCELLED" and row["state_source"] == "record"
    assert row["iteration"] == len(progress_records(RunDir(run)))


def test_logs_name_the_failing_rank_and_host(
    slurm_cluster: SlurmCluster, cluster_jobs: ClusterJobs
) -> None:
    """Rank 1 runs on node2 and raises at iteration 3; srun ends rank 0. logs JOB shows rank 1
    on node2 first, with its traceback; status shows FAILED at iteration 3."""
    job, log_root = cluster_jobs.failing
    assert slurm_cluster.wait_job(job, timeout=180) == "FAILED"
    run = only_run(log_root)
    proc = hpc(slurm_cluster, "logs", job, "--log-root", str(log_root))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    cause, first = out.splitlines()[:2]
    assert cause.startswith("cause: rank 1 on node2 failed: RuntimeError: injected fault"), out
    assert first.startswith("first traceback: rank 1 on node2 at "), out[:2000]
    cause = "RuntimeError: injected fault on rank 1 at iteration 3"
    assert cause in out.split("later traceback")[0].split("── rank 0")[0]
    assert "── rank 0 · node1 ·" in out and "── rank 1 · node2 ·" in out
    err = hpc(slurm_cluster, "logs", str(run), "--rank", "1", "--stream", "err", "--lines", "0")
    assert err.returncode == 0 and cause in err.stdout
    assert f"{job}_1_log.err" in err.stdout.splitlines()[0]
    row = status_json(slurm_cluster, job, "--log-root", str(log_root))[0]
    assert row["state"] == "FAILED" and row["iteration"] == 3 and row["total"] == 50


def _started_and_ended(run: Path) -> tuple[str, str]:
    record = json.loads((run / "run.json").read_text())
    return record["started_at"], record["ended_at"]


def test_sweep_is_one_throttled_job_array(
    slurm_cluster: SlurmCluster, cluster_jobs: ClusterJobs
) -> None:
    """--sweep seed=0,1,2 --array-parallelism 2: one job array of three elements, each its
    own run directory named after its seed; the third starts only after one of the first two
    ended; status groups the three under the array's id. Each element's rank raised once
    after iteration 2: each is healed in its own allocation, one restart each, to the end."""
    array, log_root = cluster_jobs.sweep
    for index in range(3):
        assert slurm_cluster.wait_job(f"{array}_{index}", timeout=240) == "COMPLETED"
    runs = list_runs(log_root)
    assert len(runs) == 3
    by_seed = {json.loads((r / "run.json").read_text())["spec"]["seed"]: r for r in runs}
    assert sorted(by_seed) == [0, 1, 2]
    for seed, run in by_seed.items():
        assert run.name.endswith(f"_seed={seed}")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["iterations"] == 3 and summary["world_size"] == 1
        element = json.loads((run / "sweep_element.json").read_text())
        assert element["job_id"] == f"{array}_{seed}" and element["index"] == seed
        (fault,) = json.loads((run / "run.json").read_text())["faults"]
        assert (fault["reason"], fault["kind"], fault["iteration"]) == ("crash", "in-allocation", 2)
    script = (by_seed[0] / "submitit" / f"{array}_submission.sh").read_text()
    assert "#SBATCH --array=0-2%2" in script
    starts = {seed: _started_and_ended(run) for seed, run in by_seed.items()}
    assert starts[2][0] >= min(starts[0][1], starts[1][1]), starts  # the throttle held

    rows = status_json(slurm_cluster, array, "--log-root", str(log_root))
    assert [r["sweep"]["index"] for r in rows] == [0, 1, 2]
    assert [r["job_ids"] for r in rows] == [[f"{array}_{i}"] for i in range(3)]
    assert all(r["state"] == "COMPLETED" and r["iteration"] == 3 for r in rows)
    assert [r["restart_reasons"] for r in rows] == [["crash"]] * 3, rows
    table = hpc(slurm_cluster, "status", "--log-root", str(log_root)).stdout
    assert f"sweep {array}" in table and "3 COMPLETED" in table
    nothing = hpc(slurm_cluster, "cancel", array, "--log-root", str(log_root))
    assert nothing.returncode == 0 and "nothing to cancel" in nothing.stdout

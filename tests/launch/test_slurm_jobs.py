"""Training jobs on the real two-node Slurm test cluster.

Covers mjlab-submit, the sbatch template, GPU allocation, bad specs, preemption with requeue
and the lock across both nodes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import BIN, cli_env, only_run, progress_records, wait_for
from slurm_cluster import SlurmCluster

from benchmarks.scale import rank_log_figures
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.slurm


def env_for(cluster: SlurmCluster) -> dict[str, str]:
    return cli_env(base=cluster.environ())


def submit(cluster: SlurmCluster, args: list[str], timeout: float = 300) -> tuple[int, str]:
    proc = subprocess.run(
        [BIN / "mjlab-submit", *args],
        env=env_for(cluster),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def job_id_of(output: str) -> str:
    m = re.search(r"job\s+(\d+) \(slurm\)", output)
    assert m, output
    return m.group(1)


def first_lines(run: RunDir, world: int) -> list[str]:
    return [run.rank_log(k).read_text().splitlines()[0] for k in range(world)]


def test_submit_2x2_cpu(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    t0 = time.time()
    args = ["cartpole", "--nodes", "2", "--tasks-per-node", "2", "--gpus-per-node", "0"]
    args += ["--num-envs", "64", "--max-iterations", "3", "--torch-threads", "1"]
    args += ["--log-root", str(tmp_path), "--time", "10", "--follow"]
    code, out = submit(slurm_cluster, args)
    assert code == 0, out
    job = job_id_of(out)
    run = only_run(tmp_path)
    first_iteration_s = progress_records(run)[0]["time"] - t0
    print(f"[2x2 job] mjlab-submit to first finished iteration: {first_iteration_s:.1f} s")
    heads = first_lines(run, 4)
    # Ranks 0-3 spread over both nodes, the master on node1.
    on_nodes = [("host node1" in h, "host node2" in h) for h in heads]
    assert on_nodes == [(True, False), (True, False), (False, True), (False, True)]
    assert all("via slurm" in h and "master node1:" in h for h in heads)
    summary = json.loads(run.summary.read_text())
    assert summary["world_size"] == 4 and summary["ranks_in_sync"]
    assert summary["launch_mode"] == "slurm" and summary["job_id"] == job
    # What `make scale` reads from the rank logs: every rank's rendezvous, the writer's checkpoint.
    logged = rank_log_figures(run.path, 4)
    assert 0 <= logged["rendezvous_s"] < 60 and logged["arrival_spread_s"] >= 0, logged
    written = [(c["file"], c["bytes"]) for c in logged["checkpoints"]]
    assert written == [("model_3.pt", (run.path / "model_3.pt").stat().st_size)], logged
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"


def test_gpu_allocation_falls_back_to_cpu(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    args = ["cartpole", "--nodes", "1", "--gpus-per-node", "4", "--num-envs", "16"]
    args += ["--max-iterations", "1", "--torch-threads", "1"]
    args += ["--log-root", str(tmp_path), "--time", "10", "--follow"]
    code, out = submit(slurm_cluster, args)
    assert code == 0, out
    run = only_run(tmp_path)
    heads = first_lines(run, 4)
    assert all("CUDA_VISIBLE_DEVICES=0,1,2,3" in h and " on cpu" in h for h in heads), heads
    assert "training on CPU" in run.rank_log(0).read_text()
    assert slurm_cluster.wait_job(job_id_of(out), timeout=60) == "COMPLETED"


def _sbatch_options(script: str) -> list[str]:
    """A script's #SBATCH lines but where its batch log goes (mjlab-submit's: the run's
    submitit folder; a template's: where sbatch runs)."""
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    return sorted(x for x in lines if not x[8:].startswith(("--output", "--error", "--wckey")))


def test_rendered_template_with_sbatch(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A rendered template trains a new run; rendered with --resume (--num-envs not typed:
    the run's 32 kept), it continues that run in its own directory, as mjlab-submit's dry run
    of the same flags plans, with the same #SBATCH lines."""
    args = ["cartpole", "--nodes", "2", "--tasks-per-node", "1", "--gpus-per-node", "0"]
    args += ["--torch-threads", "1", "--log-root", str(tmp_path), "--time", "10"]

    def rendered(*flags: str) -> str:
        """Render, dry-run and sbatch these flags to their end; the dry run."""
        out: list[str] = []
        for command in (["mjlab-hpc", "render", "train"], ["mjlab-submit", "--dry-run"]):
            proc = subprocess.run(
                [BIN / command[0], *command[1:], *args, *flags],
                env=env_for(slurm_cluster),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr
            out.append(proc.stdout)
        template, dry_run = out
        assert _sbatch_options(template) == _sbatch_options(dry_run.split("(dry run: not")[1])
        script = tmp_path / "job.sbatch"
        script.write_text(template)
        job = slurm_cluster.sbatch([str(script)], env=env_for(slurm_cluster), cwd=tmp_path)
        assert slurm_cluster.wait_job(job, timeout=180) == "COMPLETED"
        return dry_run

    rendered("--num-envs", "32", "--max-iterations", "2", "--run-name", "from template")
    run = only_run(tmp_path)
    assert run.path.name.endswith("_from template")
    summary = json.loads(run.summary.read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    assert summary["launch_mode"] == "slurm" and summary["iterations"] == 2
    dry_run = rendered("--resume", "--max-iterations", "3")
    planned = yaml.safe_load(dry_run.split("# ---- where")[0])["train"]["run_dir"]
    assert planned == str(run.path) and only_run(tmp_path).path == run.path
    summary = json.loads(run.summary.read_text())
    assert (summary["iterations"], summary["resumed_from"]) == (3, 2), summary
    assert json.loads(run.record.read_text())["spec"]["num_envs"] == 32


def test_bad_spec_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    name = f"bad-{os.getpid()}"
    # The whole request against the partition (2 nodes): spares too, else it pends for good.
    for args in (
        ["--nodes", "0"],
        ["--time", "forever"],
        ["--container", "/no/such.sif"],
        ["--nodes", "2", "--spare-nodes", "1"],
        ["--nodes", "3"],
    ):
        base = ["cartpole", "--job-name", name, "--gpus-per-node", "0", "--log-root", str(tmp_path)]
        code, out = submit(slurm_cluster, [*base, *args])
        assert code == 2, out
        if "--spare-nodes" in args:
            said = " ".join(out.split())
            assert "--spare-nodes: 2 nodes + 1 spare asked for; partition debug has 2" in said
    queued = slurm_cluster.run(["squeue", "-h", "-n", name]).stdout.strip()
    accounted = slurm_cluster.run(["sacct", "-n", "-X", "--name", name, "-S", "now-1hour"])
    assert queued == "" and accounted.stdout.strip() == ""
    assert not any(tmp_path.iterdir())


def test_preempt_requeue_resume_exact(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """scancel --signal=USR2 mid-run -> checkpoint -> requeue -> exactly K iterations in one
    run directory, parameters bit-identical to an uninterrupted run (same seed and world)."""
    common = ["cartpole", "--num-envs", "64", "--max-iterations", "12", "--seed", "5"]
    common += ["--torch-threads", "1", "--save-interval", "100"]
    ref = subprocess.run(
        [BIN / "mjlab-train", *common, "--num-procs", "2", "--log-root", str(tmp_path / "ref")],
        env=env_for(slurm_cluster),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    reference = json.loads(only_run(tmp_path / "ref").summary.read_text())

    args = [*common, "--nodes", "2", "--gpus-per-node", "0"]
    args += ["--log-root", str(tmp_path / "job"), "--time", "10"]
    code, out = submit(slurm_cluster, args)
    assert code == 0, out
    job = job_id_of(out)
    root = tmp_path / "job" / "cartpole"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = list(root.glob("*/progress.jsonl"))
        if runs and len(runs[0].read_text().splitlines()) >= 4:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the job did not reach iteration 4")
    t_signal = time.time()
    slurm_cluster.run(["scancel", "--signal=USR2", job], check=True)
    assert slurm_cluster.wait_job(job, timeout=240) == "COMPLETED"
    run = only_run(tmp_path / "job")
    summary = json.loads(run.summary.read_text())
    restarts = [json.loads(x) for x in (run.path / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["reason"] == "time-limit"
    assert restarts[0]["checkpoint_at"] - t_signal < 30
    assert summary["restart_count"] == 1 and summary["resumed_from"] == restarts[0]["iteration"]
    assert summary["iterations"] == 12
    iterations = [r["iteration"] for r in progress_records(run)]
    # Every iteration once up to the stop, then the remaining ones: exactly K in all.
    stop = restarts[0]["iteration"]
    assert iterations[:stop] == list(range(1, stop + 1)) and iterations[-1] == 12
    assert sorted(set(iterations)) == list(range(1, 13))
    assert summary["param_digest_per_rank"] == reference["param_digest_per_rank"]
    # Every rank exited promptly on the requeue: no node was drained for a stuck process.
    states = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
    assert all("drain" not in line for line in states), states


def test_ranks_without_slurm_commands(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Ranks in an image without Slurm's client (their PATH has no scontrol, squeue, sinfo or
    sacct, as in a container image; the batch shell reaches srun and scontrol through shell
    functions, as it would outside the image): the rendezvous across both nodes, heartbeats,
    the stop agreement and the exit records work from the environment alone; after the
    time-limit signal rank 0 leaves the requeue to the batch script (exit 75), which has
    Slurm's commands: the job runs again and completes the run."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "git").symlink_to(shutil.which("git") or "/usr/bin/git")  # rsl-rl imports GitPython
    outside = [f'{name}() {{ {shutil.which(name)} "$@"; }}' for name in ("srun", "scontrol")]
    args = ["cartpole", "--num-envs", "16", "--max-iterations", "8", "--torch-threads", "1"]
    args += ["--save-interval", "100", "--nodes", "2", "--gpus-per-node", "0", "--time", "10"]
    args += ["--log-root", str(tmp_path / "job"), "--setup", f"export PATH={bare}"]
    args += ["--setup", outside[0], "--setup", outside[1]]
    code, out = submit(slurm_cluster, args)
    assert code == 0, out
    job = job_id_of(out)
    root = tmp_path / "job" / "cartpole"
    deadline = time.monotonic() + 120
    while not any(len(p.read_text().splitlines()) >= 3 for p in root.glob("*/progress.jsonl")):
        assert time.monotonic() < deadline, "the job did not reach iteration 3"
        time.sleep(0.1)
    slurm_cluster.run(["scancel", "--signal=USR2", job], check=True)
    assert slurm_cluster.wait_job(job, timeout=240) == "COMPLETED"
    run = only_run(tmp_path / "job")
    summary = json.loads(run.summary.read_text())
    assert summary["restart_count"] == 1 and summary["iterations"] == 8, summary
    restarts = [json.loads(x) for x in (run.path / "restarts.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in restarts] == ["time-limit"], restarts
    said = (run.path / "submitit" / f"{job}_0_log.err").read_text()
    assert "no scontrol here: the batch script requeues the job" in said, said[-2000:]
    assert "master node1:" in run.rank_log(0).read_text()  # the first host of the node list
    assert sorted({r["iteration"] for r in progress_records(run)}) == list(range(1, 9))


LOCK_WORKER = """
import json, os, sys, time
from mjlab_hpc.rundir.lock import LeaseLock, OwnerInfo
path, record, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = int(os.environ["SLURM_PROCID"])
node = os.environ["SLURMD_NODENAME"]
for _ in range(rounds):
    lock = LeaseLock(path, owner=OwnerInfo.from_env(rank), lease_s=10)
    lock.acquire(timeout_s=120)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{lock.token} {node} {rank} enter\\n".encode())
    time.sleep(0.002)
    os.write(fd, f"{lock.token} {node} {rank} exit\\n".encode())
    os.close(fd)
    lock.release()
"""


def test_lock_contenders_on_both_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(LOCK_WORKER)
    record = tmp_path / "record.txt"
    srun = ["srun", "-N2", "--ntasks-per-node=4", "--time=5"]
    rounds = "10"
    cmd = [*srun, sys.executable, str(worker), str(tmp_path / "run.lock"), str(record), rounds]
    proc = slurm_cluster.run(cmd, env=env_for(slurm_cluster), timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in record.read_text().splitlines()]
    assert len(lines) == 2 * 8 * 10
    tokens = []
    for enter, leave in zip(lines[0::2], lines[1::2], strict=True):
        assert enter[3] == "enter" and leave[3] == "exit" and enter[:3] == leave[:3]
        tokens.append(int(enter[0]))
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert {line[1] for line in lines} == {"node1", "node2"}


def test_bare_scancel_is_not_undone(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """scancel sends SIGTERM, which looks like a preemption to the ranks: they checkpoint,
    but the cancelled job must stay cancelled (no requeue)."""
    args = ["cartpole", "--nodes", "1", "--gpus-per-node", "0", "--num-envs", "32"]
    args += ["--max-iterations", "100000", "--torch-threads", "1"]
    args += ["--log-root", str(tmp_path), "--time", "10"]
    code, out = submit(slurm_cluster, args)
    assert code == 0, out
    job = job_id_of(out)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "cartpole").glob("2*/progress.jsonl")):
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)
    slurm_cluster.run(["scancel", job], check=True)
    assert slurm_cluster.wait_job(job, timeout=120) == "CANCELLED"
    time.sleep(3)  # a requeue would show up as a new PENDING/RUNNING run by now
    runs = slurm_cluster.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State"])
    states = [line.split()[0] for line in runs.stdout.splitlines() if line.strip()]
    assert states == ["CANCELLED"], runs.stdout  # one run: never requeued
    (run,) = (tmp_path / "cartpole").glob("2*")
    wait_for(lambda: read_record(run).state == "stopped", 30, "the ranks' stop record")
    stop = read_record(run).restarts[-1]
    assert (stop.reason, stop.kind) == ("cancelled", "stop"), stop  # not a preemption

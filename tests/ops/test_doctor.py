"""`mjlab-hpc doctor` on the real two-node Slurm test cluster.

A request that would run passes every check. A log root that the nodes see as a different
folder (a tmpfs mounted over it in the nodes' mount namespace only, as node-local /tmp or
/scratch would be) fails the shared log root check. GPUs that Slurm gives but torch cannot use
fail the GPU check. With --video, a test render on the nodes passes, or fails with a renderer
they lack. The five doctors run at once: their probe jobs are short and fit the cluster
together.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env
from slurm_cluster import SlurmCluster

from mjlab_hpc.ops.doctor import PROBE_DIR

pytestmark = pytest.mark.slurm


def _doctor(cluster: SlurmCluster, *args: str) -> subprocess.Popen[str]:
    # mjlab's W&B logger without a login here is refused before anything (tests/tasks).
    return subprocess.Popen(
        [str(BIN / "mjlab-hpc"), "doctor", "--json", "--wait-s", "120", *args],
        env=cli_env({"WANDB_MODE": "offline"}, base=cluster.environ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _results(proc: subprocess.Popen[str]) -> tuple[int, dict[str, dict[str, str]]]:
    out, err = proc.communicate(timeout=240)
    assert out.strip(), err
    return proc.returncode, {c["name"]: c for c in json.loads(out)["checks"]}


@pytest.mark.mjlab
def test_doctor_passes_and_finds_a_private_log_root_and_unusable_gpus(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    private = tmp_path / "private"
    private.mkdir()
    # A tmpfs over `private` in the nodes' mount namespace: the nodes see another folder.
    ns_pid = (slurm_cluster.state_dir / "run" / "tini-node1.pid").read_text().strip()
    # -r: its root too (the 24.11 cluster's nodes run in a root of their own).
    mount = ["nsenter", "-t", ns_pid, "-m", "-r"]
    subprocess.run(
        [*mount, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(private)],
        check=True,
        timeout=30,
    )
    try:
        cpu = ["--gpus-per-node", "0", "--time", "10"]
        good = _doctor(
            slurm_cluster, "--log-root", str(shared), "--nodes", "2", "--tasks-per-node", "2", *cpu
        )
        bad = _doctor(slurm_cluster, "--log-root", str(private), "--nodes", "2", *cpu)
        # The test cluster's GPUs are fake devices and torch is its CPU build here: a GPU
        # job as asked would not run, and the doctor must say which part is missing.
        gpu = _doctor(
            slurm_cluster, "--log-root", str(shared), "--gpus-per-node", "2", "--time", "10"
        )
        # --video: a frame rendered on the nodes, as rank 0 would; then with a renderer the
        # nodes lack (MUJOCO_GL=osmesa without OSMesa).
        video = ["Mjlab-Cartpole-Balance", "--video", "--log-root", str(shared), *cpu]
        renders = _doctor(slurm_cluster, *video)
        no_render = _doctor(slurm_cluster, *video, "--setup", "export MUJOCO_GL=osmesa")
        code, checks = _results(good)
        bad_code, bad_checks = _results(bad)
        gpu_code, gpu_checks = _results(gpu)
        render_code, render_checks = _results(renders)
        no_render_code, no_render_checks = _results(no_render)
    finally:
        subprocess.run([*mount, "umount", "-l", str(private)], timeout=30)
    assert code == 0, checks
    for name in (
        "Slurm commands",
        "partition",
        "request",
        "probe job",
        "log root shared",
        "Python on nodes",
        "mjlab_hpc on nodes",
        "time-limit signal",
        "requeue",
        "accounting",
        "job arrays",
    ):
        assert checks[name]["result"] == "ok", checks[name]
    assert "4 task(s) on 2 node(s)" in checks["log root shared"]["detail"]
    # Slurm's own limits, as this version shows them (MaxBatchRequeue is a setting since
    # 23.02); the default --max-restarts 10 is above it.
    limits = checks["Slurm limits"]
    shown = "MaxBatchRequeue 5," if slurm_cluster.version >= "23.02" else "5 (built in"
    assert limits["result"] == "ok" and shown in limits["detail"], limits
    assert "KillWait 2 s, SlurmdTimeout 300 s" in limits["detail"], limits
    assert checks["--max-restarts"]["result"] == "warn", checks
    assert checks["GPUs"]["result"] == "skip"
    # No probe job and no probe folder is left behind.
    assert not (shared / PROBE_DIR).exists() or not any((shared / PROBE_DIR).iterdir())
    queued = slurm_cluster.run(["squeue", "-h", "-n", "mjlab-doctor,mjlab-doctor-requeue"])
    assert queued.stdout.strip() == ""

    assert bad_code == 1
    assert bad_checks["log root shared"]["result"] == "fail"
    assert "see a different folder" in bad_checks["log root shared"]["detail"]
    assert "shared filesystem" in bad_checks["log root shared"]["fix"]

    assert gpu_code == 1
    assert gpu_checks["log root shared"]["result"] == "ok"
    assert gpu_checks["GPUs"]["result"] == "fail"
    assert "torch sees no GPU" in gpu_checks["GPUs"]["detail"]
    assert "Slurm gave 0,1" in gpu_checks["GPUs"]["detail"]

    assert render_code == 0, render_checks
    rendered = render_checks["offscreen rendering"]
    assert rendered["result"] == "ok" and "a test render worked on node" in rendered["detail"]
    assert render_checks["mjlab on nodes"]["result"] == "ok"
    assert no_render_code == 1, no_render_checks
    failed = no_render_checks["offscreen rendering"]
    assert failed["result"] == "fail" and "MUJOCO_GL=osmesa" in failed["detail"], failed
    assert "libegl1" in failed["fix"]
    assert "offscreen rendering" not in checks  # not asked for: not probed


def test_doctor_without_slurm_and_with_bad_flags(tmp_path: Path) -> None:
    env = cli_env({"PATH": str(BIN)})  # Debian's Slurm clients are in /usr/bin
    no_slurm = subprocess.run(
        [str(BIN / "mjlab-hpc"), "doctor", "--json", "--log-root", str(tmp_path)],
        env={k: v for k, v in env.items() if k != "SLURM_CONF"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(no_slurm.stdout)
    assert no_slurm.returncode == 1
    assert report["checks"][0]["name"] == "Slurm commands"
    assert report["checks"][0]["result"] == "fail"
    assert "--executor local" in report["checks"][0]["fix"]
    bad = subprocess.run(
        [str(BIN / "mjlab-hpc"), "doctor", "--nodes", "0", "--log-root", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "--nodes" in bad.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_larger_than_the_clusters_job_arrays_is_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # The test cluster's MaxArraySize is Slurm's default, 1001 (indexes 0-1000).
    seeds = ",".join(str(i) for i in range(1002))
    cmd = [str(BIN / "mjlab-submit"), "cartpole", "--gpus-per-node", "0"]
    cmd += ["--log-root", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "--sweep", f"seed={seeds}"],
        env=cli_env(base=slurm_cluster.environ()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--sweep: 1002 elements; this cluster's job arrays hold at most 1001" in proc.stderr
    assert list(tmp_path.iterdir()) == []

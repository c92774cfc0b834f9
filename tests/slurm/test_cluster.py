"""The real Slurm test cluster behaves like the multi-node GPU clusters we target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from slurm_cluster import SCRIPT, SlurmCluster, start_cluster, stop_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def _read(path: Path, timeout: float = 10.0) -> str:
    # Batch output can land a moment after sacct reports the end of the job.
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.read_text()


def test_srun_two_nodes_two_tasks_each(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    show = (
        'echo "$SLURM_PROCID|$SLURM_NODEID|$SLURMD_NODENAME|$SLURM_JOB_NODELIST|'
        '$(getent hosts node1)"'
    )
    out = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=2", "--chdir", str(tmp_path), "bash", "-c", show]
    ).stdout
    rows = sorted((line.split("|") for line in out.splitlines() if line), key=lambda r: int(r[0]))
    assert [r[0] for r in rows] == ["0", "1", "2", "3"], out
    assert [r[1] for r in rows] == ["0", "0", "1", "1"], out
    assert [r[2] for r in rows] == ["node1", "node1", "node2", "node2"], out
    assert {r[3] for r in rows} == {"node[1-2]"}, out
    # node1 must resolve inside jobs (MASTER_ADDR) through the namespace's hosts file.
    assert all(r[4].split()[0] == "127.0.0.1" for r in rows), out


def test_fake_gpus(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """One GPU per task: its real index, or with ConstrainDevices index 0, the only GPU device
    file the task may open (an allowed open of a fake GPU fails ENXIO, a denied one EPERM)."""
    script = tmp_path / "gpus.sh"
    script.write_text(
        "#!/bin/bash\n"
        'echo "batch $CUDA_VISIBLE_DEVICES"\n'
        "srun --gpus-per-task=1 --ntasks=2 bash -c 'out=\"task $SLURM_PROCID "
        '$CUDA_VISIBLE_DEVICES "; for f in "$1"/nvidia*; do (exec 3<"$f") 2>&1 | grep -q '
        '"not permitted" || out+="${f##*/nvidia}"; done; echo "$out"\' gpus '
        f"{slurm_cluster.state_dir / 'gpu'}\n"
    )
    out_file = tmp_path / "gpus.out"
    job = slurm_cluster.sbatch(
        ["-N1", "--ntasks=2", "--gpus-per-node=4", "-o", str(out_file), str(script)],
        cwd=tmp_path,
    )
    assert slurm_cluster.wait_job(job) == "COMPLETED"
    lines = _read(out_file).split("\n")
    assert "batch 0,1,2,3" in lines, lines
    tasks = {w[1]: w[2:] for line in lines if (w := line.split()) and w[0] == "task"}
    assert sorted(tasks) == ["0", "1"], lines
    visible = {task: words[0] for task, words in tasks.items()}
    if slurm_cluster.cgroup:
        assert set(visible.values()) == {"0"}, lines  # renumbered in every task
        opens = [words[1] for words in tasks.values()]
        assert len(set(opens)) == 2 and all(len(o) == 1 for o in opens), lines
    else:
        # Not the same one twice (the index is the real one, not always 0); every file opens.
        assert all(devices in {"0", "1", "2", "3"} for devices in visible.values()), lines
        assert len(set(visible.values())) == 2, lines
        assert all(words[1] == "0123" for words in tasks.values()), lines


# One task: its place (our context), the GPUs Slurm shows it, the GPU device files it may open
# (a fake GPU without a driver: ENXIO when allowed, EPERM when the cgroup denies it), and the
# device our code picks for it.
_DEVICE_PROBE = """
import errno, json, os, sys
from mjlab_hpc.rank.context import DistContext, resolve_device
ctx = DistContext.from_env()
visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
opens = []
for i in range(4):
    try:
        open(os.path.join(sys.argv[1], f"nvidia{i}")).close()
    except OSError as exc:
        if exc.errno == errno.EPERM:
            continue
    opens.append(i)
device = resolve_device("auto", ctx.local_rank, ctx.local_world_size,
                        cuda_count=len(visible.split(",")), cuda_visible_devices=visible)
print(json.dumps({"node": os.environ["SLURMD_NODENAME"], "visible": visible.split(","),
                  "opens": opens, "ordinal": int(device.split(":")[1])}))
"""


@pytest.mark.parametrize("shape", [["--gpus-per-task=1"], ["--gpus-per-node=2"]])
def test_each_task_trains_on_a_gpu_it_may_open(
    slurm_cluster: SlurmCluster, shape: list[str]
) -> None:
    """The device mapping and the local rank on real tasks, as Slurm numbers their GPUs: its
    node's real indices (proctrack/pgid, task/none) or, with task/cgroup and ConstrainDevices,
    only the task's own GPUs, renumbered from 0; CUDA numbers the GPUs a process can use in
    order. Every task must pick a GPU it may use, and no two tasks of a node the same one."""
    gpus = str(slurm_cluster.state_dir / "gpu")
    srun = ["srun", "-N2", "--ntasks-per-node=2", *shape]
    out = slurm_cluster.run([*srun, sys.executable, "-c", _DEVICE_PROBE, gpus]).stdout
    tasks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(tasks) == 4, out
    picked: dict[str, set[int]] = {}
    for task in tasks:
        entry = int(task["visible"][task["ordinal"]])
        # cgroup: the entry counts within the GPUs the task may open; else it is the GPU.
        gpu = task["opens"][entry] if slurm_cluster.cgroup else entry
        assert gpu in task["opens"], task
        picked.setdefault(task["node"], set()).add(gpu)
        if slurm_cluster.cgroup:
            assert len(task["opens"]) == len(task["visible"]), task  # only its own GPUs
    assert all(len(gpus) == 2 for gpus in picked.values()), tasks


def test_sacct_final_states_and_inherited_env(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ok_out = tmp_path / "ok.out"
    ok = slurm_cluster.sbatch(
        ["-o", str(ok_out), "--wrap", 'echo "marker=$MJLAB_TEST_MARKER"; echo "path=$PATH"'],
        cwd=tmp_path,
        env={"MJLAB_TEST_MARKER": "from-the-test"},
    )
    bad = slurm_cluster.sbatch(["-o", str(tmp_path / "bad.out"), "--wrap", "exit 3"], cwd=tmp_path)
    assert slurm_cluster.wait_job(ok) == "COMPLETED"
    assert slurm_cluster.wait_job(bad) == "FAILED"
    rows = slurm_cluster.run(
        ["sacct", "-n", "-P", "-j", str(ok), "-o", "JobID,State,ExitCode"]
    ).stdout.split()
    assert f"{ok}|COMPLETED|0:0" in rows
    assert f"{ok}.batch|COMPLETED|0:0" in rows
    exit_code = slurm_cluster.run(
        ["sacct", "-n", "-P", "-X", "-j", str(bad), "-o", "ExitCode"]
    ).stdout.strip()
    assert exit_code == "3:0"
    # Jobs see the submitter's environment (sbatch --export=ALL), so the same venv and PATH.
    out = _read(ok_out).splitlines()
    assert "marker=from-the-test" in out
    assert f"path={os.environ['PATH']}" in out


def test_requeue_from_inside_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs.txt"
    script = tmp_path / "requeue.sh"
    # Appends to its own file: sbatch truncates the -o file when the job starts again.
    script.write_text(
        "#!/bin/bash\n"
        f'echo "start ${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N)" >> {runs}\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        f'  echo "requeue 0 $(date +%s.%N)" >> {runs}\n'
        '  scontrol requeue "$SLURM_JOB_ID"\n'
        "  sleep 60\n"
        "fi\n"
    )
    job = slurm_cluster.sbatch(["-o", str(tmp_path / "requeue.out"), str(script)], cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=90) == "COMPLETED"
    events = [line.split() for line in runs.read_text().splitlines()]
    assert [e[:2] for e in events] == [["start", "0"], ["requeue", "0"], ["start", "1"]], events
    delay = float(events[2][2]) - float(events[1][2])
    print(f"requeue delay: {delay:.1f} s")
    # cred_expire=10 and a 1 s scheduling interval: about 11 s (120+ s with Slurm's defaults).
    assert delay < 30
    history = slurm_cluster.run(
        ["sacct", "-n", "-P", "-D", "-X", "-j", str(job), "-o", "State"]
    ).stdout.split()
    assert history == ["REQUEUED", "COMPLETED"], history


def _processes_of(state_dir: Path, cluster_id: str, ns: str, pids: set[int]) -> list[str]:
    """Live processes (zombies excluded) that belong to the cluster at state_dir."""
    markers = {
        f"MJLAB_HPC_CLUSTER_ID={cluster_id}".encode(),
        f"SLURM_CONF={state_dir}/etc/slurm.conf".encode(),
    }
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            mnt = os.readlink(proc / "ns" / "mnt")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state in {"Z", "X"}:
            continue
        if int(proc.name) in pids or mnt == ns or markers & environ:
            found.append(f"{proc.name} {state} {cmdline}")
    return found


def _escaped_sleep(job_id: int) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and cmdline.startswith(b"sleep\0"):
            return True
    return False


def test_down_leaves_no_process(
    slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second, private cluster: the session's may be shared (make cluster-up). Its parent
    # is the session cluster's, known to suit munged (no 0700 directory above it). Three
    # nodes: the node count is a setting (make scale uses 8), and down stops any count.
    # proctrack/pgid, where a job process can escape (cgroups would end it with the job).
    monkeypatch.setenv("MJLAB_HPC_CLUSTER_CGROUP", "0")
    state = Path(tempfile.mkdtemp(prefix="mjlab-hpc-own-", dir=slurm_cluster.state_dir.parent))
    env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(state), "MJLAB_HPC_CLUSTER_NODES": "3"}
    try:
        own = start_cluster(state, nodes=3)
        assert own.started_here
        again = subprocess.run(
            ["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 0 and "already up" in again.stdout, again
        other = subprocess.run(
            ["bash", str(SCRIPT), "up"],
            capture_output=True,
            text=True,
            env={**env, "MJLAB_HPC_CLUSTER_NODES": "2"},
            timeout=60,
        )
        assert other.returncode == 1 and "with 3 nodes, not 2" in other.stderr, other
        bad = subprocess.run(
            ["bash", str(SCRIPT), "up"],
            capture_output=True,
            text=True,
            env={**env, "MJLAB_HPC_CLUSTER_NODES": "0"},
            timeout=60,
        )
        assert bad.returncode == 2 and "a node count from 1 to 64" in bad.stderr, bad
        names = own.run(["srun", "-N3", "bash", "-c", "echo $SLURMD_NODENAME"]).stdout.split()
        assert sorted(names) == ["node1", "node2", "node3"], names
        cluster_id = (state / "cluster-id").read_text().strip()
        ns = (state / "run" / "mntns").read_text().strip()
        pids = {int(p.read_text()) for p in (state / "run").glob("*.pid")}

        # A job process that leaves its process group outlives the job (proctrack/pgid).
        # The batch script waits until the child has left (setsid done): ending at once would
        # let Slurm kill the process group before the child leaves it (seen under load).
        escaped = state / "escaped.pid"
        wrap = (
            f"setsid sh -c 'echo $$ > {escaped}; exec sleep 300' </dev/null &>/dev/null & "
            f"while [ ! -s {escaped} ]; do sleep 0.1; done"
        )
        job = own.sbatch(["-o", str(state / "escape.out"), "--wrap", wrap])
        assert own.wait_job(job) == "COMPLETED"
        deadline = time.monotonic() + 10
        while not _escaped_sleep(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _escaped_sleep(job)
        assert _processes_of(state, cluster_id, ns, pids)
    finally:
        started = time.monotonic()
        stop_cluster(state)
        teardown_s = time.monotonic() - started
    print(f"teardown: {teardown_s:.2f} s")
    assert _processes_of(state, cluster_id, ns, pids) == []
    assert not _escaped_sleep(job)

    # Idempotent: a second down finds nothing to stop, and status says down.
    started = time.monotonic()
    stop_cluster(state)
    assert time.monotonic() - started < 5
    status = subprocess.run(
        ["bash", str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=30
    )
    assert status.returncode == 3 and status.stdout.startswith("down"), status
    shutil.rmtree(state)
    Path(f"{state}.lock").unlink(missing_ok=True)  # cluster.sh's lock lives beside the dir

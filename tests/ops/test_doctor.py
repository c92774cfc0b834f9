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
import secrets
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, Team, cli_env
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
    assert code == 0, {n: c for n, c in checks.items() if c["result"] == "fail"}
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


def test_write_profile_from_the_clusters_accounts_qos_and_partition(
    slurm_cluster: SlurmCluster, team: Team
) -> None:
    """A user who is not root, with two accounts and two QOS in slurmdbd: the doctor writes a
    profile of a GPU partition with a time limit into their own config, which mjlab-submit's
    dry run then uses; a second write of that name is refused without --force."""
    alice = Team.USERS[0]
    tag = secrets.token_hex(3)
    acct, other, qos, part = f"phys{tag}", f"chem{tag}", f"high{tag}", f"gpu{tag}"
    sacctmgr = ["sacctmgr", "-i"]
    made = [
        [*sacctmgr, "add", "qos", qos],
        [*sacctmgr, "add", "account", acct, other],
        [
            *sacctmgr,
            "add",
            "user",
            alice,
            f"account={acct}",
            f"qos=normal,{qos}",
            f"defaultqos={qos}",
        ],
        [*sacctmgr, "add", "user", alice, f"account={other}"],
        ["scontrol", "create", f"PartitionName={part}", "Nodes=ALL", "MaxTime=2-00:00:00"],
    ]
    slurm_env = {"SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    try:
        for cmd in made:
            slurm_cluster.run(cmd)
        doctor = [BIN / "mjlab-hpc", "doctor", "--write-profile", "site", "--partition", part]
        wrote = team.run(alice, doctor, extra=slurm_env, timeout=60)
        assert wrote.returncode == 0, wrote.stdout + wrote.stderr
        config = team.base / "home" / alice / ".config" / "mjlab-hpc" / "config.toml"
        assert f"wrote profile site to {config}" in wrote.stderr
        text = config.read_text()
        for line in (
            f'partition = "{part}"',
            "gpus-per-node = 4",
            'time = "2-00:00:00"',
            f'account = "{acct}"',  # the default account (the first added), not {other}
            f'qos = "{qos}"',  # its default QOS
            f"# {alice}'s accounts here: {', '.join(sorted([acct, other]))}",
        ):
            assert line in text, text
        assert config.stat().st_uid != 0  # the user's own file

        submit = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run"]
        shown = team.run(alice, [*submit, "--profile", "site", "--nodes", "2"], extra=slurm_env)
        assert shown.returncode == 0, shown.stderr
        for option in (f"partition={part}", f"account={acct}", f"qos={qos}", "time=2880"):
            assert f"#SBATCH --{option}\n" in shown.stdout, shown.stdout
        assert f'# account = "{acct}"  ({config} [profile.site])' in shown.stdout

        again = team.run(alice, doctor, extra=slurm_env, timeout=60)
        assert again.returncode == 2 and "--force" in again.stderr, again.stderr
        assert config.read_text() == text
        nowhere = team.run(alice, [*doctor[:-1], "nope", "--force"], extra=slurm_env)
        assert nowhere.returncode == 2, nowhere.stderr
        assert f"--partition: no partition 'nope' here; there are: debug, {part}" in nowhere.stderr
        assert config.read_text() == text
        # An account or QOS sacctmgr does not give alice is refused like an unknown partition.
        for flag, name, said in (
            ("--account", "nope", f"--account: sacctmgr gives {alice} no account 'nope'"),
            ("--qos", "nope", f"--qos: sacctmgr gives {alice} no QOS 'nope' under account {acct}"),
        ):
            unknown = team.run(alice, [*doctor, "--force", flag, name], extra=slurm_env)
            assert unknown.returncode == 2 and said in unknown.stderr, unknown.stderr
            assert config.read_text() == text
        forced = team.run(alice, [*doctor, "--force", "--account", other], extra=slurm_env)
        assert forced.returncode == 0, forced.stderr
        assert f'account = "{other}"' in config.read_text()
        assert config.read_text().count("[profile.site]") == 1
    finally:
        undo = [
            ["scontrol", "delete", f"PartitionName={part}"],
            [*sacctmgr, "delete", "user", alice],
            [*sacctmgr, "delete", "account", acct, other],
            [*sacctmgr, "delete", "qos", qos],
        ]
        for cmd in undo:
            slurm_cluster.run(cmd, check=False)

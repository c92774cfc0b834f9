"""mjlab-submit and the sbatch templates, without a cluster.

Covers validation, dry runs, golden scripts, shell quoting (executed for real) and a real job
through the local executor.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BIN, Team, cli_env, recording_tools

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.plan import job_plan, render
from mjlab_hpc.launch.slurm import allocation_srun, render_sbatch
from mjlab_hpc.launch.submit import submit
from mjlab_hpc.rundir.layout import RunDir, run_dir_for_key
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import SubmitSpec, TrainSpec, train_cli_args
from mjlab_hpc.validate import validate_submit, world

GOLDEN = Path(__file__).parent / "golden"
HOSTILE = "my run; $(touch pwned) `touch pwned2` \"q\" 'x'"


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        ("1:30", 2),
        ("12:00:00", 720),
        ("1-00", 1440),
        ("2-03:04", 3064),
        ("1-00:00:01", 1441),
    ],
)
def test_slurm_time(text: str, minutes: int) -> None:
    assert slurm_time_minutes(text) == minutes


# Written into the #SBATCH line as given: white space, a newline or another script's digits
# are refused rather than passed on.
@pytest.mark.parametrize(
    "text",
    ["", "abc", "1:2:3:4", "0", "-5", "1h", "00:00:00", " 45 ", "45\n", "\u0663\u0660", "1_0"],
)
def test_slurm_time_errors(text: str) -> None:
    with pytest.raises(SpecError, match="--time"):
        slurm_time_minutes(text)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--nodes", "0"], "--nodes"),
        (["--time", "soon"], "--time"),
        (["--num-envs", "-1"], "--num-envs"),
        (["--gpus-per-node", "4", "--tasks-per-node", "2"], "--tasks-per-node"),
        (["--container", "/nonexistent/image.sif"], "--container"),
        (["--mem", "lots"], "--mem"),
        (["--sbatch-arg", "bad key=1"], "--sbatch-arg"),
        (["--time", "1", "--signal-delay-s", "90"], "--signal-delay-s"),
        (["--executor", "local", "--nodes", "2"], "--nodes"),
        (["--num-procs", "2"], "--num-procs"),
        (["--max-iterations", "0"], "--max-iterations"),
        (["--spare-nodes", "-1"], "--spare-nodes"),
        (["--spare-nodes", "1.5"], "--spare-nodes"),
        (["--executor", "local", "--spare-nodes", "1"], "--spare-nodes"),
        (["--nodes", "2", "--min-nodes", "3"], "--min-nodes"),
        (["--nodes", "2", "--min-nodes", "0"], "--min-nodes"),
        (["--executor", "local", "--min-nodes", "1"], "--min-nodes"),
    ],
)
def test_bad_spec_exits_2_and_submits_nothing(tmp_path: Path, args: list[str], flag: str) -> None:
    cmd = [BIN / "mjlab-submit", "cartpole", "--log-root", str(tmp_path), "--gpus-per-node", "0"]
    proc = subprocess.run(
        [*cmd, *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert flag in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.mjlab  # the error lists mjlab's tasks too, which imports mjlab
def test_unknown_task(tmp_path: Path) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-submit", "nope", "--log-root", str(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown task 'nope'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_missing_sbatch(tmp_path: Path) -> None:
    # A login node without Slurm's commands: the slurm executor says so and submits nothing.
    proc = subprocess.run(
        [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--log-root", str(tmp_path)],
        env=cli_env(path=str(BIN)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_dry_run_without_slurm(tmp_path: Path) -> None:
    """A laptop: no sbatch, no srun. The dry run still prints the exact script."""
    cmd = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run", "--nodes", "2"]
    cmd += ["--gpus-per-node", "4", "--time", "12:00:00", "--log-root", str(tmp_path)]
    proc = subprocess.run(
        cmd,
        env=cli_env(path=str(BIN)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world_size: 8" in out
    expected = [
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--time=720",
        "--signal=USR2@90",
        "--requeue",
    ]
    for line in expected:
        assert f"#SBATCH {line}" in out
    assert "--kill-on-bad-exit=1" in out
    assert not any(tmp_path.iterdir())  # nothing created


def golden_spec(**kw: object) -> SubmitSpec:
    train = TrainSpec(task="cartpole", log_root="/shared/logs", num_envs=2048, seed=7)
    return SubmitSpec(train=train, **kw)  # type: ignore[arg-type]


GOLDEN_SPECS = {
    "gpu_2x4": dict(
        nodes=2,
        gpus_per_node=4,
        time="12:00:00",
        partition="gpu",
        account="rl",
        qos="high",
        cpus_per_task=8,
        mem="128G",
        constraint="a100",
        exclusive=True,
        setup=("module load cuda/12.4", "source ~/venv/bin/activate"),
        sbatch_arg=("mail-type=END", "comment=PPO G1"),
    ),
    "cpu_2x2": dict(nodes=2, gpus_per_node=0, tasks_per_node=2, time="30"),
}
# The submitit script only: a job with a spare node (sbatch asks for 3, each step runs on 2).
SPARE = {
    "cpu_2x2_spare1": dict(nodes=2, gpus_per_node=0, tasks_per_node=2, time="30", spare_nodes=1),
    "cpu_3x2_spare1_min1": dict(
        nodes=3, gpus_per_node=0, tasks_per_node=2, time="30", spare_nodes=1, min_nodes=1
    ),
}


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 rewrites it"


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden_rendered_template(name: str) -> None:
    text = render("train", job_plan(golden_spec(**GOLDEN_SPECS[name])))
    check_golden(f"train_{name}.sbatch", text)


def test_golden_apptainer(tmp_path: Path) -> None:
    image = tmp_path / "mjlab.sif"
    image.write_bytes(b"sif")
    spec = golden_spec(nodes=2, gpus_per_node=4, container=str(image))
    text = render("train_apptainer", job_plan(spec)).replace(str(image), "/images/mjlab.sif")
    check_golden("train_apptainer_gpu_2x4.sbatch", text)


def test_golden_pyxis() -> None:
    """pyxis/enroot: srun starts every rank and the heal step in the image (the batch shell
    stays outside it and requeues when the image has no Slurm commands)."""
    image = "nvcr.io#nvidia/pytorch:24.05-py3"
    spec = golden_spec(nodes=2, gpus_per_node=4, time="12:00:00", container_image=image)
    text = render_sbatch(spec, Path("/shared/logs/cartpole/2026-01-01_00-00-00"))
    check_golden("submitit_pyxis_gpu_2x4.sbatch", text)
    lines = [line.strip() for line in text.splitlines()]
    srun = shlex.split(next(line for line in lines if line.startswith("srun ")))
    assert f"--container-image={image}" in srun
    assert srun[-7:-5] == ["python3", "-u"] and srun[-2:] == ["2>&$to_said", "&"]  # background
    heal_line = next(line for line in lines if " heal " in line)
    heal = shlex.split(heal_line.removeprefix("options=$(").removesuffix(" \\"))
    assert heal[:4] == ["srun", "--nodes=1", "--ntasks=1", f"--container-image={image}"]
    # Inside a salloc allocation too: srun starts the ranks in the image.
    argv = allocation_srun(spec, train_cli_args(spec.train), Path("/shared/logs/cartpole/run"))
    assert f"--container-image={image}" in argv and argv[argv.index("python3") + 1] == "-u"
    with pytest.raises(SpecError, match="--container-image: one image"):
        validate_submit(spec.replace(container="/images/mjlab.sif", dry_run=True))


@pytest.mark.parametrize("name", sorted({**GOLDEN_SPECS, **SPARE}))
def test_golden_submitit_script(name: str) -> None:
    spec = golden_spec(**{**GOLDEN_SPECS, **SPARE}[name])
    text = render_sbatch(spec, Path("/shared/logs/cartpole/2026-01-01_00-00-00"))
    text = text.replace(shlex.quote(sys.executable), "PYTHON")
    check_golden(f"submitit_{name}.sbatch", text)


def test_rendered_template_quotes_user_strings(tmp_path: Path) -> None:
    spec = SubmitSpec(
        train=TrainSpec(task="cartpole", log_root=str(tmp_path / "logs"), run_name=HOSTILE),
        gpus_per_node=0,
        tasks_per_node=2,
        job_name=HOSTILE,
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render("train", job_plan(spec)))
    record = tmp_path / "argv.txt"
    recording_tools(tmp_path / "bin", record)
    env = cli_env(path=f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    env |= {"SLURM_JOB_ID": "42"}
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    argv = record.read_text().split("\n")
    # The hostile run name reached both commands as one literal argument.
    assert argv.count(HOSTILE) == 2
    assert "slurm-42" in argv


def test_submitit_script_quotes_user_strings(tmp_path: Path) -> None:
    run_dir = tmp_path / "logs" / HOSTILE
    spec = SubmitSpec(
        train=TrainSpec(task="cartpole", run_name=HOSTILE), job_name=HOSTILE, gpus_per_node=0
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir))
    record = tmp_path / "argv.txt"
    recording_tools(tmp_path / "bin", record)
    env = cli_env(path=f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert str(run_dir / "submitit") in record.read_text().split("\n")
    assert f"#SBATCH --job-name={shlex.quote(HOSTILE)}" in script.read_text()


def test_our_scripts_variables_are_ours_and_a_persons_are_dropped() -> None:
    """What our batch script exports for its own commands (the heal step's srun step name,
    the signal delay) is kept silently where its mark names this job and start; a person's
    (left exported, or copied from another job or from before a requeue) is dropped, said."""
    person = {"_MJLAB_HPC_START": "42.0.1", "_MJLAB_HPC_SIGNAL_DELAY": "5"}

    def said(extra: dict[str, str]) -> str:
        proc = subprocess.run(
            [BIN / "mjlab-hpc", "--help"],
            env=cli_env(extra),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    ours = {**person, "_MJLAB_HPC_SCRIPT": "42.0", "SLURM_JOB_ID": "42"}
    assert said(ours) == ""
    assert said({**ours, "SLURM_RESTART_COUNT": "0"}) == ""
    dropped = "warning: ignored _MJLAB_HPC_SIGNAL_DELAY, _MJLAB_HPC_START: internal variable"
    assert said(person).startswith(dropped)
    for other in ({"SLURM_JOB_ID": "43"}, {"SLURM_RESTART_COUNT": "1"}):
        assert "_MJLAB_HPC_START" in said({**ours, **other})
    # Not one of the script's: dropped even beside a valid mark.
    assert "ignored _MJLAB_HPC_DETACHED:" in said({**ours, "_MJLAB_HPC_DETACHED": "1"})


def test_train_cli_args_round_trip() -> None:
    spec = TrainSpec(task="ant", num_envs=64, seed=3, run_name="x y", use_graph=False)
    args = ["ant", "--num-envs", "64", "--seed", "3", "--run-name", "x y", "--no-use-graph"]
    assert train_cli_args(spec) == args
    import tyro

    assert tyro.cli(TrainSpec, args=train_cli_args(spec)) == spec


def test_run_dir_for_key_is_stable_and_distinct(tmp_path: Path) -> None:
    a = run_dir_for_key(tmp_path, "exp", "r", "slurm-1")
    assert run_dir_for_key(tmp_path, "exp", "r", "slurm-1") == a  # every rank, every restart
    b = run_dir_for_key(tmp_path, "exp", "r", "slurm-2")  # same second, another job
    assert a != b and a.is_dir() and b.is_dir()
    with pytest.raises(ValueError, match="plain name"):
        run_dir_for_key(tmp_path, "exp", "r", "../x")


def test_a_key_a_teammates_records_refuse_makes_nothing(team: Team) -> None:
    """Issue 54: where bob's folder of key records (`.keys`) takes none of alice's, alice's
    `mjlab-hpc run-dir --key` is refused before anything is made (no empty run directory),
    naming that folder and whose it is; so is a key bob recorded."""
    alice, bob = Team.USERS
    logs = team.shared / "key-logs"
    try:
        made = team.run(bob, [BIN / "mjlab-hpc", "run-dir", "--log-root", logs, "--key", "k1"])
        assert made.returncode == 0, made.stderr
        keys = logs / "cartpole" / ".keys"
        os.chmod(keys, 0o755)  # bob's, as an older version or his umask left it
        before = sorted(p.name for p in keys.parent.iterdir())
        for key, said in (
            ("k2", f"error: --key: {keys} takes no record of {alice}: it belongs to {bob}"),
            ("k1", f"error: --key: {keys / 'k1'} is damaged (it was written by {bob}"),
        ):
            args = [BIN / "mjlab-hpc", "run-dir", "--log-root", logs, "--key", key]
            refused = team.run(alice, args)
            assert refused.returncode == 2 and refused.stderr.startswith(said), refused.stderr
            assert ".tmp" not in refused.stderr
            assert sorted(p.name for p in keys.parent.iterdir()) == before
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@pytest.mark.training
def test_local_executor_job(tmp_path: Path) -> None:
    """`mjlab-submit --executor local`: the same job on this machine, two CPU ranks."""
    cmd = [BIN / "mjlab-submit", "cartpole", "--executor", "local", "--gpus-per-node", "0"]
    cmd += ["--tasks-per-node", "2", "--num-envs", "64", "--max-iterations", "2"]
    cmd += ["--torch-threads", "1", "--log-root", str(tmp_path), "--follow"]
    proc = subprocess.run(
        cmd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "64 per rank x 2 ranks = 128 in total" in out
    assert "[train] it 2/2" in proc.stdout
    runs = [p for p in (tmp_path / "cartpole").iterdir() if not p.name.startswith(".")]
    assert len(runs) == 1
    run = RunDir(runs[0])
    summary = json.loads(run.summary.read_text())
    assert summary["ranks_in_sync"] and summary["world_size"] == 2
    logs = {"rank0.log", "rank1.log", "heartbeat", "ranks", "checkpoints.jsonl"}
    assert {p.name for p in run.logs.iterdir()} == logs
    assert {p.name for p in run.heartbeats.iterdir()} == {"rank0.json", "rank1.json"}
    assert run.checkpoint(2).exists()


@pytest.mark.training
def test_local_executor_hands_its_ranks_the_gpus_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mjlab-submit --executor local --gpus-per-node 2` past its check of this machine's
    GPUs, on a CPU machine: the plan counts the GPUs within this shell's
    CUDA_VISIBLE_DEVICES, and they are handed to the ranks (submitit's controller, then each
    rank) as CUDA_VISIBLE_DEVICES. Only the GPUs are staged here (two names, no device
    behind them): the ranks find no CUDA, say so, and train on the CPU. tests/gpu trains on
    a real GPU through the whole command."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(world, "check_local_gpus", lambda flag, count: None)
    train = TrainSpec(
        task="cartpole", num_envs=16, max_iterations=1, torch_threads=1, log_root=str(tmp_path)
    )
    submitted = submit(SubmitSpec(train=train, executor="local", gpus_per_node=2, snapshot=False))
    submitted.job.results()  # both ranks to their end
    run = RunDir(submitted.run_dir)
    for rank in (0, 1):
        log = run.rank_log(rank).read_text()
        head = log.split("\n")[0]
        assert " on cpu, " in head and re.search(r"CUDA_VISIBLE_DEVICES=5,7(, |$)", head), head
        assert "GPUs 5,7 were allocated but CUDA is not usable here" in log
    assert json.loads(run.summary.read_text())["world_size"] == 2

"""Job chains, allocations and the doctor's reading of its probe, without Slurm.

The fast tier: a job's place in a chain, what an allocation allows, the srun command inside
it, the dependency in the script, all-or-nothing chain submission, and the doctor's checks
from its shape probe's results.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import BIN, cli_env

from mjlab_hpc import __version__
from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.plan import job_plan
from mjlab_hpc.launch.slurm import allocation_srun, render_sbatch
from mjlab_hpc.launch.submit import submit_chain
from mjlab_hpc.ops.doctor import _gpus_check, _said, shape_checks
from mjlab_hpc.rank.context import (
    ALLOCATION_ENV,
    Allocation,
    chain_link,
    current_allocation,
    derive_master_port,
    detect_mode,
    interactive_step,
)
from mjlab_hpc.spec import SubmitSpec, TrainSpec, train_cli_args
from mjlab_hpc.validate.world import check_allocation


def test_chain_link_reads_only_sane_places() -> None:
    assert chain_link({"_MJLAB_HPC_CHAIN": "2/3"}) == (2, 3)
    for bad in ("", "0/3", "4/3", "x/3", "2/3\n1", "-1/2"):
        assert chain_link({"_MJLAB_HPC_CHAIN": bad}) is None, bad
    assert chain_link({}) is None


def test_allocation_is_found_outside_steps_only() -> None:
    salloc = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4"}
    assert current_allocation(salloc) == Allocation("7", nodes=2, gpus_per_node=None)
    assert detect_mode(salloc) == "single"  # the salloc shell is not a rank
    assert current_allocation({**salloc, "SLURM_STEP_ID": "0"}) is None  # a rank
    assert current_allocation({}) is None
    # srun --pty bash: a step that holds the allocation; mjlab-submit says so, and submits.
    pty = {**salloc, "SLURM_STEP_ID": "0", "SLURM_PTY_PORT": "40001"}
    assert interactive_step(pty) == "step 0 of job 7"
    assert interactive_step({**salloc, "SLURM_STEP_ID": "0"}) is None  # a rank of ours
    assert interactive_step({**pty, ALLOCATION_ENV: "7"}) is None  # a rank started from it
    assert interactive_step(salloc) is None
    alloc = Allocation("7", nodes=2, gpus_per_node=4)
    spec = SubmitSpec(train=TrainSpec(), nodes=3, gpus_per_node=0)
    with pytest.raises(SpecError, match="--nodes: 3 nodes asked for; allocation 7 has 2"):
        check_allocation(spec, alloc)
    with pytest.raises(SpecError, match="--gpus-per-node"):
        check_allocation(spec.replace(nodes=2, gpus_per_node=8), alloc)
    with pytest.raises(SpecError, match="--chain"):
        check_allocation(spec.replace(nodes=1, chain=2), alloc)
    check_allocation(spec.replace(nodes=2, gpus_per_node=4), alloc)


def test_the_srun_inside_an_allocation(tmp_path: Path) -> None:
    spec = SubmitSpec(
        train=TrainSpec(task="cartpole", num_envs=16), nodes=2, gpus_per_node=0, tasks_per_node=2
    )
    train = train_cli_args(spec.train)
    argv = allocation_srun(spec, train, tmp_path)
    assert argv[0] == "srun" and argv[2:5] == ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]
    # Named after the run (a dry run shows the step that runs), another run another name.
    assert argv[1].startswith("--job-name=mjlab-ranks-")
    assert argv == allocation_srun(spec, train, tmp_path)
    assert allocation_srun(spec, train, tmp_path / "b")[1] != argv[1]
    python = argv[argv.index(sys.executable) :][:4]
    assert python == [sys.executable, "-u", "-m", "mjlab_hpc.cli.train"]
    assert argv[-2:] == ["--run-dir", str(tmp_path)]
    assert "--signal=USR2@90" in argv  # the allocation's end: a checkpoint in time
    # Two trainings at once in one allocation get ports of their own; a batch job's first
    # step keeps the port it always had.
    assert derive_master_port("7", restart_count=0) != derive_master_port("7", restart_count=997)


def test_the_script_of_a_chained_job_waits_and_knows_its_place(tmp_path: Path) -> None:
    spec = SubmitSpec(train=TrainSpec(), gpus_per_node=0, after=("41", "42_1"), chain=3, time="30")
    script = render_sbatch(spec, tmp_path)
    assert "#SBATCH --dependency=afterany:41:42_1" in script
    assert "export _MJLAB_HPC_CHAIN=1/3" in script


class _Job:
    def __init__(self, job_id: str, log: list[str]) -> None:
        self.job_id, self.log = job_id, log

    def cancel(self, check: bool = True) -> None:
        self.log.append(f"cancel {self.job_id}")


def test_a_chain_is_submitted_whole_or_not_at_all(tmp_path: Path) -> None:
    """Each planned script is submitted with the id Slurm gave the job before in place of
    the dry run's `JOB<k>`, in its #SBATCH line and submitit's parameters alike."""
    log: list[str] = []

    def submit(params: dict[str, Any], script: str) -> list[Any]:
        after = params["additional_parameters"]["dependency"].removeprefix("afterany:")
        assert f"#SBATCH --dependency=afterany:{after}\n" in script
        link = int(script.split("_MJLAB_HPC_CHAIN=")[1][0])
        log.append(f"submit {link} after {after}")
        if link == 3:
            raise RuntimeError("sbatch: error: QOSMaxSubmitJobPerUserLimit")
        return [_Job(f"{100 + link}_0", log), _Job(f"{100 + link}_1", log)]

    train = TrainSpec(log_root=str(tmp_path))
    plan = job_plan(SubmitSpec(train=train, gpus_per_node=0, chain=3, after=("9",)))
    assert [j.after for j in plan.jobs] == [("9",), ("JOB1",), ("JOB2",)]
    with pytest.raises(RuntimeError):
        submit_chain(plan, submit)
    assert log == [
        "submit 1 after 9",
        "submit 2 after 101",
        "submit 3 after 102",
        "cancel 101_0",
        "cancel 101_1",
        "cancel 102_0",
        "cancel 102_1",
    ]


def _task(folder: Path, rank: int, node: str, **extra: Any) -> dict[str, Any]:
    """What a task of the doctor's shape probe returns (its result, on this host)."""
    return {
        "rank": rank,
        "node": node,
        "python": sys.executable,
        "token": "t0k",
        "seen": 2,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "folder": str(folder.resolve()),
        "mjlab_hpc": {"ok": True, "version": __version__},
        "gpus": {"CUDA_VISIBLE_DEVICES": "0,1", "torch_cuda": None, "torch_devices": 0},
        **extra,
    }


def test_the_shape_probes_results_become_checks(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / ".doctor" / "p"
    folder.mkdir(parents=True)
    broken = {"ok": False, "error": "ModuleNotFoundError: rsl_rl"}
    both = [_task(folder, 0, "node1"), _task(folder, 1, "node2", mjlab_hpc=broken)]
    checks = {c.name: c for c in shape_checks(folder, "t0k", both, gpus=2, mjlab=False)}
    assert checks["log root shared"].result == "ok"
    assert "2 task(s) on 2 node(s)" in checks["log root shared"].detail
    assert checks["Python on nodes"].result == "ok"
    assert checks["mjlab_hpc on nodes"].result == "fail"
    assert "task 1: ModuleNotFoundError: rsl_rl" in checks["mjlab_hpc on nodes"].detail
    assert checks["GPUs"].result == "fail" and "a CPU build of torch" in checks["GPUs"].detail
    # Task 1 wrote where this host cannot see it; task 2 read another token and saw one note.
    blind = _task(folder, 2, "node2", token="other", seen=1)
    shared = shape_checks(folder, "t0k", [both[0], None, blind], gpus=0, mjlab=False)[0]
    assert shared.result == "fail"
    assert "tasks whose writes this host does not see: [1]" in shared.detail
    assert "nodes that do not see this host's writes: node2" in shared.detail
    assert "task 2 saw 1 of 2 notes" in shared.detail
    # Nothing came back: the nodes see another folder (the only check then).
    [nothing] = shape_checks(folder, "t0k", [None, None], gpus=0, mjlab=False, nodes="node[1-2]")
    assert nothing.result == "fail" and "(node[1-2]) see a different folder" in nothing.detail
    assert "shared filesystem" in nothing.fix
    # A task that could not even run the probe: what it said names the problem.
    said = _said(
        "Traceback (most recent call last):\n  File ...\nModuleNotFoundError: x\n"
        "----\nYou can check full logs with 'job.stderr(0)'\n  - /a/b.err"
    )
    assert said == "ModuleNotFoundError: x"
    srun = "slurmstepd: error: execve(): /nope/python: No such file\nsrun: error: task 0: Exited"
    assert _said(srun) == "slurmstepd: error: execve(): /nope/python: No such file"
    outcomes = [both[0] | {"seen": 1}, said]
    one = {c.name: c for c in shape_checks(folder, "t0k", outcomes, gpus=0, mjlab=False)}
    assert one["log root shared"].result == "ok"
    assert one["Python on nodes"].result == "fail"
    assert "tasks [1] could not run" in one["Python on nodes"].detail
    assert one["Python on nodes"].detail.endswith("ModuleNotFoundError: x")


def test_the_gpu_check_counts_what_each_node_sees() -> None:
    def task(node: str, visible: str, torch_devices: int) -> dict:
        gpus = {
            "CUDA_VISIBLE_DEVICES": visible,
            "torch_cuda": "12.8",
            "torch_devices": torch_devices,
        }
        return {"node": node, "gpus": gpus}

    every = [task("n1", "0,1", 2), task("n1", "0,1", 2), task("n2", "0,1", 2)]
    assert _gpus_check(gpus_per_node=2, ran=every).result == "ok"
    # A per-task binding: each task sees its own GPU, the node's tasks all of them.
    per_task = [task("n1", "0", 1), task("n1", "1", 1)]
    assert _gpus_check(gpus_per_node=2, ran=per_task).result == "ok"
    short = _gpus_check(gpus_per_node=4, ran=every)
    assert short.result == "fail" and "n1: 2, n2: 2 GPU(s) visible" in short.detail
    assert "4 per node asked for" in short.detail and "sinfo" in short.fix
    # Slurm numbers each task's one GPU 0: the GPUs it names for the step count.
    renumbered = [task("n1", "0", 1), task("n1", "0", 1)]
    assert _gpus_check(gpus_per_node=2, ran=renumbered).result == "fail"
    renumbered[0]["gpus"]["SLURM_STEP_GPUS"], renumbered[1]["gpus"]["SLURM_STEP_GPUS"] = "2", "3"
    assert _gpus_check(gpus_per_node=2, ran=renumbered).result == "ok"
    hidden = _gpus_check(gpus_per_node=2, ran=[task("n1", "0,1", 1)])
    assert hidden.result == "fail" and "torch sees 1 of the 2 GPU(s)" in hidden.detail


def test_a_real_path_that_differs_is_a_warning(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / ".doctor" / "p"
    folder.mkdir(parents=True)
    # The log root is a symbolic link on this host.
    task = _task(folder, 0, "node1", seen=1) | {"folder": "/gpfs/u/logs/.doctor/p"}
    shared = shape_checks(folder, "t0k", [task], gpus=0, mjlab=False)[0]
    assert shared.result == "warn" and "/gpfs/u/logs/.doctor/p on a node" in shared.detail


def test_a_laptop_dry_run_shows_the_slurm_script_of_a_cluster_request(tmp_path: Path) -> None:
    env = cli_env(path=str(BIN))  # no sbatch on PATH: a laptop
    base = [str(BIN / "mjlab-submit"), "cartpole", "--log-root", str(tmp_path / "logs")]
    for extra, reason in (
        (["--nodes", "2", "--gpus-per-node", "4"], "--nodes"),
        (["--gpus-per-node", "0", "--partition", "gpu"], "--partition"),
        (["--gpus-per-node", "0", "--chain", "2"], "--chain"),
    ):
        proc = subprocess.run(
            [*base, *extra, "--dry-run"], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert f"not submitted; Slurm was not found here, {reason} asks for it" in proc.stdout
        assert "#SBATCH --time=60" in proc.stdout
    local = subprocess.run(
        [*base, "--gpus-per-node", "0", "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "# ---- local executor (dry run: not started) ----" in local.stdout
    # Without --dry-run it is still refused: nothing here can run two nodes.
    real = subprocess.run(
        [*base, "--nodes", "2", "--gpus-per-node", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert real.returncode == 2 and "--nodes" in real.stderr
    assert not (tmp_path / "logs").exists()

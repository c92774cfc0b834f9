"""Other users, the console, the environment and leftovers: each said plainly, none obeyed.

Other users share a team's log root (real unprivileged users, a setgid folder). Training does
not depend on its console (a real `| head -1`, closed descriptors, a pipe nobody reads). An
environment left over from elsewhere (a fault drill, our internal variables) and the leftovers
each get one clear line. Rank states from elsewhere and continuations are tested in
tests/rank/test_continuation.py and tests/rundir/test_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, Team, cli_env, only_run, wait_for_iteration
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED
from mjlab_hpc.launch.local import free_port
from mjlab_hpc.ops.cancel import _marked
from mjlab_hpc.ops.status import RunStatus, _row
from mjlab_hpc.rundir.layout import CANCEL_RECORD, latest_run_record
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.rundir.running import run_processes

SMALL = ["--num-envs", "16", "--torch-threads", "1"]


def _text(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.training
def test_other_users_on_a_team_log_root(team: Team) -> None:
    """bob cannot stop alice's run, and says so instead of claiming it (no cancel record, her
    run goes on); bob trains beside her in the folders she made; what bob may not enter or
    write is one line naming its owner, never a traceback."""
    alice, bob = Team.USERS
    submit = [BIN / "mjlab-submit", "cartpole", "--executor", "local", "--gpus-per-node", "0"]
    submit += [*SMALL, "--max-iterations", "100000", "--log-root", "logs"]
    start = team.run(alice, submit, umask=0o002)
    assert start.returncode == 0, _text(start)
    logs = team.shared / "logs"
    run = wait_for_iteration(logs, 1).path
    try:
        # The experiment folder alice's command made in the setgid root is the team's.
        assert (logs / "cartpole").stat().st_mode & stat.S_IWGRP
        cancel = team.run(bob, [BIN / "mjlab-hpc", "cancel", run])
        said = _text(cancel)
        assert cancel.returncode == EXIT_FAILED, said
        assert f"run by {alice}" in said and "nothing was done" in said, said
        assert not (run / CANCEL_RECORD).exists() and run_processes(run)  # alice's, on
        status = team.run(bob, [BIN / "mjlab-hpc", "status", "--json", "--log-root", "logs"])
        assert [r["state"] for r in json.loads(status.stdout)] == ["RUNNING"], _text(status)

        train = [BIN / "mjlab-train", "cartpole", *SMALL, "--max-iterations", "1"]
        mine = team.run(bob, [*train, "--log-root", "logs"])
        assert mine.returncode == 0 and "done: 1 iterations" in mine.stdout, _text(mine)
        # A folder alice made before with her umask (as older versions did): one line.
        assert team.run(alice, ["mkdir", "logs/old"]).returncode == 0
        refused = team.run(
            bob, [BIN / "mjlab-train", "cartpole", "--experiment-name", "old", "--log-root", "logs"]
        )
        said = _text(refused)
        assert refused.returncode == EXIT_BAD_INPUT and "Traceback" not in said, said
        why = f"is not writable by {bob} (it belongs to {alice}, drwxr-sr-x)"
        assert f"error: --log-root: logs/old {why}" in said
        # A run alice keeps to herself (umask 077): left out of bob's status, one line in logs.
        private = logs / "cartpole" / "2026-01-01_00-00-00_private"
        assert team.run(alice, ["mkdir", "-p", private / "logs"], umask=0o077).returncode == 0
        status = team.run(bob, [BIN / "mjlab-hpc", "status", "--json", "--log-root", "logs"])
        assert status.returncode == 0 and len(json.loads(status.stdout)) == 2, _text(status)
        assert f"not readable by {bob}, left out: logs/cartpole/{private.name}" in status.stderr
        denied = team.run(bob, [BIN / "mjlab-hpc", "logs", private])
        said = _text(denied)
        assert denied.returncode == EXIT_FAILED and "Traceback" not in said, said
        assert f"{private} cannot be read or written by {bob} (it belongs to {alice}" in said
    finally:
        stop = team.run(alice, [BIN / "mjlab-hpc", "cancel", run])
    assert stop.returncode == 0 and "no process left" in stop.stdout, _text(stop)


@pytest.mark.slurm
def test_another_users_slurm_job_is_not_claimed_cancelled(
    slurm_cluster: SlurmCluster, team: Team
) -> None:
    """bob's cancel of alice's Slurm job: Slurm refuses it, and bob's command says so (exit
    1) instead of leaving a cancel record by bob on a run that goes on."""
    alice, bob = Team.USERS
    cluster = slurm_cluster.env
    logs = "slurm-logs"  # its own: the team's other tests leave cancelled runs in logs/
    submit = [BIN / "mjlab-submit", "cartpole", *SMALL, "--gpus-per-node", "0", "--time", "10"]
    submit += ["--max-iterations", "100000", "--log-root", logs]
    start = team.run(alice, submit, umask=0o002, extra=cluster)
    assert start.returncode == 0, _text(start)
    job = next(w for w in start.stdout.split() if w.isdigit() and len(w) > 3)
    try:
        run = wait_for_iteration(team.shared / logs, 1, timeout=180).path
        cancel_job = [BIN / "mjlab-hpc", "cancel", job, "--log-root", logs]
        cancel = team.run(bob, cancel_job, extra=cluster)
        said = _text(cancel)
        assert cancel.returncode == EXIT_FAILED and "nothing was cancelled" in said, said
        assert not (run / CANCEL_RECORD).exists()
        assert slurm_cluster.sacct_state(job) == "RUNNING"
    finally:
        stop = team.run(
            alice, [BIN / "mjlab-hpc", "cancel", job, "--log-root", logs], extra=cluster
        )
    assert stop.returncode == 0 and "CANCELLED" in stop.stdout, _text(stop)


def _completed(root: Path) -> None:
    record = read_record(only_run(root).path)
    assert record.state == "completed" and record.iterations == 3, record


@pytest.mark.training
def test_training_never_depends_on_its_console(tmp_path: Path) -> None:
    """A reader that goes away (`| head -1`), closed stdout and stderr, and a pipe nobody
    reads: the run completes all the same."""
    train = [str(BIN / "mjlab-train"), "cartpole", *SMALL, "--max-iterations", "3"]
    head = '"$@" | head -1; exit "${PIPESTATUS[0]}"'
    piped = subprocess.run(
        ["bash", "-c", head, "bash", *train, "--log-root", str(tmp_path / "head")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 1, _text(piped)
    _completed(tmp_path / "head")
    closed = subprocess.run(
        ["bash", "-c", '"$@" >&- 2>&-', "bash", *train, "--log-root", str(tmp_path / "closed")],
        env=cli_env(),
        timeout=300,
    )
    assert closed.returncode == 0
    _completed(tmp_path / "closed")
    read, write = os.pipe()  # full before the command starts, and never read
    fcntl.fcntl(write, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        while True:
            os.write(write, b"x" * 4096)
    except BlockingIOError:
        pass
    fcntl.fcntl(write, fcntl.F_SETFL, 0)
    try:
        full = subprocess.run(
            [*train, "--log-root", str(tmp_path / "full")],
            env=cli_env(),
            stdout=write,
            stderr=write,
            timeout=300,
        )
    finally:
        os.close(write)
        os.close(read)
    assert full.returncode == 0
    _completed(tmp_path / "full")


@pytest.mark.training
def test_the_environment_is_said_not_obeyed(tmp_path: Path) -> None:
    """A fault drill left exported is said at start, before it kills the run; an internal
    variable a user set is dropped with a line (the run stops at Ctrl-C, which
    _MJLAB_HPC_DETACHED would have made it ignore)."""
    train = [BIN / "mjlab-train", "cartpole", *SMALL]
    drill = subprocess.run(
        [*train, "--max-iterations", "3", "--log-root", str(tmp_path / "drill")],
        env=cli_env({"MJLAB_HPC_FAULT": "kill@1"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert drill.returncode == -signal.SIGKILL
    said = "warning: MJLAB_HPC_FAULT=kill@1 is set: this run is a fault drill (kill rank 0 at "
    assert drill.stderr.startswith(said + "iteration 1)"), drill.stderr
    proc = subprocess.Popen(
        [*train, "--max-iterations", "100000", "--log-root", str(tmp_path / "detached")],
        env=cli_env({"_MJLAB_HPC_DETACHED": "1"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_iteration(tmp_path / "detached", 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert err.startswith("warning: ignored _MJLAB_HPC_DETACHED: internal variable"), err
    assert proc.returncode == EXIT_STOPPED and "stopped at iteration" in err, out + err


@pytest.mark.training
def test_the_leftovers_each_get_one_line(tmp_path: Path) -> None:
    """Of two trainings into one run, the first ends with its own closing line (the second is
    refused and writes nothing there, not even in the rank log the first's line is read
    from); a damaged run.json is said at start; a binary `.latest_run` is named as such."""
    run = tmp_path / "cartpole" / "run"
    train = [BIN / "mjlab-train", "cartpole", *SMALL, "--run-dir", run]
    first = subprocess.Popen(
        [*train, "--max-iterations", "100000"],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_iteration(tmp_path, 1)  # it writes the run
        # A rank of torchrun: no launcher checked before it (as with two commands started at
        # once, both past their launcher's check); it is refused and writes nothing there.
        torchrun = [BIN / "torchrun", "--nproc_per_node=1", f"--master_port={free_port()}"]
        second = subprocess.run(
            [*torchrun, "--no_python", *train, "--max-iterations", "100000"],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode != 0 and "another training is writing" in second.stderr
        first.send_signal(signal.SIGINT)
        err = first.communicate(timeout=120)[1]
    finally:
        first.kill()
    assert first.returncode == EXIT_STOPPED, err
    assert err.splitlines()[-1].startswith("stopped at iteration"), err  # its own line
    log = (run / "logs" / "rank0.log").read_text()
    assert "refused" not in log and log.count("exit:") == 1, log

    (run / "run.json").write_text("{torn")
    at = int(err.splitlines()[-1].split()[3])  # stopped at iteration N
    damaged = subprocess.run(
        [*train, "--max-iterations", str(at + 1)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert damaged.returncode == 0, _text(damaged)
    note = f"note: {run}/run.json is damaged (it is not JSON): this start keeps it as "
    assert note in damaged.stderr
    assert read_record(run).damaged_records[0].startswith("run.json.damaged-")

    latest_run_record(run.parent).write_bytes(b"\x00\xff\xfe")
    resume = subprocess.run(
        [BIN / "mjlab-train", "cartpole", "--resume", "--log-root", tmp_path],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = _text(resume)
    assert resume.returncode == EXIT_BAD_INPUT and "Traceback" not in said, said
    assert ".latest_run.0 is damaged (it holds 3 bytes that are not text" in said, said


def test_status_says_restarts_and_local_jobs_plainly() -> None:
    """A start no stop or fault came before was resumed by hand (not `1 ()`); a local job is
    its newest controller (not `384,2891 (local)`, read as two ranks)."""
    row = RunStatus(
        run_dir=Path("r"),
        kind="local",
        job_ids=("384", "2891"),
        state="COMPLETED",
        state_source="record",
        active=False,
        nodes=1,
        gpus_per_node=None,
        ranks=2,
        iteration=6,
        total=6,
        env_steps_per_s=None,
        mean_reward=None,
        restarts=1,
        restart_reasons=(),
        sweep=None,
    )
    cells = _row(row)
    assert cells[0] == "2891 (local)" and cells[6] == "1 (resumed)", cells
    crashed = dataclasses.replace(
        row,
        kind="slurm",
        job_ids=("7",),
        state="RUNNING",
        state_source="squeue",
        active=True,
        restarts=2,
        restart_reasons=("crash",),
    )
    assert _row(crashed)[6] == "2 (crash, resumed)"


def test_a_cancel_record_that_cannot_be_written_cancels_nothing(tmp_path: Path) -> None:
    why = _marked(tmp_path / "gone", ["1"])
    assert why is not None and "nothing was cancelled" in why
    assert _marked(tmp_path, ["1"]) is None and (tmp_path / CANCEL_RECORD).exists()

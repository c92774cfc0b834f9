"""Preemption, resume and faults with real processes.

Covers a stop at a boundary, the checkpoint, a requeue through submitit's local executor, the
exact continuation, and kill -9 of a rank named as the cause. The stop machinery is tested on
its own too: what each signal means, agreement, exit codes, a lost supervisor. The Slurm
versions are in launch/test_slurm_jobs.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    BIN,
    cli_env,
    episode_metrics,
    only_run,
    progress_records,
    rank_pids,
    reference_digests,
    reference_metrics,
    wait_for_iteration,
)

from mjlab_hpc.errors import (
    EXIT_FAILED,
    EXIT_LOCAL_REQUEUE,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_STOPPED,
)
from mjlab_hpc.rank.context import ALLOCATION_ENV, DistContext
from mjlab_hpc.rank.signals import (
    Stop,
    StopKind,
    StopRequest,
    classify,
    watch_signals,
    why_signalled,
)
from mjlab_hpc.rank.stop import Stopped, Supervision, after_stop, agree, agree_boundary
from mjlab_hpc.rundir.record import read_record

COMMON = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1"]
COMMON += ["--save-interval", "100"]


@pytest.mark.training
def test_three_preemptions_local_executor_exact(tmp_path: Path, shared_tmp: Path) -> None:
    """USR2 three times through submitit's local executor: every stop checkpoints, the ranks
    exit for a requeue, the executor restarts them, and the run ends with exactly K
    iterations and the parameters of an uninterrupted run."""
    iters, root = 12, tmp_path / "job"
    cmd = [BIN / "mjlab-submit", *COMMON, "--max-iterations", str(iters), "--executor", "local"]
    cmd += ["--gpus-per-node", "0", "--tasks-per-node", "2", "--log-root", str(root), "--follow"]
    proc = subprocess.Popen(
        cmd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for n, at in enumerate((2, 5, 8), start=1):
        run = wait_for_iteration(root, at)
        pids = rank_pids(run)
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        # Wait for this stop's checkpoint before aiming at the next one.
        record = run.path / "restarts.jsonl"
        deadline = time.monotonic() + 60
        while not (record.exists() and len(record.read_text().splitlines()) >= n):
            assert time.monotonic() < deadline, f"stop {n} was not recorded"
            time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    run = only_run(root)
    restarts = [json.loads(x) for x in (run.path / "restarts.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in restarts] == ["time-limit"] * 3
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == iters and summary["ranks_in_sync"]
    assert sorted({r["iteration"] for r in progress_records(run)}) == list(range(1, iters + 1))
    reference = reference_digests(shared_tmp, [*COMMON, "--max-iterations", str(iters)], 2)
    assert summary["param_digest_per_rank"] == reference
    assert rank_pids(run) == []


@pytest.mark.training
def test_resume_by_hand_is_exact(tmp_path: Path, shared_tmp: Path) -> None:
    """SIGTERM to a plain process (a `kill`, not a scheduler): checkpoint, exit 3 with the
    command that resumes it, no traceback; that command continues exactly, its logged
    metrics included."""
    iters, root = 8, tmp_path / "job"
    args = [BIN / "mjlab-train", *COMMON, "--max-iterations", str(iters), "--log-root", str(root)]
    proc = subprocess.Popen(
        args, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_iteration(root, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert "Traceback" not in err
    run = only_run(root)
    stop = json.loads(run.restarts.read_text())
    assert (stop["reason"], stop["kind"], stop["signal"]) == ("terminated", "stop", "SIGTERM")
    assert not run.summary.exists()
    (line,) = [x for x in err.splitlines() if "resume with:" in x]
    assert f"stopped at iteration {stop['iteration']} (terminated, SIGTERM)" in line
    resume = line.split("resume with: ", 1)[1].split()
    assert resume[0] == "mjlab-train" and resume[-2:] == ["--run-dir", str(run.path)]
    again = subprocess.run(
        [BIN / resume[0], *resume[1:]], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(only_run(root).summary.read_text())
    assert summary["resumed_from"] == stop["iteration"] and summary["iterations"] == iters
    reference = [*COMMON, "--max-iterations", str(iters)]
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, reference)
    # The mean reward and episode length logged after the resume are the uninterrupted run's
    # (the episode statistics were saved with the rank's state), not those of a fresh start.
    logged = episode_metrics(only_run(root))
    assert logged == reference_metrics(shared_tmp, reference)
    assert logged[stop["iteration"]][1] is not None  # episodes had ended: it says something


@pytest.mark.training
def test_kill_one_rank_ends_the_job_and_names_it(tmp_path: Path) -> None:
    """kill -9 of rank 1 mid-run with self-healing off (--max-restarts 0): the job ends
    promptly, leaves nothing, and the launcher, `status` and `logs` name rank 1 as the cause,
    not rank 0 that lost its peer. (With healing: tests/launch/test_healing.py.)"""
    cmd = [BIN / "mjlab-train", *COMMON, "--max-iterations", "1000", "--num-procs", "2"]
    cmd += ["--log-root", str(tmp_path), "--dist-timeout-s", "300", "--max-restarts", "0"]
    proc = subprocess.Popen(
        cmd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = wait_for_iteration(tmp_path, 2)
    pids = rank_pids(run)
    assert len(pids) == 2
    victim = max(pids)  # the later-started task: rank 1
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=200)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_FAILED
    said = " ".join(err.split())
    assert "failed at iteration" in said and "rank 1 on" in said, said
    assert "ended without an exit record (killed by a signal" in said
    assert elapsed < 150  # far inside the collective timeout: gloo sees the closed socket
    assert rank_pids(run) == []
    (fault,) = read_record(run.path).faults  # recorded, not healed: restarts exhausted
    assert fault.kind == "failed" and "--max-restarts 0" in str(fault.action), fault
    assert fault.reason == "crash" and fault.ranks == (1,)
    status = subprocess.run(
        [BIN / "mjlab-hpc", "status", "--json", str(run.path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    row = json.loads(status.stdout)[0]
    assert row["state"] == "FAILED" and row["cause"].startswith("rank 1 on "), row
    logs = subprocess.run(
        [BIN / "mjlab-hpc", "logs", str(run.path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    first = logs.stdout.splitlines()[0]
    assert first.startswith("cause: rank 1 on ") and "killed" in first, logs.stdout[:500]


@pytest.mark.parametrize(
    ("signum", "mode", "kind", "reason"),
    [
        (signal.SIGUSR2, "slurm", StopKind.REQUEUE, "time-limit"),
        (signal.SIGUSR2, "single", StopKind.REQUEUE, "time-limit"),
        (signal.SIGTERM, "slurm", StopKind.REQUEUE, "preemption"),
        (signal.SIGTERM, "submitit-local", StopKind.FOR_GOOD, "terminated"),
        (signal.SIGTERM, "single", StopKind.FOR_GOOD, "terminated"),
        (signal.SIGINT, "slurm", StopKind.FOR_GOOD, "interrupt"),
        (signal.SIGHUP, "torchrun", StopKind.FOR_GOOD, "hangup"),
        (signal.SIGQUIT, "slurm", StopKind.FOR_GOOD, "terminated"),
        (signal.SIGXCPU, "single", StopKind.FOR_GOOD, "terminated"),
    ],
)
def test_what_each_signal_means(signum: int, mode: str, kind: StopKind, reason: str) -> None:
    assert classify(signum, mode, time_limit_signal="USR2") == (kind, reason)


def _alone(request: StopRequest) -> Stop | None:
    """What one process on the CPU, in no process group, agrees to stop for."""
    return agree(request, distributed=False, device="cpu")


def test_handlers_record_the_strongest_stop_and_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    request = StopRequest("submitit-local", "USR2")
    with watch_signals(request):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        assert _alone(request) == Stop(StopKind.REQUEUE, "time-limit", signal.SIGUSR2)
        # Ctrl-C reaches the ranks, and SIGTERM through the launcher: the stop says interrupt.
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert _alone(request) == Stop(StopKind.FOR_GOOD, "interrupt", signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGUSR2) is before


def test_signals_that_save_or_are_ignored_stop_nothing() -> None:
    """USR1 (and USR2 or URG when not the time-limit signal) asks for a checkpoint at the next
    boundary, ALRM and the like are ignored: none of them stops or ends the rank; under Slurm
    a second INT (to the step and through the batch shell) is not a second Ctrl-C."""
    request = StopRequest("slurm", "USR2")
    with watch_signals(request):
        for sig in (signal.SIGUSR1, signal.SIGALRM, signal.SIGVTALRM, signal.SIGIO):
            os.kill(os.getpid(), sig)
        time.sleep(0.01)
        assert request.save == signal.SIGUSR1
        assert request.ignored == [signal.SIGALRM, signal.SIGVTALRM, signal.SIGIO]
        stop, save, _ = agree_boundary(request, distributed=False, device="cpu")
        assert stop is None and save
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert _alone(request) == Stop(StopKind.FOR_GOOD, "interrupt", signal.SIGINT)
    limit = StopRequest("slurm", "USR1")  # USR1 as the time-limit signal: a stop then
    limit.handler(signal.SIGUSR1, None)
    assert limit.code and not limit.save
    urgent = StopRequest("slurm", "URG")
    urgent.handler(signal.SIGUSR2, None)
    assert urgent.save == signal.SIGUSR2 and urgent.code == 0


_TERM = Stop(StopKind.REQUEUE, "preemption", signal.SIGTERM)
_USR2 = Stop(StopKind.REQUEUE, "time-limit", signal.SIGUSR2)
# Slurm's view of a job (`scontrol show job`) when its ranks get a TERM.
_PREEMPTED = {"JobState": "RUNNING", "PreemptTime": "2026-11-27T16:52:26"}  # GraceTime: it runs
_REQUEUED = {"JobState": "COMPLETING", "Restarts": "3"}  # scontrol requeue: restarts went up
_RUNNING = {"JobState": "RUNNING", "Restarts": "2", "PreemptTime": "None"}  # scancel --signal=TERM
_ENDING = {"JobState": "COMPLETING", "Restarts": "2"}  # scancel (--signal=KILL too): not requeued
_PAST_LIMIT = {**_ENDING, "TimeLimit": "00:10:00", "RunTime": "00:10:01"}


@pytest.mark.parametrize(
    ("stop", "job", "lost", "first", "kind", "reason"),
    [
        (_TERM, None, [], False, StopKind.REQUEUE, "preemption"),  # Slurm did not answer
        (_TERM, {"JobState": "CANCELLED"}, [], False, StopKind.FOR_GOOD, "cancelled"),
        (_TERM, _PREEMPTED, [], False, StopKind.REQUEUE, "preemption"),
        (_TERM, _REQUEUED, [], False, StopKind.REQUEUE, "requeue"),
        (_TERM, _REQUEUED, ["node2"], False, StopKind.REQUEUE, "node-lost"),
        (_TERM, _RUNNING, [], False, StopKind.FOR_GOOD, "terminated"),  # a person's stop
        (_TERM, _ENDING, [], False, StopKind.FOR_GOOD, "cancelled"),
        (_TERM, _PAST_LIMIT, [], False, StopKind.REQUEUE, "time-limit"),
        (_USR2, {"TimeLimit": "00:01:00"}, [], False, StopKind.REQUEUE, "time-limit"),
        (_USR2, {"TimeLimit": "00:01:00"}, [], True, StopKind.FOR_GOOD, "time-limit"),
    ],
)
def test_why_slurm_signalled(
    stop: Stop, job: dict | None, lost: list, first: bool, kind: StopKind, reason: str
) -> None:
    got = why_signalled(stop, job, restart_count=2, lost=lost, before_first_iteration=first)
    assert (got.kind, got.reason) == (kind, reason), got
    if first:
        assert "came before this start's first iteration (time limit 00:01:00" in got.why


def test_a_time_limit_that_leaves_no_room_is_not_requeued() -> None:
    """A time limit no longer than --signal-delay-s: every start would be signalled before it
    trains, so the stop is for good and says why (scontrol update JobId=J TimeLimit=...);
    with room after the signal, the job is requeued."""
    job = {"JobId": "7", "TimeLimit": "00:01:00"}
    short = why_signalled(_USR2, job, restart_count=0, delay_s=90)
    assert (short.kind, short.reason) == (StopKind.FOR_GOOD, "time-limit")
    assert short.why.startswith(
        "not requeued: the job's time limit (00:01:00) is no longer than --signal-delay-s 90"
    ), short.why
    assert "scontrol update JobId=7 TimeLimit=" in short.why
    roomy = {**job, "TimeLimit": "00:02:00"}
    assert why_signalled(_USR2, roomy, restart_count=0, delay_s=90) == _USR2


def test_a_lost_supervisor_is_a_stop_for_good() -> None:
    child = subprocess.Popen(["sleep", "30"])
    request = StopRequest("submitit-local")
    env = {"_MJLAB_HPC_SUPERVISOR_PIDS": str(child.pid)}
    with Supervision(request, watch_parent=True, env=env, poll_s=0.05) as watch:
        time.sleep(0.2)
        assert _alone(request) is None and watch.lost is None
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while watch.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert watch.lost == f"its launcher (pid {child.pid}) is gone"
    assert _alone(request) == Stop(StopKind.FOR_GOOD, "supervisor-lost", 0)


_SLURM = {
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_JOB_ID": "9",
}
_LOCAL = {
    "SUBMITIT_LOCAL_GLOBALID": "0",
    "SUBMITIT_LOCAL_LOCALID": "0",
    "SUBMITIT_LOCAL_NTASKS": "2",
}
_TIME_LIMIT = Stop(StopKind.REQUEUE, "time-limit", signal.SIGUSR2)
_INTERRUPT = Stop(StopKind.FOR_GOOD, "interrupt", signal.SIGINT)


@pytest.mark.parametrize(
    ("env", "stop", "restarts", "code"),
    [
        (_LOCAL, _TIME_LIMIT, 0, EXIT_LOCAL_REQUEUE),
        (_LOCAL, _TIME_LIMIT, 10, EXIT_FAILED),  # restarts used up: no requeue
        (_LOCAL, _INTERRUPT, 0, EXIT_STOPPED),  # a stop for good is never requeued
        ({}, _TIME_LIMIT, 0, EXIT_STOPPED),  # nothing requeues a plain process
        (_SLURM, _TIME_LIMIT, 3, EXIT_FAILED),
        (_SLURM, _INTERRUPT, 0, EXIT_STOPPED),
    ],
)
def test_after_stop_exit_codes(env: dict, stop: Stop, restarts: int, code: int) -> None:
    ctx = DistContext.from_env(env)
    max_restarts = 3 if env is _SLURM else 10
    stopped = Stopped(iteration=4, stop=stop, ctx=ctx, restarts=restarts)
    assert after_stop(stopped, max_restarts) == code
    assert EXIT_OK == 0


def test_a_requeue_that_cannot_reach_slurmctld_is_left_to_the_batch_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's `scontrol requeue` with slurmctld away: one try (a stop has only KillWait),
    then exit 75, which the batch script's requeue takes over (it waits for slurmctld)."""
    calls = tmp_path / "calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(
        f'#!/bin/bash\necho "$@" >> {calls}\n'
        'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2\n'
        "exit 1\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(ALLOCATION_ENV, raising=False)
    stopped = Stopped(iteration=4, stop=_TIME_LIMIT, ctx=DistContext.from_env(_SLURM))
    assert after_stop(stopped, 3) == EXIT_REQUEUE
    assert calls.read_text().splitlines() == ["show job 9"]  # the requeue: answered at once


@pytest.mark.training
def test_every_rank_stopped_past_the_collective_timeout_is_frozen_then_on(tmp_path: Path) -> None:
    """STOP then CONT to every rank (what `scontrol suspend` and Ctrl-Z do), three times, each
    longer than --dist-timeout-s and --hang-timeout-s, in the middle of the iterations: no
    collective times out (one waited already when the suspend came), no hang, no fault, no
    restart; the run ends with every iteration once."""
    iters, root = 60, tmp_path / "job"
    cmd = [BIN / "mjlab-submit", *COMMON, "--max-iterations", str(iters), "--executor", "local"]
    cmd += ["--gpus-per-node", "0", "--tasks-per-node", "2", "--log-root", str(root)]
    # The collective timeout bounds a start's first iteration alone: long enough for one
    # under load, shorter than each suspend.
    cmd += ["--dist-timeout-s", "10", "--hang-timeout-s", "3", "--follow"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for at in (3, 20, 40):
            run = wait_for_iteration(root, at)
            pids = rank_pids(run)
            assert len(pids) == 2, pids
            for pid in pids:  # one after the other, as on two nodes: the last waits in a
                os.kill(pid, signal.SIGSTOP)  # collective for the first when it stops
                time.sleep(1)
            time.sleep(11)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode(errors="replace")
    assert proc.returncode == EXIT_OK, text[-3000:]
    record = read_record(run.path)
    assert record.faults == () and record.restarts == () and len(record.starts) == 1, record
    assert [p["iteration"] for p in progress_records(run)] == list(range(1, iters + 1))

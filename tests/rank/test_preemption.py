"""Preemption, resume and faults with real processes (the Slurm versions are in
launch/test_slurm_jobs.py): stop at a boundary, checkpoint, requeue through submitit's local
executor, exact continuation, kill -9 of a rank; the stop signals and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run, rank_pids, wait_for_iteration

from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.preemption import (
    LOCAL_REQUEUE_EXIT_CODE,
    STOPPED_EXIT_CODE,
    Stopped,
    after_stop,
    stop_reason,
    watch_signals,
)

COMMON = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1",
          "--save-interval", "100"]  # fmt: skip


def reference_digests(tmp_path: Path, iters: int, ranks: int) -> list[str]:
    args = [*COMMON, "--max-iterations", str(iters), "--log-root", str(tmp_path / "ref")]
    if ranks > 1:
        args += ["--num-procs", str(ranks)]
    proc = subprocess.run([BIN / "mjlab-train", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(only_run(tmp_path / "ref").summary.read_text())["param_digest_per_rank"]


@pytest.mark.training
def test_three_preemptions_local_executor_exact(tmp_path: Path) -> None:
    """USR2 three times through submitit's local executor: every stop checkpoints, the ranks
    exit for a requeue, the executor restarts them, and the run ends with exactly K
    iterations and the parameters of an uninterrupted run."""
    iters, root = 12, tmp_path / "job"
    proc = subprocess.Popen(
        [BIN / "mjlab-submit", *COMMON, "--max-iterations", str(iters), "--executor", "local",
         "--gpus-per-node", "0", "--tasks-per-node", "2", "--log-root", str(root), "--follow"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
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
    assert sorted({r["iteration"] for r in run.read_progress()}) == list(range(1, iters + 1))
    assert summary["param_digest_per_rank"] == reference_digests(tmp_path, iters, 2)
    assert rank_pids(run) == []


@pytest.mark.training
def test_resume_by_hand_is_exact(tmp_path: Path) -> None:
    iters, root = 8, tmp_path / "job"
    args = [BIN / "mjlab-train", *COMMON, "--max-iterations", str(iters), "--log-root", str(root)]
    proc = subprocess.Popen(args, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_iteration(root, 3)
    proc.send_signal(signal.SIGTERM)  # a preemption, for a plain process
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_EXIT_CODE, err
    assert "--resume" in err
    run = only_run(root)
    stop = json.loads((run.path / "restarts.jsonl").read_text())
    assert stop["reason"] == "preemption" and not run.summary.exists()
    again = subprocess.run([*args, "--resume"], env=cli_env(), capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(only_run(root).summary.read_text())
    assert summary["resumed_from"] == stop["iteration"] and summary["iterations"] == iters
    assert summary["param_digest_per_rank"] == reference_digests(tmp_path, iters, 1)


@pytest.mark.training
def test_kill_one_rank_ends_the_job(tmp_path: Path) -> None:
    """kill -9 of rank 1 mid-run: the job ends promptly, names the dead rank, leaves nothing."""
    proc = subprocess.Popen(
        [BIN / "mjlab-train", *COMMON, "--max-iterations", "1000", "--num-procs", "2",
         "--log-root", str(tmp_path), "--dist-timeout-s", "60"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run = wait_for_iteration(tmp_path, 2)
    pids = rank_pids(run)
    assert len(pids) == 2
    victim = max(pids)  # the later-started task: rank 1
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert "rank 1 died without a result" in " ".join(err.split())
    assert elapsed < 60  # well inside the collective timeout: gloo sees the closed socket
    assert rank_pids(run) == []


def test_signal_handlers_only_record_and_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with watch_signals(("USR2", "TERM")) as request:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        assert request.signum == signal.SIGUSR2 and request.signaled_at is not None
    assert signal.getsignal(signal.SIGUSR2) is before
    assert stop_reason(signal.SIGUSR2, "USR2") == "time-limit"
    assert stop_reason(signal.SIGTERM, "USR2") == "preemption"


@pytest.mark.parametrize(
    ("env", "max_restarts", "code"),
    [
        ({"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0",
          "SUBMITIT_LOCAL_NTASKS": "2"}, 10, LOCAL_REQUEUE_EXIT_CODE),
        ({}, 10, STOPPED_EXIT_CODE),
        # Restart limit reached: no requeue is attempted, the job ends with an error.
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
          "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "9",
          "SLURM_RESTART_COUNT": "3"}, 3, 1),
    ],
)  # fmt: skip
def test_after_stop_exit_codes(env: dict[str, str], max_restarts: int, code: int) -> None:
    ctx = DistContext.from_env(env, scontrol=None)
    assert after_stop(Stopped(4, "time-limit", signal.SIGUSR2, ctx), None, max_restarts) == code

"""Every way a run stops, with real processes and real signals, as a user meets them.

The stops: Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it), a
second Ctrl-C, SIGTERM to the launcher, kill -9 of the launcher or of submitit's local
controller. Then resuming: several ranks, damaged checkpoints, another task, a copied log
root. Each test asserts the exit code, the checkpoint, run.json, the closing line and that no
process is left. Time limits and preemption are in test_preemption.py, Slurm in
launch/test_slurm_jobs.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    BIN,
    Team,
    cli_env,
    episode_metrics,
    only_run,
    progress_records,
    reference_digests,
    reference_metrics,
    wait_for,
    wait_for_iteration,
)

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_STOPPED
from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.procs import alive
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.training

COMMON = ["cartpole", "--num-envs", "32", "--seed", "3", "--torch-threads", "1"]
COMMON += ["--save-interval", "100"]
TWO = ["--num-procs", "2"]


def start(tmp: Path, args: list[str], prog: str = "mjlab-train") -> subprocess.Popen[str]:
    """A command in a session of its own, as a terminal would run it in the foreground (its
    process group receives the terminal's Ctrl-C)."""
    return subprocess.Popen(
        [BIN / prog, *args],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def all_gone(run: RunDir, launcher: int | None = None, timeout: float = 60) -> None:
    """No process of the run is left (rank, controller, launcher) within `timeout`."""

    def gone() -> bool:
        if local_processes(run.path):
            return False
        return launcher is None or not alive(launcher)

    wait_for(gone, timeout, f"no process left of {run.path}", poll=0.2)


def closing_line(err: str) -> str:
    lines = [x for x in err.splitlines() if "resume with:" in x]
    assert lines, err[-2000:]
    return lines[-1]


def test_ctrl_c_stops_two_ranks_with_a_checkpoint_and_resume_continues_exactly(
    tmp_path: Path, shared_tmp: Path
) -> None:
    """Ctrl-C at iteration 3 of `mjlab-train --num-procs 2`: every rank stops at the next
    boundary with a checkpoint, exit 3, one closing line naming the resume command, no
    traceback, nothing left running; `--resume` on two ranks continues that same run to the
    end, one progress line per iteration, with an uninterrupted run's parameters and logged
    mean reward and episode length."""
    root, iters = tmp_path / "logs", 8
    args = [*COMMON, *TWO, "--max-iterations", str(iters), "--log-root", str(root)]
    proc = start(tmp_path, args)
    run = wait_for_iteration(root, 3)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    assert "Traceback" not in err and "[train] it 3/8" in out
    all_gone(run)
    stop = read_record(run.path).restarts[-1]
    assert (stop.reason, stop.kind, stop.signal) == ("interrupt", "stop", "SIGINT")
    assert stop.iteration is not None and run.checkpoint(stop.iteration).exists()
    line = closing_line(err)
    assert line.startswith(f"stopped at iteration {stop.iteration} (interrupt, SIGINT)")

    again = subprocess.run(
        [BIN / "mjlab-train", *args, "--resume"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert only_run(root) == run  # the same run, not a new one
    assert "done: 8 iterations" in again.stdout
    summary = json.loads(run.summary.read_text())
    assert summary["resumed_from"] == stop.iteration and summary["ranks_in_sync"]
    assert [r["iteration"] for r in progress_records(run)] == list(range(1, iters + 1))
    uninterrupted = [*COMMON, "--max-iterations", str(iters)]
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, uninterrupted, 2)
    # Rank 0's episode statistics came back with its state: the same metrics are logged.
    assert episode_metrics(run) == reference_metrics(shared_tmp, uninterrupted, 2)


REASONS = {
    "sigterm-launcher": "terminated",
    "hangup-group": "hangup",
    "kill-controller": "supervisor-lost",
    "kill-launcher": "supervisor-lost",
}


@pytest.mark.parametrize("how", sorted(REASONS))
def test_a_stopped_or_lost_launcher_leaves_no_rank_behind(tmp_path: Path, how: str) -> None:
    """SIGTERM to the launcher (as `timeout` sends it), SIGHUP to the whole foreground group
    (the terminal closed), kill -9 of submitit's controller, kill -9 of the launcher: the
    ranks notice within seconds, stop at the next boundary with a checkpoint, and nothing is
    left running; nothing requeues them."""
    root = tmp_path / "logs"
    proc = start(tmp_path, [*COMMON, *TWO, "--max-iterations", "1000", "--log-root", str(root)])
    run = wait_for_iteration(root, 3)
    if how == "sigterm-launcher":
        proc.send_signal(signal.SIGTERM)
    elif how == "hangup-group":
        os.killpg(proc.pid, signal.SIGHUP)
    elif how == "kill-launcher":
        proc.kill()
    else:
        (controller,) = [p.pid for p in local_processes(run.path) if p.role == "controller"]
        os.kill(controller, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    all_gone(run)
    record = read_record(run.path)
    stop = record.restarts[-1]
    assert record.state == "stopped" and stop.kind == "stop"
    assert stop.reason == REASONS[how]
    assert stop.iteration is not None and run.checkpoint(stop.iteration).exists()
    done = len(progress_records(run))
    assert done == stop.iteration  # stopped for good: no requeue trained on
    if how == "kill-launcher":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == EXIT_STOPPED, err[-2000:]
        assert f"stopped at iteration {stop.iteration}" in closing_line(err)


def test_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """`mjlab-submit --executor local --follow`: Ctrl-C twice (and a third time) stops the
    job at once (exit 130), says so, no traceback, and leaves nothing running."""
    root = tmp_path / "logs"
    # Iterations long enough (~2 s) that the first Ctrl-C's stop is still pending.
    args = [*COMMON, "--num-envs", "512", "--executor", "local", "--gpus-per-node", "0"]
    args += ["--tasks-per-node", "2", "--max-iterations", "1000", "--log-root", str(root)]
    proc = start(tmp_path, [*args, "--follow"], prog="mjlab-submit")
    run = wait_for_iteration(root, 1)
    for _ in range(3):  # impatient key presses (signals sent together are delivered as one)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert "stopped at once" in err and "Traceback" not in err
    all_gone(run)


def test_second_ctrl_c_while_kernels_compile_stops_the_ranks(tmp_path: Path) -> None:
    """`mjlab-train --num-procs 2` with a cold kernel cache: two SIGINTs to the launcher alone
    (a second Ctrl-C where the ranks do not share its terminal, or `kill -INT`) while the
    ranks compile (no heartbeat yet: the launcher finds them as its own children, not by
    their records) end every rank within seconds, exit 130, nothing said still alive, no
    checkpoint written after."""
    root, cache = tmp_path / "logs", tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    args = [*COMMON, *TWO, "--max-iterations", "1000", "--log-root", str(root)]
    proc = start(tmp_path, [*args, "--kernel-cache", str(cache)])
    run = RunDir(wait_for(lambda: list(root.glob("cartpole/2*")), 120, "the run", 0.05)[0])

    def compiling() -> bool:
        logs = [run.rank_log(r) for r in range(2)]
        return all(p.exists() and "kernel cache:" in p.read_text() for p in logs)

    wait_for(compiling, 120, "both ranks compiling", poll=0.05)
    assert not list(run.heartbeats.glob("rank*.json")), "compiled already: no cold start"
    for _ in range(2):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert "stopped at once" in err and "still alive" not in err, err[-2000:]
    all_gone(run, timeout=5)
    assert not list(run.path.glob("model_*.pt"))


def test_another_users_process_naming_the_run_is_not_waited_on(tmp_path: Path, team: Team) -> None:
    """A teammate's process whose arguments name the run's submitit folder (a `tail`, an
    editor) is none of the run's: `mjlab-train --num-procs 2` ends when its ranks do, and
    leaves the teammate's process alone."""
    root = tmp_path / "logs"
    args = [*COMMON, *TWO, "--max-iterations", "4", "--log-root", str(root)]
    proc = start(tmp_path, args)
    run = RunDir(wait_for(lambda: list(root.glob("cartpole/2*")), 120, "the run", 0.05)[0])
    naming = ["bash", "-c", "sleep 300; true", "bash", run.submitit.resolve()]
    bob = team.argv(Team.USERS[1], naming)
    other = subprocess.Popen(bob, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "done: 4 iterations" in out, err[-2000:]
        assert other.poll() is None  # not ours: neither waited on nor signalled
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_ctrl_c_in_one_process(tmp_path: Path) -> None:
    """A plain `mjlab-train`: Ctrl-C saves a checkpoint at the next boundary, exits 3 with the
    resume command and no traceback; run.json says stopped, not failed."""
    root = tmp_path / "logs"
    proc = start(tmp_path, [*COMMON, "--max-iterations", "1000", "--log-root", str(root)])
    run = wait_for_iteration(root, 2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    assert "Traceback" not in err
    record = read_record(run.path)
    stop = record.restarts[-1]
    assert record.state == "stopped" and stop.reason == "interrupt"
    assert stop.iteration is not None and run.checkpoint(stop.iteration).exists()
    assert closing_line(err).endswith(f"--run-dir {run.path}")
    # Said at once, not only once the iteration under way ends (it can take a minute).
    said = err.index("SIGINT: stopping at the next iteration boundary, with a checkpoint")
    assert said < err.index("stopped at iteration")


def test_ctrl_c_while_it_starts_and_twice_in_one_process(tmp_path: Path) -> None:
    """A plain `mjlab-train`: Ctrl-C while torch loads ends it at once (exit 130, one line, no
    traceback, no empty run directory left); Ctrl-C twice while training stops at once
    (exit 130), without waiting for the iteration under way."""
    root = tmp_path / "logs"
    proc = start(tmp_path, [*COMMON, "--max-iterations", "1000", "--log-root", str(root)])
    run = wait_for(lambda: list(root.glob("cartpole/2*")), 60, "the run directory", 0.02)[0]
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert err.strip().splitlines() == [
        "interrupted: stopped at once (Ctrl-C); nothing was started"
    ]
    assert not run.exists()
    proc = start(
        tmp_path,
        [*COMMON, "--num-envs", "512", "--max-iterations", "1000", "--log-root", str(root)],
    )
    run = wait_for_iteration(root, 1)
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert "interrupted at once" in closing_line(err) and "Traceback" not in err
    assert read_record(run.path).state == "interrupted"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _snapshot(run: RunDir) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.path.iterdir())
        if p.is_file()
    }


def test_resume_skips_damaged_checkpoints_and_refuses_what_it_cannot_continue(
    tmp_path: Path,
) -> None:
    """A damaged newest checkpoint is skipped, said on the console and in run.json, and set
    aside; progress.jsonl keeps one line per iteration. A run whose checkpoints are all
    damaged, a run of another task and a network of another shape are refused (exit 2)
    without changing anything; --restart-from-scratch trains again. A copied log root
    resumes in the copy."""
    root = tmp_path / "logs"
    base = [BIN / "mjlab-train", "cartpole", "--num-envs", "16", "--torch-threads", "1"]
    base += ["--save-interval", "2", "--log-root", str(root)]

    def train(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *extra], env=cli_env(), capture_output=True, text=True, timeout=300
        )

    first = train("--max-iterations", "6")
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(root)
    _flip(run.checkpoint(6))
    resumed = train("--max-iterations", "8", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipped damaged checkpoint model_6.pt" in resumed.stderr
    record = read_record(run.path)
    assert [s.name for s in record.skipped_checkpoints] == ["model_6.pt"]
    assert record.last_start.resumed_from_iteration == 4
    assert (run.path / "model_6.pt.damaged").exists()
    assert [r["iteration"] for r in progress_records(run)] == list(range(1, 9))

    # A copy of the log root resumes in the copy (records name runs, not absolute paths).
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    in_copy = subprocess.run(
        [*base[:-1], str(copy), "--max-iterations", "10", "--resume"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert in_copy.returncode == 0, in_copy.stderr[-2000:]
    assert (copy / "cartpole" / run.path.name / "model_10.pt").exists()
    assert not run.checkpoint(10).exists()

    for path in run.checkpoints():
        _flip(path)
    before = _snapshot(run)
    refused = train("--max-iterations", "10", "--resume")
    assert refused.returncode == EXIT_BAD_INPUT
    assert "--restart-from-scratch" in refused.stderr and "every checkpoint" in refused.stderr
    assert _snapshot(run) == before
    other_task = subprocess.run(
        [BIN / "mjlab-train", "ant", "--run-dir", str(run.path), "--num-envs", "16"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert other_task.returncode == EXIT_BAD_INPUT
    assert "holds a run of task 'cartpole'" in " ".join(other_task.stderr.split())
    assert _snapshot(run) == before

    fresh = train("--max-iterations", "2", "--resume", "--restart-from-scratch")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert read_record(run.path).last_start.resumed_from_iteration == 0
    assert [r["iteration"] for r in progress_records(run)] == [1, 2]
    other_shape = train("--max-iterations", "4", "--resume", "--agent.actor.hidden-dims", "[64,64]")
    assert other_shape.returncode == EXIT_BAD_INPUT, other_shape.stderr[-2000:]
    assert "network of another shape" in other_shape.stderr
    assert read_record(run.path).state == "completed"  # unchanged by the refusal


def test_submit_local_resume_continues_on_two_ranks(tmp_path: Path) -> None:
    """`mjlab-submit --executor local --resume` continues the latest run on as many ranks,
    in the same run directory, one progress line per iteration."""
    root = tmp_path / "logs"
    args = [*COMMON, "--executor", "local", "--gpus-per-node", "0", "--tasks-per-node", "2"]
    args += ["--log-root", str(root), "--follow"]

    def submit(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [BIN / "mjlab-submit", *args, *extra],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = submit("--max-iterations", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(root)
    again = submit("--max-iterations", "4", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert only_run(root) == run and "done: 4 iterations" in again.stdout
    summary = json.loads(run.summary.read_text())
    assert summary["resumed_from"] == 2 and summary["world_size"] == 2
    assert summary["ranks_in_sync"]
    assert [r["iteration"] for r in progress_records(run)] == [1, 2, 3, 4]
    all_gone(run)


def test_a_terminal_shows_the_live_bar_on_several_ranks(tmp_path: Path) -> None:
    """In a terminal (a pseudo-terminal here), `--num-procs 2` shows rank 0's progress as a
    live bar, like one process does, and ends with the one-line summary; no CUDA driver
    warning on a machine without a GPU."""
    import pty

    root = tmp_path / "logs"
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [BIN / "mjlab-train", *COMMON, *TWO, "--max-iterations", "4", "--log-root", str(root)],
        env={**cli_env(), "TERM": "xterm", "COLUMNS": "120"},
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: every process that had it exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in screen and "━" in screen, screen[-2000:]  # rich's live bar
    assert "4/4" in screen and "[train] it" not in screen
    assert "done: 4 iterations" in screen
    assert "CUDA driver" not in screen


def test_a_refused_resume_on_two_ranks_is_bad_input(tmp_path: Path) -> None:
    """`--num-procs 2 --resume` with networks of another shape: the ranks refuse before
    anything changes; the launcher says so with exit 2 (not the run's earlier "done")."""
    root = tmp_path / "logs"
    args = [*COMMON, *TWO, "--max-iterations", "2", "--log-root", str(root)]
    first = subprocess.run(
        [BIN / "mjlab-train", *args], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(root)
    before = _snapshot(run)
    resume = ["--max-iterations", "4", "--resume", "--agent.actor.hidden-dims", "[64,64]"]
    other = subprocess.run(
        [BIN / "mjlab-train", *args, *resume],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert other.returncode == EXIT_BAD_INPUT, other.stdout[-1000:] + other.stderr[-2000:]
    assert "network of another shape" in other.stderr and "done:" not in other.stdout
    assert {k: v for k, v in _snapshot(run).items() if k != "run.json"} == {
        k: v for k, v in before.items() if k != "run.json"
    }
    assert read_record(run.path).state == "completed"
    all_gone(run)

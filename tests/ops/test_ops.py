"""mjlab-hpc status, logs, cancel and plot, and mjlab-submit --sweep, through the local executor.

The jobs are real and start together (one fixture), then run side by side while the tests
look at them: a job whose rank 1 raises at iteration 3, a long job to watch and cancel, and
a two-element sweep to plot. The parsing of sweeps and tracebacks is tested here too. The
Slurm versions are in test_slurm_ops.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    BIN,
    cli_env,
    fault_env,
    progress_records,
    runs_under,
    wait_for,
    wait_for_iteration,
)

from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.ops.cancel import cancel_local
from mjlab_hpc.ops.logs import RankFiles, find_tracebacks, tracebacks_in
from mjlab_hpc.ops.status import disk_bytes
from mjlab_hpc.procs import alive
from mjlab_hpc.rundir.layout import RunDir

SMALL = ["--num-envs", "32", "--torch-threads", "1", "--gpus-per-node", "0"]


def hpc(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run `mjlab-hpc ARGS`; the finished process (text output)."""
    return subprocess.run(
        [BIN / "mjlab-hpc", *args],
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status_json(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    proc = hpc("status", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def iterations_done(run: Path) -> int:
    return len(progress_records(RunDir(run)))


def wait_ended(run: Path, env: dict[str, str] | None = None, timeout: float = 180) -> dict:
    def ended() -> dict | None:
        row = status_json(str(run), env=env)[0]
        return None if row["active"] else row

    return wait_for(ended, timeout, f"end of {run}", poll=1.0)


@dataclass(frozen=True)
class LocalJobs:
    failing: Path
    """Log root of a 2-rank job whose rank 1 raises at iteration 3."""
    long: Path
    """Log root of a 2-rank job of 5000 iterations (watched, then cancelled)."""
    sweep: Path
    """Log root of a sweep seed=1,2 of 1-rank jobs, 3 iterations each."""
    sweep_follow: subprocess.Popen
    """Its mjlab-submit --follow, still waiting for the elements."""
    sweep_output: Path
    long_group: int
    """The process group the long job's mjlab-submit ran in (as a terminal's foreground
    command): the job runs in the background, so that terminal's signals must not reach it."""


@pytest.fixture(scope="module")
def local_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalJobs]:
    root = tmp_path_factory.mktemp("ops")
    local = ["cartpole", "--executor", "local", *SMALL]
    failing = [*local, "--tasks-per-node", "2", "--max-iterations", "50", "--max-restarts", "0"]
    failing += ["--log-root", str(root / "failing")]
    long = [*local, "--tasks-per-node", "2", "--max-iterations", "5000"]
    long += ["--log-root", str(root / "long")]
    sweep = [*local, "--tasks-per-node", "1", "--max-iterations", "3", "--sweep", "seed=1,2"]
    sweep += ["--log-root", str(root / "sweep"), "--follow"]
    commands = [
        (failing, fault_env(root / "fault", rank=1, iteration=3)),
        (long, {}),
        (sweep, {}),
    ]
    # Output to files, not pipes: the jobs' processes inherit them and outlive mjlab-submit.
    procs = []
    for n, (args, extra) in enumerate(commands):
        with open(root / f"submit{n}.out", "w") as out:
            procs.append(
                subprocess.Popen(
                    [BIN / "mjlab-submit", *args],
                    env=cli_env(extra),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    for n, proc in enumerate(procs[:2]):  # submitting returns at once: the jobs run on
        assert proc.wait(timeout=120) == 0, (root / f"submit{n}.out").read_text()
    jobs = LocalJobs(
        failing=root / "failing",
        long=root / "long",
        sweep=root / "sweep",
        sweep_follow=procs[2],
        sweep_output=root / "submit2.out",
        long_group=procs[1].pid,
    )
    try:
        yield jobs
    finally:
        if jobs.sweep_follow.poll() is None:
            jobs.sweep_follow.kill()
        for log_root in (jobs.failing, jobs.long, jobs.sweep):
            for run in runs_under(log_root):
                cancel_local(run, grace_s=5)  # leave no process, whatever a test did


@pytest.mark.training
def test_status_then_cancel_local_job(local_jobs: LocalJobs) -> None:
    """A running local job: status shows RUNNING and its iteration; cancel stops it with a
    checkpoint and leaves no process; status then says CANCELLED."""
    run = wait_for_iteration(local_jobs.long, 3).path
    pids = [p.pid for p in local_processes(run)]
    assert len(pids) == 3  # the controller and two ranks
    before = iterations_done(run)
    row = status_json(str(run))[0]
    after = iterations_done(run)
    assert row["state"] == "RUNNING" and row["state_source"] == "process" and row["active"]
    assert row["kind"] == "local" and row["ranks"] == 2 and row["nodes"] == 1
    assert before <= row["iteration"] <= after and row["total"] == 5000
    controller = row["job_ids"][-1]
    assert int(controller) in pids
    # The same run by job id (the controller's pid), and in the listing of the log root.
    assert status_json(controller, "--log-root", str(local_jobs.long))[0]["run_dir"] == str(run)
    table = hpc("status", "--log-root", str(local_jobs.long))
    assert table.returncode == 0 and "RUNNING" in table.stdout and run.name in table.stdout
    # A job submitted to the background ignores the terminal it came from.
    os.killpg(local_jobs.long_group, signal.SIGINT)
    os.killpg(local_jobs.long_group, signal.SIGHUP)
    trained = iterations_done(run)
    wait_for(lambda: iterations_done(run) >= trained + 2, 60, "training after Ctrl-C and SIGHUP")
    assert sorted(p.pid for p in local_processes(run)) == sorted(pids)

    # logs --follow streams every rank's new lines until the job ends (here: the cancel).
    followed = local_jobs.long / "follow.out"
    with open(followed, "w") as out:
        follower = subprocess.Popen(
            [BIN / "mjlab-hpc", "logs", str(run), "--follow"],
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_for(lambda: "[rank 1] " in followed.read_text(), 60, "followed lines of rank 1")
    proc = hpc("cancel", str(run), "--grace-s", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no process left" in " ".join(proc.stdout.split())
    assert follower.wait(timeout=30) == 0
    lines = followed.read_text().splitlines()
    for rank in (0, 1):
        assert any(
            line.startswith(f"[rank {rank}] ") and "stopped at iteration" in line for line in lines
        ), lines[-10:]
    assert local_processes(run) == []
    assert not any(alive(pid) for pid in pids)
    # The ranks stopped at an iteration boundary with a checkpoint of that iteration.
    done = iterations_done(run)
    assert RunDir(run).checkpoint(done).exists()
    row = status_json(str(run))[0]
    assert row["state"] == "CANCELLED" and not row["active"] and row["iteration"] == done
    du = subprocess.run(["du", "-sb", str(run)], capture_output=True, text=True, check=True)
    assert row["disk_bytes"] == int(du.stdout.split()[0])  # the run's bytes, as du counts them
    again = hpc("cancel", str(run))
    assert again.returncode == 0 and "no process left to stop" in again.stdout


@pytest.mark.training
def test_logs_show_the_failing_rank_first(local_jobs: LocalJobs) -> None:
    """Rank 1 raises at iteration 3, rank 0 then loses its peer: logs names rank 1 and its
    host first, with its traceback; status shows FAILED at 3/50."""
    run = wait_for(lambda: (runs_under(local_jobs.failing) or [None])[0], 60, "failing run")
    row = wait_ended(run)
    assert row["state"] == "FAILED" and row["iteration"] == 3 and row["total"] == 50
    proc = hpc("logs", str(run))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    host = socket.gethostname()
    cause, first = out.splitlines()[:2]
    assert cause == (
        f"cause: rank 1 on {host} failed: RuntimeError: injected fault on rank 1 at iteration 3"
    ), out[:2000]
    assert row["cause"] == cause.removeprefix("cause: ")
    assert first.startswith(f"first traceback: rank 1 on {host} at "), first
    assert "logs/rank1.log" in first
    cause = "RuntimeError: injected fault on rank 1 at iteration 3"
    traceback = out[out.index("Traceback (most recent call last):") :]
    assert cause in traceback  # the traceback itself, not only the cause line above it
    later = [line for line in out.splitlines() if line.startswith("later traceback")]
    # Rank 1's copy in its .err is not a later traceback (rank 0's, which names the lost
    # rank 1, is).
    assert all(not line.startswith("later traceback: rank 1 ") for line in later), later
    assert "── rank 0 ·" in out and "── rank 1 ·" in out
    # By job id, one rank, and its task stderr (where submitit printed the same traceback).
    job = row["job_ids"][-1]
    one_rank = ["--rank", "1", "--stream", "err", "--lines", "0"]
    err = hpc("logs", job, "--log-root", str(local_jobs.failing), *one_rank)
    assert err.returncode == 0 and cause in err.stdout and "_1_log.err" in err.stdout
    missing = hpc("logs", str(run), "--rank", "7")
    assert missing.returncode == 2 and "--rank" in missing.stderr


@pytest.mark.training
def test_sweep_runs_status_and_plot(local_jobs: LocalJobs, tmp_path: Path) -> None:
    """--sweep seed=1,2: two runs named after their seeds, grouped by status; plot overlays
    both runs' reward and env-steps/s."""
    runs = wait_for(lambda: len(r := runs_under(local_jobs.sweep)) == 2 and r, 60, "2 runs")
    # mjlab-submit --sweep --follow waited for both and showed their status.
    assert local_jobs.sweep_follow.wait(timeout=240) == 0, local_jobs.sweep_output.read_text()
    followed = " ".join(local_jobs.sweep_output.read_text().split())
    assert "submitted sweep" in followed and "2 COMPLETED" in followed
    by_seed = {json.loads((r / "run.json").read_text())["spec"]["seed"]: r for r in runs}
    assert sorted(by_seed) == [1, 2]
    assert by_seed[1].name.endswith("_seed=1") and by_seed[2].name.endswith("_seed=2")
    rows = status_json("--log-root", str(local_jobs.sweep))
    assert [r["state"] for r in rows] == ["COMPLETED", "COMPLETED"]
    assert sorted(r["sweep"]["index"] for r in rows) == [0, 1]
    assert all(r["iteration"] == 3 and r["total"] == 3 for r in rows)
    sweep_dir = Path(rows[0]["sweep"]["sweep_dir"])
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert record["axes"] == {"seed": ["1", "2"]} and record["executor"] == "local"
    # The sweep's record directory names all its runs; status groups them under a header.
    assert {r["run_dir"] for r in status_json(str(sweep_dir))} == {str(r) for r in runs}
    table = hpc("status", "--log-root", str(local_jobs.sweep)).stdout
    assert f"sweep {sweep_dir.name}" in table and "2 COMPLETED" in table

    png = tmp_path / "sweep.png"
    proc = hpc("plot", str(by_seed[1]), str(by_seed[2]), "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 700)
        drawn = json.loads(image.text["mjlab-hpc"])
    assert [r["label"] for r in drawn["runs"]] == ["seed=1", "seed=2"]
    for entry in drawn["runs"]:
        for tag in ("Train/mean_reward", "Perf/total_fps"):
            series = entry["series"][tag]
            assert series["points"] == 3 and series["last_iteration"] == 3


@pytest.mark.training
def test_status_watch_redraws_until_interrupted(local_jobs: LocalJobs) -> None:
    """In a terminal (a pseudo-terminal here) `status --watch` draws the table, redraws it
    every --interval-s, and ends with exit 0 at Ctrl-C."""
    import pty
    import select

    leader, follower = pty.openpty()
    watch = [BIN / "mjlab-hpc", "status", "--watch", "--interval-s", "0.3"]
    proc = subprocess.Popen(
        [*watch, "--log-root", str(local_jobs.sweep)],
        env={**cli_env(), "TERM": "xterm", "COLUMNS": "250"},
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 60
    while screen.count(b"run directory") < 3:  # the first frame, then two redraws
        assert time.monotonic() < deadline, screen.decode(errors="replace")[-3000:]
        if select.select([leader], [], [], 1.0)[0]:
            screen += os.read(leader, 65536)
    proc.send_signal(signal.SIGINT)
    with contextlib.suppress(OSError):  # the terminal closes when it exits
        while chunk := os.read(leader, 65536):
            screen += chunk
    os.close(leader)
    text = screen.decode(errors="replace")
    assert proc.wait(timeout=30) == 0, text[-3000:]
    assert "_seed=1" in text and "Traceback" not in text


def test_a_runs_bytes_on_disk_are_dus(tmp_path: Path) -> None:
    """status's bytes of a run are `du -sb`'s: a hard link counted once, a link out of the run
    not followed, empty folders and the links themselves counted."""
    run = tmp_path / "run"
    (run / "rank_states" / "model_2").mkdir(parents=True)
    (run / "empty").mkdir()
    (run / "model_2.pt").write_bytes(b"m" * 5000)
    (run / "rank_states" / "model_2" / "rank0-of-1.pt").write_bytes(b"s" * 70_000)
    os.link(run / "model_2.pt", run / "model_2.link")
    (tmp_path / "outside.bin").write_bytes(b"o" * 1_000_000)
    (run / "out").symlink_to(tmp_path / "outside.bin")
    (run / "up").symlink_to(tmp_path)
    du = subprocess.run(["du", "-sb", str(run)], capture_output=True, text=True, check=True)
    assert disk_bytes(run) == int(du.stdout.split()[0]) < 1_000_000
    assert disk_bytes(tmp_path / "missing") is None


def test_unknown_target_exits_2(tmp_path: Path) -> None:
    for args in (["status", "999999999"], ["logs", "123_4"], ["cancel", "no-such-dir"]):
        proc = hpc(*args, "--log-root", str(tmp_path))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "RUN|JOB" in proc.stderr


# ---------------------------------------------------------------------------- tracebacks


def test_tracebacks_are_split_at_log_records(tmp_path: Path) -> None:
    log = tmp_path / "rank1.log"
    log.write_text(
        "2026-01-02 03:04:05,006 rank1 rank 1/2 (local 1/2, node 0/1) via slurm, master "
        "node1:1 on cpu, host node2, seed 1, 8 envs\n"
        "2026-01-02 03:04:09,500 rank1 rank 1 failed\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 1, in f\n'
        "KeyError: 'x'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 2, in g\n'
        "ValueError: bad\n"
        "  second line of the message\n"
        "2026-01-02 03:04:10,000 rank1 done\n"
        "submitit ERROR (2026-01-02 03:04:11,250) - Submitted job triggered an exception\n"
        "Traceback (most recent call last):\n"
        '  File "b.py", line 3, in h\n'
        "OSError: disk\n"
        "srun: error: node2: task 1: Exited with exit code 1\n"
    )
    found = tracebacks_in(log)
    assert len(found) == 2
    (at1, text1), (at2, text2) = found
    assert at1 is not None and (at1.second, at1.microsecond) == (9, 500_000)
    assert text1.splitlines()[-1] == "  second line of the message"
    assert "During handling" in text1 and "KeyError" in text1
    assert at2 is not None and (at2.second, at2.microsecond) == (11, 250_000)
    assert text2.splitlines()[-1] == "OSError: disk"


def test_first_traceback_is_the_cause_and_names_the_host_of_the_time(tmp_path: Path) -> None:
    """Same millisecond: the rank that lost its peer (its end record says so) comes after the
    peer, whatever its error's words. A requeued rank's traceback names the host it ran on
    then."""
    stamp = "2026-01-02 03:04:09,500"
    rank0 = tmp_path / "rank0.log"
    rank0.write_text(
        f"2026-01-02 03:04:05,000 rank0 rank 0/2 ..., host node1, seed 1\n{stamp} rank0 failed\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711\n"
    )
    rank1 = tmp_path / "rank1.log"
    rank1.write_text(
        "2026-01-02 03:00:00,000 rank1 rank 1/2 ..., host node2, seed 2\n"
        "2026-01-02 03:04:00,000 rank1 rank 1/2 ..., host node7, seed 2\n"
        f"{stamp} rank1 failed\nTraceback (most recent call last):\n"
        '  File "y.py", line 2, in g\nValueError: the cause\n'
    )

    def at(text: str) -> dt.datetime:
        return dt.datetime.fromisoformat(text)

    # Each rank's starts, as its start records say (rank 1 moved to node7 when requeued).
    found = find_tracebacks(
        [
            RankFiles(
                0, rank0, (), (), starts=((at("2026-01-02 03:04:05"), "node1"),), peer_lost=(True,)
            ),
            RankFiles(
                1,
                rank1,
                (),
                (),
                starts=((at("2026-01-02 03:00:00"), "node2"), (at("2026-01-02 03:04:00"), "node7")),
            ),
        ]
    )
    assert [(t.rank, t.host, t.last_line) for t in found] == [
        (1, "node7", "ValueError: the cause"),
        (0, "node1", "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711"),
    ]

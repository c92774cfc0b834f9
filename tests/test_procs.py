"""The process table and the process-group primitives, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import watch
from mjlab_hpc import procs


def test_alive_is_false_for_a_zombie_and_a_gone_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while procs.alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not procs.alive(child.pid)  # exited, not yet reaped: a zombie
    child.wait()
    assert not procs.alive(child.pid)
    assert procs.alive(os.getpid())


def test_processes_match_argv_and_skip_this_process(tmp_path: Path) -> None:
    marker = str(tmp_path / "unique-marker")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        found: list[procs.ProcessEntry] = []
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            found = procs.processes(lambda argv: marker in argv)
            time.sleep(0.02)
        assert [p.pid for p in found] == [child.pid]
        assert found[0].argv[-1] == marker
        assert watch.cpu_seconds(child.pid) is not None
        assert abs((watch.start_time(child.pid) or 0) - time.time()) < 30
    finally:
        child.kill()
        child.wait()
    assert watch.cpu_seconds(child.pid) is None


def test_kill_group_ends_a_job_and_what_it_started() -> None:
    # A shell (the job) that started a grandchild: both are in the job's session.
    job = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    deadline = time.monotonic() + 10
    members: list[int] = []
    while len(members) < 3 and time.monotonic() < deadline:
        members = watch.session_pids(job.pid)
        time.sleep(0.02)
    assert len(members) == 3, members  # bash and its two sleeps
    procs.kill_group(job.pid)
    job.wait(timeout=10)
    assert procs.wait_gone(members, 10) == []
    procs.kill_group(job.pid)  # gone already: nothing happens


def test_run_command_times_out_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "slow"
    script.write_text('#!/bin/bash\nsleep 30 &\necho $! > "$0.child"\nsleep 30\n')
    script.chmod(0o755)
    t0 = time.monotonic()
    assert procs.run_command([str(script)], timeout_s=0.5) is None
    assert time.monotonic() - t0 < 10
    child = int((tmp_path / "slow.child").read_text())
    assert procs.wait_gone([child], 5) == []  # the wrapper's own child was killed too
    assert procs.run_command(["no-such-command-here"], timeout_s=5) is None
    done = procs.run_command(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
    assert done is not None and (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_send_signal_reports_a_gone_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    assert procs.send_signal(child.pid, signal.SIGTERM)
    child.wait()
    assert not procs.send_signal(child.pid, signal.SIGTERM)


def test_machine_busy_grows() -> None:
    before = watch.machine_busy_s()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert watch.machine_busy_s() > before

"""The single-writer lease lock, with real processes (no mocks).

Child processes are forked (multiprocessing "fork" context) so that they start in
milliseconds on a small machine; each child builds its own LeaseLock. A holder "on another
node" says a machine id of its own: nobody here may judge it by its process, only by its
heartbeat seen unchanged for a lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BIN

from mjlab_hpc.rundir import lease as lock_mod
from mjlab_hpc.rundir.lock import (
    LeaseLock,
    LockError,
    LockLost,
    LockTimeout,
    LockUsageError,
    OwnerInfo,
    write_fenced,
)

CTX = mp.get_context("fork")

# Generous slack: the machine has 2 cores and other jobs may load it.
SLACK_S = 5.0
#: The machine id of a holder on another node.
ELSEWHERE = "another node"


def _owner(machine: str = "", rank: int = 0) -> OwnerInfo:
    owner = OwnerInfo.from_env(rank=rank)
    return dataclasses.replace(owner, machine=machine) if machine else owner


# --------------------------------------------------------------------------- helpers


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def _kill(proc: mp.process.BaseProcess) -> None:
    if proc.pid is not None and proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def _wait_stopped(pid: int) -> None:
    """Wait until the kernel reports the process as stopped (kill() is asynchronous)."""

    def stopped() -> bool:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    _wait_for(stopped, 10, f"pid {pid} to stop")


def _parse_record(path: Path) -> list[tuple[int, int, str, list[str]]]:
    rows = []
    for line in path.read_text().splitlines():
        token, pid, what, *extra = line.split()
        rows.append((int(token), int(pid), what, extra))
    return rows


def _assert_exclusive(rows: list[tuple[int, int, str, list[str]]]) -> list[int]:
    """Enter/exit strictly alternate, each pair by one holder; tokens strictly increase."""
    assert len(rows) % 2 == 0, "record ends inside a critical section"
    tokens: list[int] = []
    for i in range(0, len(rows), 2):
        (tok_in, pid_in, what_in, _), (tok_out, pid_out, what_out, _) = rows[i], rows[i + 1]
        assert (what_in, what_out) == ("enter", "exit"), f"overlap at record line {i + 1}"
        assert (tok_in, pid_in) == (tok_out, pid_out), f"two holders at record line {i + 1}"
        tokens.append(tok_in)
    assert all(a < b for a, b in itertools.pairwise(tokens)), f"tokens not increasing: {tokens}"
    return tokens


def _append(fd: int, text: str) -> None:
    # One write() per line on an O_APPEND fd: lines from processes never interleave.
    os.write(fd, text.encode())


# --------------------------------------------------------------------------- child bodies


def _contender(
    lock_path: str, record_path: str, rounds: int, rank: int, lease_s: float, start: object
) -> None:
    lock = LeaseLock(lock_path, owner=OwnerInfo.from_env(rank=rank), lease_s=lease_s)
    fd = os.open(record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start.wait()  # type: ignore[attr-defined]
    for _ in range(rounds):
        token = lock.acquire(timeout_s=120)
        took_over = lock.displaced is not None
        _append(fd, f"{token} {os.getpid()} enter {time.time():.6f} {int(took_over)}\n")
        time.sleep(0.001)
        _append(fd, f"{token} {os.getpid()} exit\n")
        lock.release()
    os.close(fd)


def _holder_forever(lock_path: str, lease_s: float, ready_path: str, machine: str = "") -> None:
    lock = LeaseLock(lock_path, owner=_owner(machine), lease_s=lease_s)
    token = lock.acquire(timeout_s=60)
    Path(ready_path).write_text(str(token))
    while True:
        time.sleep(1)


def _stale_holder(lock_path: str, lease_s: float, workdir: str, machine: str = "") -> None:
    work = Path(workdir)
    lock = LeaseLock(lock_path, owner=_owner(machine), lease_s=lease_s)
    token = lock.acquire(timeout_s=60)
    write_fenced(lock, work / "target", f"A {token}".encode())
    (work / "ready").write_text(str(token))
    while not (work / "go").exists():
        time.sleep(0.01)
    results: dict[str, object] = {}
    for name, action in (
        ("write", lambda: write_fenced(lock, work / "target", b"A stale")),
        ("check", lock.check),
        ("release", lock.release),
    ):
        try:
            action()
            results[name] = "ok"
        except LockLost as exc:
            results[name] = f"LockLost: {exc}"
    results["leftover_tmp"] = sorted(p.name for p in work.glob(".target*"))
    (work / "result.json").write_text(json.dumps(results))


# --------------------------------------------------------------------------- 1. contention


@pytest.mark.slow
def test_many_processes_never_hold_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    n_procs, rounds = 32, 20
    lock_path, record = tmp_path / "writer.lock", tmp_path / "record.log"
    start = CTX.Event()
    procs = [
        CTX.Process(target=_contender, args=(str(lock_path), str(record), rounds, i, 30.0, start))
        for i in range(n_procs)
    ]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    start.set()
    try:
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0] * n_procs
    finally:
        for p in procs:
            _kill(p)
    elapsed = time.monotonic() - t0

    rows = _parse_record(record)
    tokens = _assert_exclusive(rows)
    assert len(tokens) == n_procs * rounds
    per_pid: dict[int, int] = {}
    for _, pid, what, _ in rows:
        if what == "enter":
            per_pid[pid] = per_pid.get(pid, 0) + 1
    assert sorted(per_pid.values()) == [rounds] * n_procs
    assert not any(int(extra[1]) for _, _, what, extra in rows if what == "enter")
    assert not lock_path.exists(), "lock file left behind after the last release"
    with capsys.disabled():
        print(
            f"\n[lock stress] {len(tokens)} acquisitions by {n_procs} processes in "
            f"{elapsed:.1f} s, tokens {tokens[0]}..{tokens[-1]}, never two holders"
        )


# --------------------------------------------------------------------------- 2. kill -9


@pytest.mark.slow
def test_kill9_holder_is_taken_over_after_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A holder on another node killed by SIGKILL: taken over once the waiters have seen its
    heartbeat unchanged for its lease, not before (their own clocks only); one on this
    machine: at once, its process being gone."""
    lease = 1.5
    lock_path, record = tmp_path / "writer.lock", tmp_path / "record.log"
    takeovers, last_token = 0, 0
    delays: list[float] = []
    for cycle, machine in enumerate((ELSEWHERE, ELSEWHERE, "")):
        ready = tmp_path / f"ready{cycle}"
        holder = CTX.Process(
            target=_holder_forever, args=(str(lock_path), lease, str(ready), machine)
        )
        holder.start()
        contenders: list[mp.process.BaseProcess] = []
        try:
            _wait_for(ready.exists, 30, "the holder to acquire")
            held_token = int(ready.read_text())
            assert held_token > last_token
            if cycle == 0:
                # A live holder keeps its lock well past one lease thanks to heartbeats.
                probe = LeaseLock(lock_path, lease_s=lease)
                with pytest.raises(LockTimeout, match=f"pid={holder.pid}"):
                    probe.acquire(timeout_s=2 * lease)
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(10)
            dead = LeaseLock(lock_path, lease_s=lease).holder()
            assert dead is not None and dead.token == held_token
            if machine:
                # Right after the kill nobody has watched it for a lease: no takeover yet.
                with pytest.raises(LockTimeout):
                    LeaseLock(lock_path, lease_s=lease).acquire(timeout_s=0)

            # Several launches race to take over the stale lock.
            record.unlink(missing_ok=True)
            start = CTX.Event()
            contenders = [
                CTX.Process(
                    target=_contender, args=(str(lock_path), str(record), 1, i, 10.0, start)
                )
                for i in range(4)
            ]
            for p in contenders:
                p.start()
            started = time.time()
            start.set()
            for p in contenders:
                p.join(60)
            assert [p.exitcode for p in contenders] == [0] * 4
        finally:
            _kill(holder)
            for p in contenders:
                _kill(p)

        rows = _parse_record(record)
        tokens = _assert_exclusive(rows)
        assert tokens[0] > held_token
        enters = [extra for _, _, what, extra in rows if what == "enter"]
        waited = float(enters[0][0]) - started
        if machine:  # watched unchanged for the lease first, then taken over soon after
            assert lease <= waited <= lease + SLACK_S, waited
            delays.append(waited)
        else:
            assert waited < lease, waited
        # Normally the first acquirer reports the displaced record. Rarely another
        # racer slips into the vacant name between the winner's rename and link;
        # then nobody reports it, but there is never more than one takeover.
        assert sum(int(extra[1]) for extra in enters) <= 1
        takeovers += 1
        last_token = tokens[-1]
    with capsys.disabled():
        print(
            f"\n[lock kill -9] {takeovers} takeovers, lease {lease} s, of a holder on another "
            f"node after {', '.join(f'{d:.2f}' for d in delays)} s of waiting"
        )


def _write_stale_record(path: Path, token: int, valid: bool) -> None:
    """Leave behind what a crashed holder leaves: a stale record or a half-written file."""
    if valid:
        doc = {
            "format": "mjlab_hpc.lease_lock/1",
            "token": token or None,  # None: crashed before recording its token
            "nonce": f"dead{token}",
            "host": "dead-node",
            "pid": 1,
            "job_id": "999",
            "restart_count": 0,
            "rank": 0,
            "acquired_at": time.time() - 100,
            "heartbeat_at": time.time() - 100,
            "lease_s": 0.3,
        }
        path.write_text(json.dumps(doc))
    else:
        path.write_bytes(b'{"format": "mjlab_')
        old = time.time() - 100
        os.utime(path, (old, old))


@pytest.mark.slow
def test_racing_takeovers_of_a_stale_lock(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Many launches find the same stale lock at once: one takes over, the rest queue."""
    n_procs, n_rounds = 16, 8
    lock_path = tmp_path / "writer.lock"
    last_token, reported = 0, 0
    for round_ in range(n_rounds):
        _write_stale_record(lock_path, last_token, valid=round_ % 2 == 0)
        record = tmp_path / f"record{round_}.log"
        start = CTX.Event()
        procs = [
            CTX.Process(target=_contender, args=(str(lock_path), str(record), 1, i, 0.3, start))
            for i in range(n_procs)
        ]
        for p in procs:
            p.start()
        start.set()
        try:
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [0] * n_procs
        finally:
            for p in procs:
                _kill(p)
        rows = _parse_record(record)
        tokens = _assert_exclusive(rows)
        assert len(tokens) == n_procs and tokens[0] > last_token
        displaced = sum(int(extra[1]) for _, _, what, extra in rows if what == "enter")
        assert displaced <= 1
        reported += displaced
        last_token = tokens[-1]
        assert not lock_path.exists()
    with capsys.disabled():
        print(
            f"\n[lock racing takeovers] {n_rounds} stale locks, {n_procs} racers each: "
            f"one holder at a time, {reported} takeovers reported by the winner"
        )


# --------------------------------------------------------------------------- 3. SIGSTOP


@pytest.mark.slow
def test_stopped_owner_resuming_after_takeover_is_fenced(tmp_path: Path) -> None:
    """A holder on another node frozen (SIGSTOP) past its lease is taken over; when it wakes,
    its write, check and release are refused and the new holder's lock is left intact."""
    lease = 1.5
    lock_path = tmp_path / "writer.lock"
    holder = CTX.Process(
        target=_stale_holder, args=(str(lock_path), lease, str(tmp_path), ELSEWHERE)
    )
    holder.start()
    try:
        _wait_for((tmp_path / "ready").exists, 30, "holder A to acquire")
        token_a = int((tmp_path / "ready").read_text())
        os.kill(holder.pid, signal.SIGSTOP)
        _wait_stopped(holder.pid)
        frozen = LeaseLock(lock_path, lease_s=lease).holder()
        assert frozen is not None and frozen.token == token_a

        b = LeaseLock(lock_path, lease_s=lease)
        t0 = time.monotonic()
        token_b = b.acquire(timeout_s=lease + SLACK_S)
        assert time.monotonic() - t0 >= lease, "taken over before a lease of watching"
        assert b.displaced is not None and b.displaced.token == token_a
        assert b.displaced.owner is not None and b.displaced.owner.pid == holder.pid
        assert token_b > token_a
        write_fenced(b, tmp_path / "target", f"B {token_b}".encode())

        os.kill(holder.pid, signal.SIGCONT)
        time.sleep(lease / 2)  # let A's heartbeat thread run (it must not clobber B)
        (tmp_path / "go").touch()
        _wait_for((tmp_path / "result.json").exists, 30, "A's result")
        holder.join(10)
        assert holder.exitcode == 0
        results = json.loads((tmp_path / "result.json").read_text())
        assert str(results["write"]).startswith("LockLost"), results
        assert str(results["check"]).startswith("LockLost"), results
        assert str(results["release"]).startswith("LockLost"), results
        assert results["leftover_tmp"] == []
        assert (tmp_path / "target").read_bytes() == f"B {token_b}".encode()
        current = b.holder()
        assert current is not None and current.token == token_b
        assert current.owner is not None and current.owner.pid == os.getpid()
        b.check()  # A's resume, heartbeat and release left B's lock intact
        b.release()
    finally:
        _kill(holder)


def test_check_and_write_refused_after_foreign_takeover(tmp_path: Path) -> None:
    """The fencing check itself (not only the own-lease clock) rejects a stale owner."""
    lock_path = tmp_path / "writer.lock"
    a = LeaseLock(lock_path, lease_s=30)
    a.acquire(timeout_s=5)
    write_fenced(a, tmp_path / "target", b"A")
    # Simulate a takeover that a skewed clock allowed: replace the file under A.
    os.rename(lock_path, tmp_path / "gone")
    b = LeaseLock(lock_path, lease_s=30)
    b.acquire(timeout_s=5)
    assert b.token > a.token
    with pytest.raises(LockLost, match="taken over by"):
        a.check()
    assert not a.is_held()
    with pytest.raises(LockLost):
        write_fenced(a, tmp_path / "target", b"A again")
    assert (tmp_path / "target").read_bytes() == b"A"
    with pytest.raises(LockLost):
        a.release()
    b.check()
    b.release()


def test_late_racer_does_not_steal_a_fresh_lock(tmp_path: Path) -> None:
    """A racer that judged a lock stale, but acts after another racer replaced it, backs off.

    Two processes judge the same record stale; one takes over first. The late
    one must leave the fresh lock alone (same inode, no tombstones left).
    Driven through the internal takeover step, on real files.
    """
    path = tmp_path / "writer.lock"
    _write_stale_record(path, 0, valid=True)
    stale = lock_mod.read_lock(path)
    assert stale is not None
    with LeaseLock(path, lease_s=30) as fresh:  # the first racer's takeover
        inode = path.stat().st_ino
        late = LeaseLock(path, lease_s=30)
        temp = tmp_path / "late.tmp"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            observer = lock_mod.Observer()
            assert not lock_mod.take_over(late.path, stale, temp, fd, late.lease_s, observer)
        finally:
            os.close(fd)
        assert path.stat().st_ino == inode  # same inode back under the lock name
        assert not list(tmp_path.glob("writer.lock.tomb.*"))
        assert not list(tmp_path.glob("writer.lock.break.*"))
        fresh.check()


# --------------------------------------------------------------------------- 4. filesystems
# (`mount_tmpfs`: tests/conftest.py)


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_read_only_directory_gives_lock_error(mount_tmpfs: Callable[[str, str], Path]) -> None:
    ro = mount_tmpfs("ro", "ro,size=64k")
    lock = LeaseLock(ro / "writer.lock", lease_s=5)
    with pytest.raises(LockError) as info:
        lock.acquire(timeout_s=1)
    assert not isinstance(info.value, LockTimeout)
    message = str(info.value)
    assert str(ro) in message and "read-only" in message and "What to do" in message
    assert info.value.errno == errno.EROFS
    assert not lock.is_held()


def test_full_filesystem_gives_lock_error(
    mount_tmpfs: Callable[[str, str], Path], tmp_path: Path
) -> None:
    full = mount_tmpfs("full", "size=16k")
    _fill(full)
    lock = LeaseLock(full / "writer.lock", lease_s=5)
    with pytest.raises(LockError) as info:
        lock.acquire(timeout_s=1)
    assert "no space" in str(info.value).lower() and str(full) in str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert not (full / "writer.lock").exists()
    assert not list(full.glob("writer.lock.new.*")), "temp file left behind"


def test_fenced_write_on_full_filesystem_keeps_lock(
    mount_tmpfs: Callable[[str, str], Path],
) -> None:
    fs = mount_tmpfs("fs", "size=64k")
    with LeaseLock(fs / "writer.lock", lease_s=5) as lock:
        _fill(fs)
        with pytest.raises(OSError) as info:
            write_fenced(lock, fs / "state.bin", b"x" * 65536)
        assert info.value.errno == errno.ENOSPC
        assert not (fs / "state.bin").exists()
        assert not list(fs.glob(".state.bin*")), "temp file left behind"
        lock.check()
    assert not (fs / "writer.lock").exists()


def test_missing_directory_gives_lock_error(tmp_path: Path) -> None:
    lock = LeaseLock(tmp_path / "nope" / "writer.lock", lease_s=5)
    with pytest.raises(LockError, match="does not exist") as info:
        lock.acquire(timeout_s=1)
    assert str(tmp_path / "nope") in str(info.value)


# --------------------------------------------------------------------------- 5. latency


def test_uncontended_acquire_latency(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lock = LeaseLock(tmp_path / "writer.lock", lease_s=30)
    acquire_s, cycle_s, tokens = [], [], []
    for _ in range(200):
        t0 = time.perf_counter()
        tokens.append(lock.acquire(timeout_s=10))
        t1 = time.perf_counter()
        lock.release()
        acquire_s.append(t1 - t0)
        cycle_s.append(time.perf_counter() - t0)
    assert tokens == list(range(1, 201))
    q = statistics.quantiles(acquire_s, n=10)
    with capsys.disabled():
        print(
            f"\n[lock latency] uncontended acquire: median {statistics.median(acquire_s) * 1e3:.2f}"
            f" ms, p90 {q[-1] * 1e3:.2f} ms; acquire+release median "
            f"{statistics.median(cycle_s) * 1e3:.2f} ms over 200 cycles ({tmp_path})"
        )


# --------------------------------------------------------------------------- 6. misuse, API


def test_misuse_raises_clear_errors(tmp_path: Path) -> None:
    lock = LeaseLock(tmp_path / "writer.lock", lease_s=5)
    with pytest.raises(LockUsageError, match="does not hold"):
        lock.release()
    with pytest.raises(LockUsageError):
        lock.check()
    with pytest.raises(LockUsageError):
        _ = lock.token
    assert not lock.is_held()
    lock.acquire(timeout_s=5)
    with pytest.raises(LockUsageError, match="not re-entrant"):
        lock.acquire(timeout_s=5)
    with pytest.raises(LockUsageError), lock:
        pass
    assert lock.is_held()  # the failed re-entry did not drop the lock
    lock.release()
    with pytest.raises(LockUsageError, match="does not hold"):
        lock.release()


def test_timeout_names_the_holder(tmp_path: Path) -> None:
    owner = OwnerInfo(host="node-17", pid=os.getpid(), job_id="4242", restart_count=2, rank=3)
    with LeaseLock(tmp_path / "writer.lock", owner=owner, lease_s=30):
        other = LeaseLock(tmp_path / "writer.lock", lease_s=30)
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            other.acquire(timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.3
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, LockError)
        message = str(info.value)
        for part in ("node-17", f"pid={os.getpid()}", "job_id=4242", "rank=3", "heartbeat"):
            assert part in message, message


def test_tokens_increase_across_release_and_objects(tmp_path: Path) -> None:
    path = tmp_path / "writer.lock"
    seen = []
    for _ in range(3):
        with LeaseLock(path, lease_s=5) as lock:
            seen.append(lock.token)
            assert lock.displaced is None
            assert json.loads(path.read_text())["token"] == lock.token
    assert seen == [1, 2, 3]


def test_context_manager_releases_on_exception(tmp_path: Path) -> None:
    path = tmp_path / "writer.lock"
    lock = LeaseLock(path, lease_s=5)
    with pytest.raises(ValueError, match="boom"), lock:
        raise ValueError("boom")
    assert not path.exists()
    assert not lock.is_held()


def test_unparsable_lock_file_is_an_unknown_holder(tmp_path: Path) -> None:
    """A half-written lock file (a crash between create and write) is an unknown holder,
    taken over once seen unchanged for our lease, whatever its mtime says (an hour ahead or
    behind: another machine's clock)."""
    path = tmp_path / "writer.lock"
    for shift in (3600, -3600):
        path.write_bytes(b'{"format": "mjlab_hpc.lease')
        os.utime(path, (time.time() + shift, time.time() + shift))
        with pytest.raises(LockTimeout, match="unknown holder"):
            LeaseLock(path, lease_s=1).acquire(timeout_s=0.2)
        t0 = time.monotonic()
        with LeaseLock(path, lease_s=1) as lock:
            assert time.monotonic() - t0 >= 1.0
            assert lock.displaced is not None and lock.displaced.owner is None


def test_a_stopped_holder_keeps_its_lease(tmp_path: Path) -> None:
    """A holder stopped (SIGSTOP: a suspended job) for three leases, with nobody taking over,
    writes on when it wakes: the time it was stopped does not count against it; a waiter on
    its machine never takes over a live holder, however old its heartbeat."""
    lease = 1.0
    lock_path = tmp_path / "writer.lock"
    holder = CTX.Process(target=_stale_holder, args=(str(lock_path), lease, str(tmp_path)))
    holder.start()
    try:
        _wait_for((tmp_path / "ready").exists, 30, "the holder to acquire")
        os.kill(holder.pid, signal.SIGSTOP)
        _wait_stopped(holder.pid)
        with pytest.raises(LockTimeout, match=f"pid={holder.pid}"):
            LeaseLock(lock_path, lease_s=lease).acquire(timeout_s=3 * lease)
        os.kill(holder.pid, signal.SIGCONT)
        (tmp_path / "go").touch()
        _wait_for((tmp_path / "result.json").exists, 30, "the holder's result")
        holder.join(10)
        results = json.loads((tmp_path / "result.json").read_text())
        assert results == {"write": "ok", "check": "ok", "release": "ok", "leftover_tmp": []}
        assert (tmp_path / "target").read_bytes() == b"A stale"
        assert not lock_path.exists()
    finally:
        _kill(holder)


def test_a_waiter_an_hour_ahead_never_takes_a_live_lock(tmp_path: Path) -> None:
    """A second process whose clock is an hour ahead (faketime) waits for a live holder on
    another node and gives up with LockTimeout: the heartbeat it sees change, not its age by
    its own clock, says the holder lives."""
    if shutil.which("faketime") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("faketime is not installed (make install installs it as root)")
        pytest.skip("faketime is not installed (apt-get install faketime)")
    lease = 1.0
    lock_path = tmp_path / "writer.lock"
    ready = tmp_path / "ready"
    holder = CTX.Process(
        target=_holder_forever, args=(str(lock_path), lease, str(ready), ELSEWHERE)
    )
    holder.start()
    try:
        _wait_for(ready.exists, 30, "the holder to acquire")
        code = (
            "import sys; from mjlab_hpc.rundir.lock import LeaseLock, LockTimeout\n"
            "try:\n"
            f"    LeaseLock(sys.argv[1], lease_s={lease}).acquire(timeout_s={3 * lease})\n"
            "except LockTimeout as exc:\n"
            "    print('timeout', exc); sys.exit(0)\n"
            "sys.exit('took the lock of a live holder')\n"
        )
        proc = subprocess.run(
            ["faketime", "-f", "+1h", str(BIN / "python"), "-c", code, str(lock_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"pid={holder.pid}" in proc.stdout
        assert holder.is_alive() and int(ready.read_text()) == LeaseLock(lock_path).holder().token
    finally:
        _kill(holder)


def test_owner_info_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    info = OwnerInfo.from_env()
    assert (info.pid, info.job_id, info.restart_count, info.rank) == (os.getpid(), None, 0, 0)
    assert info.host
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "local-7")
    assert OwnerInfo.from_env(rank=2).job_id == "local-7"
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "4")
    info = OwnerInfo.from_env(rank=5)
    assert (info.job_id, info.restart_count, info.rank) == ("123", 4, 5)
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]


def test_a_lease_must_be_a_positive_number(tmp_path: Path) -> None:
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lease_s"):
            LeaseLock(tmp_path / "writer.lock", lease_s=bad)


# --------------------------------------------------------------------------- 128 contenders


@pytest.mark.slow
def test_128_contenders_and_a_killed_holder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """128 processes wait (default polling) for a lock whose holder is then killed by SIGKILL:
    the first takes over after the lease and not before, then each of the others holds it
    once, never two at a time, with strictly increasing tokens; nothing is left behind.
    The measured figures are `make bench`'s (benchmarks.lock.lock_contention)."""
    from benchmarks.lock import lock_contention, lock_summary

    lease = 1.0
    raw = lock_contention(tmp_path, contenders=128, lease_s=lease, hold_s=0.001)
    assert raw["exit_codes"] == [0] * 128
    rows = raw["rows"]  # (token, pid, got, left, displaced) by the time the lock was got
    assert len(rows) == 128 and len({r[1] for r in rows}) == 128
    for before, after in itertools.pairwise(rows):
        assert after[2] >= before[3], f"{after[1]} got the lock while {before[1]} held it"
        assert after[0] > before[0], "tokens must increase with every acquisition"
    assert rows[0][0] > raw["dead_token"]
    # Taken over after the dead holder's lease, within the lease plus the polling period.
    since_heartbeat = rows[0][2] - raw["dead_heartbeat_at"]
    assert lease <= since_heartbeat <= lease + SLACK_S, since_heartbeat
    assert sum(r[4] for r in rows) <= 1, "at most one takeover of the dead holder"
    assert not raw["lock_left"], "lock file left behind after the last release"
    summary = lock_summary(raw)
    with capsys.disabled():
        print(f"\n[lock 128] {summary}")


def test_a_copy_of_a_held_lock_has_no_holder(tmp_path: Path) -> None:
    """`cp -r` of a live run copies its lock file: the copy is not the original's to hold."""
    (tmp_path / "run").mkdir()
    with LeaseLock(tmp_path / "run" / "writer.lock", lease_s=30):
        shutil.copytree(tmp_path / "run", tmp_path / "copy")
        assert LeaseLock(tmp_path / "run" / "writer.lock").live_holder() is not None
        copied = LeaseLock(tmp_path / "copy" / "writer.lock", lease_s=30)
        assert copied.live_holder() is None
        t0 = time.monotonic()
        copied.acquire(timeout_s=0)  # at once: no lease to wait out
        assert time.monotonic() - t0 < 2
        copied.release()

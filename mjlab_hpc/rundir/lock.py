"""A single-writer lease lock for run directories on shared filesystems (NFS, Lustre, GPFS).

flock and fcntl locks are not coherent between nodes there, so the lock is built only from
operations atomic on the server: exclusive creation of the lock name (`os.link` of a fully
written file), `rename` within one directory, and `O_EXCL` ticket files whose numbers are
fencing tokens, never reused.

The owner refreshes a heartbeat inside the lock file's content. A lease is judged by what the
judging process sees with its own clock: a holder whose heartbeat it has seen unchanged for a
lease (or, on the same machine, whose process is gone) may be taken over, with a larger token.
No clocks of two processes are compared, and a live holder on the same machine is never taken
over. `write_fenced` refuses to publish once the token is not current (`LockLost`). A holder
that was stopped longer than its lease renews it if nobody took over meanwhile. The design and
the failures it covers: docs/single-writer.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from mjlab_hpc.rundir.durable import publish, temp_path, write_new
from mjlab_hpc.rundir.lease import (
    MAX_IMMEDIATE_RETRIES,
    TICKETS_SUFFIX,
    Held,
    LockError,
    LockLost,
    LockRead,
    LockRecord,
    LockTimeout,
    LockUsageError,
    Observer,
    OwnerInfo,
    claim_ticket,
    encode_record,
    env_error,
    folder_id,
    holder_gone,
    link_exclusive,
    pwrite_all,
    read_lock,
    remove_if_ours,
    take_over,
    unlink_quietly,
    write_all,
)

__all__ = [
    "LeaseLock",
    "LockError",
    "LockLost",
    "LockRecord",
    "LockTimeout",
    "LockUsageError",
    "OwnerInfo",
    "write_fenced",
]

# Waiting for a held lock: exponential, jittered backoff between these (seconds).
_POLL_S = 0.01
_POLL_MAX_S = 0.5


class LeaseLock:
    """A single-writer lease lock between hosts, backed by one file on a shared filesystem.

    Usage:

        lock = LeaseLock(run_dir / "writer.lock", owner=OwnerInfo.from_env(rank), lease_s=60)
        with lock:
            write_fenced(lock, run_dir / "state.json", data)  # raises LockLost if stale

    Next to the lock file, a directory `<name>.tokens` holds one empty ticket file per
    acquisition (the fencing-token counter); do not delete it while the run directory is in
    use. The lock is not re-entrant: one object holds at most one acquisition. Methods are
    thread-safe; the object must not be used in a forked child.
    """

    def __init__(
        self, path: str | os.PathLike[str], owner: OwnerInfo | None = None, *, lease_s: float = 60.0
    ) -> None:
        """Create a lock that is not acquired yet.

        Another process may take over once it has seen the holder's heartbeat unchanged for
        `lease_s` by its own clock (on the same machine: once the holder's process is gone).
        The holder writes its heartbeat every `lease_s / 4`. It treats its own lease as
        expired `lease_s / 5` early (the check-then-rename window of `write_fenced`), and
        then renews it if the lock is still its own.
        """
        if not (math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"lease_s must be a positive number, got {lease_s}")
        self.path = Path(path).absolute()
        self.owner = owner if owner is not None else OwnerInfo.from_env()
        self.lease_s = lease_s
        self.heartbeat_s = lease_s / 4
        self.guard_s = lease_s / 5
        self._tickets = self.path.with_name(self.path.name + TICKETS_SUFFIX)
        self._mutex = threading.RLock()
        self._held: Held | None = None
        self._displaced: LockRecord | None = None
        self._rng = random.Random()  # per-object RNG: no shared global state

    def __repr__(self) -> str:
        held = self._held
        state = f"held token={held.token}" if held else "not held"
        return f"LeaseLock({str(self.path)!r}, {state})"

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held is None:
            return  # released explicitly inside the block
        if exc_type is None:
            self.release()  # reports LockLost if the block ran without the lock
            return
        # Do not mask the exception that is already propagating.
        with contextlib.suppress(LockError):
            self.release()

    @property
    def token(self) -> int:
        """Fencing token of the current acquisition (raises LockUsageError if not held)."""
        return self._require_held("read the token of").token

    @property
    def displaced(self) -> LockRecord | None:
        """The stale holder removed by the last acquisition (a takeover), else None."""
        return self._displaced

    def holder(self) -> LockRecord | None:
        """Read who holds the lock now (None: nobody)."""
        try:
            snap = read_lock(self.path)
        except OSError as exc:
            raise env_error("read the lock file", self.path, exc) from exc
        return None if snap is None else snap.record

    def live_holder(self) -> LockRecord | None:
        """Return the holder when it is alive (None: no holder, or one that is gone or may be).

        On its own machine its process tells. Elsewhere its heartbeat must be seen to change
        within one heartbeat interval; a holder stopped meanwhile reads as not alive (only a
        lease of waiting may replace it).
        """
        try:
            first = read_lock(self.path)
        except OSError as exc:
            raise env_error("read the lock file", self.path, exc) from exc
        if first is None or first.record.owner is None or first.record.lease_s is None:
            return None
        gone = holder_gone(first.record, self.path)
        if gone is not None:
            return None if gone else first.record
        observer = Observer()
        observer.unchanged_for("lock", first.raw)
        while observer.clock() < first.record.lease_s / 4 + 1.0:
            time.sleep(0.5)
            with contextlib.suppress(OSError):
                now = read_lock(self.path)
                if now is None or now.record.nonce != first.record.nonce:
                    return None
                if observer.unchanged_for("lock", now.raw) == 0.0:
                    return now.record
        return None

    def acquire(self, timeout_s: float | None = None) -> int:
        """Acquire the lock and start the heartbeat; return the new fencing token.

        Waits with jittered exponential backoff while another process holds a fresh lease,
        and takes over a holder whose heartbeat was seen unchanged for its lease.
        `timeout_s`: None waits forever, 0 tries once.

        Raises:
            LockTimeout: not acquired in time; the message names the holder.
            LockError: the lock directory is missing, read-only, full, ...
            LockUsageError: this object already holds the lock.
        """
        with self._mutex:
            if self._held is not None:
                raise LockUsageError(
                    f"LeaseLock({self.path}) is already held by this object "
                    f"(token {self._held.token}); it is not re-entrant"
                )
            self._prepare_dir()
            # Waiting and judging the holder on this process's running time: time it was
            # stopped counts neither against the holder nor toward the timeout.
            observer = Observer()
            deadline = None if timeout_s is None else timeout_s
            attempt = 0
            quick_retries = 0
            while True:
                held, seen, contended = self._try_once(observer)
                if held is not None:
                    self._start_heartbeat(held)
                    self._held = held
                    return held.token
                now = observer.clock()
                if deadline is not None and now >= deadline:
                    raise self._timeout_error(seen, now)
                if not contended and quick_retries < MAX_IMMEDIATE_RETRIES:
                    # Lost a race on a vacant/stale lock: retry at once, a bit.
                    quick_retries += 1
                    continue
                quick_retries = 0
                pause = min(_POLL_MAX_S, _POLL_S * 1.5**attempt)
                pause *= self._rng.uniform(0.5, 1.0)
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline - now))
                attempt = min(attempt + 1, 64)  # 1.5**attempt must not overflow
                time.sleep(pause)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours.

        Raises:
            LockUsageError: this object does not hold the lock.
            LockLost: the lock had already been lost (taken over, or the lease expired)
                before release; nothing of the new holder is touched.
        """
        with self._mutex:
            held = self._require_held("release")
            self._held = None
            held.stop.set()
            if held.thread is not None:
                held.thread.join()
            try:
                # Remove the file even if our own lease expired: if nobody took over yet,
                # this frees the lock now instead of after a lease.
                removal = remove_if_ours(self.path, held.nonce)
            finally:
                os.close(held.fd)
            lost = held.lost or removal
            if lost is not None:
                raise LockLost(f"lock {self.path} (token {held.token}) was lost: {lost}")

    def check(self) -> None:
        """Verify that the lock is still ours; raise LockLost otherwise.

        Checks, in order: the heartbeat thread has not seen a takeover; our own lease
        (measured on our monotonic clock since the last heartbeat, minus `guard_s`) has not
        expired, or else (this process was stopped or starved) a heartbeat written now
        renews it; the lock file still carries our nonce and token.
        """
        with self._mutex:
            held = self._require_held("check")
            reason = held.lost or self._own_lease_problem(held) or self._file_problem(held)
            if reason is not None:
                held.lost = reason
                raise LockLost(f"lock {self.path} (token {held.token}) was lost: {reason}")

    def is_held(self) -> bool:
        """Whether this object holds the lock and `check` passes."""
        with self._mutex:
            if self._held is None or self._held.pid != os.getpid():
                return False
            try:
                self.check()
            except LockLost:
                return False
            return True

    def _require_held(self, action: str) -> Held:
        held = self._held
        if held is None:
            raise LockUsageError(
                f"cannot {action} LeaseLock({self.path}): this object does not hold the lock"
            )
        if held.pid != os.getpid():
            raise LockUsageError(
                f"cannot {action} LeaseLock({self.path}) in a forked child (pid {os.getpid()}); "
                f"it was acquired by pid {held.pid}"
            )
        return held

    def _prepare_dir(self) -> None:
        parent = self.path.parent
        if not parent.is_dir():
            raise env_error(
                f"use the lock directory {parent}",
                self.path,
                FileNotFoundError(errno.ENOENT, "missing"),
            )
        try:
            self._tickets.mkdir(exist_ok=True)
        except OSError as exc:
            raise env_error(f"create the token directory {self._tickets}", self.path, exc) from exc

    def _try_once(self, observer: Observer) -> tuple[Held | None, LockRecord | None, bool]:
        """Try once to acquire the lock.

        Returns (held or None, the last holder record seen, whether a live holder was seen).
        """
        # Look first: waiting on a live holder then costs one read per poll, not a temp file,
        # fsync and link.
        try:
            snap = read_lock(self.path)
        except OSError as exc:
            raise env_error("read the lock file", self.path, exc) from exc
        if snap is not None and not self._is_stale(snap, observer):
            return None, snap.record, True
        nonce = uuid.uuid4().hex
        temp = self.path.with_name(f"{self.path.name}.new.{nonce}")
        self.owner = dataclasses.replace(self.owner, folder=folder_id(self.path))
        now = time.time()
        raw = encode_record(
            self.owner,
            token=None,
            nonce=nonce,
            acquired_at=now,
            heartbeat_at=now,
            lease_s=self.lease_s,
        )
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise env_error(
                f"create a file in the lock directory {self.path.parent}", self.path, exc
            ) from exc
        held: Held | None = None
        try:
            try:
                write_all(fd, raw)
                os.fsync(fd)
                if snap is None:
                    if link_exclusive(temp, self.path, fd):
                        snap = None  # won an empty name: nobody displaced
                    else:
                        snap = read_lock(self.path)
                        if snap is None:
                            return None, None, False  # vacant again: released just now
                        if not self._is_stale(snap, observer):
                            return None, snap.record, True
                        if not take_over(self.path, snap, temp, fd, self.lease_s, observer):
                            return None, snap.record, False
                elif not take_over(self.path, snap, temp, fd, self.lease_s, observer):
                    return None, snap.record, False
            except OSError as exc:
                raise env_error("create the lock file", self.path, exc) from exc
            finally:
                unlink_quietly(temp)  # if we won, the inode lives on as the lock file
            displaced = None if snap is None else snap.record
            held = self._finish_acquire(fd, nonce, now, displaced)
            if held is not None:
                self._displaced = displaced
            return held, displaced, False
        finally:
            if held is None:
                os.close(fd)

    def _finish_acquire(
        self, fd: int, nonce: str, acquired_at: float, displaced: LockRecord | None
    ) -> Held | None:
        """Claim a token for the lock name we own, record it, and verify we still own it."""
        try:
            hint = displaced.token if displaced is not None and displaced.token else 0
            token = claim_ticket(self._tickets, hint)
            heartbeat_mono = time.monotonic()
            now = time.time()
            raw = encode_record(
                self.owner,
                token=token,
                nonce=nonce,
                acquired_at=acquired_at,
                heartbeat_at=now,
                lease_s=self.lease_s,
            )
            pwrite_all(fd, raw)
            os.fsync(fd)
            snap = read_lock(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                remove_if_ours(self.path, nonce)
            raise env_error("record the fencing token", self.path, exc) from exc
        if snap is None or snap.record.nonce != nonce:
            # Paused for longer than a lease since winning: someone took over. Our ticket is
            # simply never used.
            return None
        return Held(
            fd=fd,
            nonce=nonce,
            token=token,
            acquired_at=acquired_at,
            pid=os.getpid(),
            hb_mono=heartbeat_mono,
        )

    def _is_stale(self, snap: LockRead, observer: Observer) -> bool:
        """Whether the holder may be replaced.

        It may when its process is gone (on this machine), or when we have seen its lock file
        unchanged for its lease (for an unknown holder: for ours).
        """
        gone = holder_gone(snap.record, self.path)
        if gone is not None:
            return gone
        record = snap.record
        lease = record.lease_s if record.lease_s is not None else self.lease_s
        return observer.unchanged_for("lock", snap.raw) > lease

    def _own_lease_problem(self, held: Held) -> str | None:
        """Return why our lease is gone (None: it holds).

        Past its end on our own clock (we were stopped or starved) it is renewed when the lock
        file is still ours: the time a process was stopped never counts against it.
        """
        own_age = time.monotonic() - held.hb_mono
        if own_age <= self.lease_s - self.guard_s:
            return None
        written, problem = self._beat(held)
        if problem is None:
            return None
        if not written:
            problem = f"own lease expired ({own_age:.1f} s since the last heartbeat), {problem}"
        return problem

    def _beat(self, held: Held) -> tuple[bool, str | None]:
        """Write a heartbeat, then read the lock file back.

        Returns whether it was written, and why the lock is not ours (None: it is). Writes go
        to our own inode through the fd we created: a heartbeat after a takeover lands in the
        tombstone, never in the new holder's file; one in the middle of a takeover makes it
        give the file back.
        """
        mono = time.monotonic()
        raw = encode_record(
            self.owner,
            token=held.token,
            nonce=held.nonce,
            acquired_at=held.acquired_at,
            heartbeat_at=time.time(),
            lease_s=self.lease_s,
        )
        try:
            with held.io_lock:
                pwrite_all(held.fd, raw)
                os.fsync(held.fd)
        except OSError as exc:
            return False, f"a heartbeat cannot be written: {exc}"
        problem = self._file_problem(held)
        if problem is None:
            held.hb_mono = mono
        return True, problem

    def _file_problem(self, held: Held) -> str | None:
        """Return why the lock file is not ours (None: it carries our nonce and token)."""
        try:
            with held.io_lock:  # no torn read of our own concurrent heartbeat
                snap = read_lock(self.path)
        except OSError as exc:
            return f"cannot read the lock file to verify ownership: {exc}"
        if snap is None:
            return "the lock file was removed (taken over or deleted)"
        record = snap.record
        if record.nonce != held.nonce or record.token != held.token:
            return f"taken over by {record.describe()}"
        return None

    def _start_heartbeat(self, held: Held) -> None:
        thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(held,),
            name=f"lease-heartbeat:{self.path.name}",
            daemon=True,
        )
        held.thread = thread
        thread.start()

    def _heartbeat_loop(self, held: Held) -> None:
        """Refresh the heartbeat until stopped or until the lock is known lost."""
        while not held.stop.wait(self.heartbeat_s):
            written, reason = self._beat(held)
            if written and reason is not None:
                held.lost = reason
                return
            # Not written: transient, retried; check() gives up once the lease is gone.

    def _timeout_error(self, seen: LockRecord | None, waited: float) -> LockTimeout:
        """The LockTimeout that names the holder and when it can be taken over."""
        try:
            current = self.holder() or seen
        except LockError:
            current = seen
        holder = current.describe() if current is not None else "no holder seen (racing)"
        return LockTimeout(
            f"timed out after {waited:.1f} s waiting for lock {self.path}; "
            f"held by {holder}. It is taken over once its heartbeat is seen unchanged for "
            f"its lease (on its own machine: once its process is gone); if that process is "
            f"alive, wait for it or stop it."
        )


def write_fenced(
    lock: LeaseLock, path: str | os.PathLike[str], data: bytes | Iterable[bytes]
) -> None:
    """Atomically replace `path` with `data` (or its chunks), only while `lock` is still held.

    Steps: write a temporary file in the same directory and fsync it; `LeaseLock.check`
    (the token is current, and the lease has not expired from our own point of view, minus
    `guard_s`); `os.replace`; fsync the directory; check again.

    The check and the rename are two steps. If this process is paused between them (SIGSTOP,
    a VM freeze, a swap storm) for longer than `guard_s` plus the rest of the lease, a
    takeover can happen in between and this stale rename still lands. The second check then
    raises LockLost, so the caller at least learns of it; readers that must be immune should
    also compare the fencing token stored inside the data (the higher token wins).

    Raises:
        LockLost: the lock is not held any more (nothing written if raised by
            the first check; possibly written if raised by the final check).
        OSError: writing the data failed (the temp file is removed).
    """
    target = Path(path)
    lock.check()  # fail fast before doing I/O
    tmp = temp_path(target, f"fenced.{lock.token}.")
    try:
        write_new(tmp, data)
    except BaseException:
        unlink_quietly(tmp)
        raise
    # The fencing check runs as late as possible: just before the rename.
    publish(tmp, target, before_rename=lock.check)
    lock.check()

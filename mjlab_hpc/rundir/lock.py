"""Single-writer lease lock for run directories on shared filesystems (NFS, Lustre, GPFS), where
flock/fcntl locks are not coherent between nodes. Built only from operations atomic on the
server: exclusive creation of the lock name (`os.link` of a fully written file), `rename`
within one directory, and `O_EXCL` ticket files whose numbers are fencing tokens never reused.

The owner refreshes a heartbeat inside the lock file's content (wall clock: other hosts read
it, so leases must be much longer than clock skew); an expired lease may be taken over, with a
larger token, and `write_fenced` refuses to publish once the token is not current (`LockLost`).
The design and the failures it covers: docs/single-writer.md.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import random
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

from mjlab_hpc.rundir.durable import publish, temp_path, write_new
from mjlab_hpc.rundir.lease import (
    MAX_IMMEDIATE_RETRIES,
    TICKETS_SUFFIX,
    Held,
    LockError,
    LockLost,
    LockRecord,
    LockTimeout,
    LockUsageError,
    OwnerInfo,
    claim_ticket,
    encode_record,
    env_error,
    link_exclusive,
    pwrite_all,
    read_snapshot,
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

# --------------------------------------------------------------------------- the lock


class LeaseLock:
    """A cross-host single-writer lease lock backed by one file on a shared filesystem.

    Usage::

        with LeaseLock(run_dir / "writer.lock", owner=OwnerInfo.from_env(rank),
                       lease_s=60) as lock:
            write_fenced(lock, run_dir / "state.json", data)  # raises LockLost if stale

    Next to the lock file, a directory ``<name>.tokens`` holds one empty ticket
    file per acquisition (the fencing-token counter); do not delete it while the
    run directory is in use. Not re-entrant: one object holds at most one
    acquisition. Methods are thread-safe; the object must not be used in a
    forked child.
    """

    def __init__(
        self, path: str | os.PathLike[str], owner: OwnerInfo | None = None, *, lease_s: float = 60.0
    ) -> None:
        """Create an (unacquired) lock. Another process may take over once the holder's
        heartbeat is older than `lease_s`: keep it much larger than the clock skew between
        hosts and than any pause to survive without losing the lock. The holder writes its
        heartbeat every `lease_s / 4` and treats its own lease as expired `lease_s / 5` early
        (clock skew, and the check-then-rename window of `write_fenced`)."""
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

    # ------------------------------------------------------------------ public API

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
        """The stale holder removed by the last acquisition (a takeover), else ``None``."""
        return self._displaced

    def holder(self) -> LockRecord | None:
        """Read who currently holds the lock (``None`` if nobody)."""
        try:
            snap = read_snapshot(self.path)
        except OSError as exc:
            raise env_error("read the lock file", self.path, exc) from exc
        return None if snap is None else snap.record

    def acquire(self, timeout_s: float | None = None) -> int:
        """Acquire the lock and start the heartbeat; return the new fencing token.

        Waits with jittered exponential backoff while another process holds a
        fresh lease, and takes over a holder whose heartbeat is older than its
        lease. ``timeout_s``: ``None`` waits forever, ``0`` tries once.

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
            start = time.monotonic()
            deadline = None if timeout_s is None else start + timeout_s
            attempt = 0
            quick_retries = 0
            while True:
                held, seen, contended = self._try_once()
                if held is not None:
                    self._start_heartbeat(held)
                    self._held = held
                    return held.token
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise self._timeout_error(seen, now - start)
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
            LockLost: the lock had already been lost (taken over or lease
                expired) before release; nothing of the new holder is touched.
        """
        with self._mutex:
            held = self._require_held("release")
            self._held = None
            held.stop.set()
            if held.thread is not None:
                held.thread.join()
            try:
                # Remove the file even if our own lease expired: if nobody took
                # over yet, this frees the lock now instead of after a lease.
                removal = remove_if_ours(self.path, held.nonce)
            finally:
                os.close(held.fd)
            lost = held.lost or removal
            if lost is not None:
                raise LockLost(f"lock {self.path} (token {held.token}) was lost: {lost}")

    def check(self) -> None:
        """Verify the lock is still ours; raise :class:`LockLost` otherwise.

        Checks, in order: the heartbeat thread has not seen a takeover; our own
        lease (measured on our monotonic clock since the last heartbeat, minus
        ``guard_s``) has not expired; the lock file still carries our nonce and
        token.
        """
        with self._mutex:
            held = self._require_held("check")
            reason = held.lost or self._own_lease_problem(held) or self._file_problem(held)
            if reason is not None:
                held.lost = reason
                raise LockLost(f"lock {self.path} (token {held.token}) was lost: {reason}")

    def is_held(self) -> bool:
        """True if this object holds the lock and :meth:`check` passes."""
        with self._mutex:
            if self._held is None or self._held.pid != os.getpid():
                return False
            try:
                self.check()
            except LockLost:
                return False
            return True

    # ------------------------------------------------------------------ internals

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

    def _try_once(self) -> tuple[Held | None, LockRecord | None, bool]:
        """One acquisition attempt.

        Returns (held or None, last holder record seen, whether a live holder was seen).
        """
        # Look first: waiting on a live holder then costs one read per poll, not a
        # temp file, fsync and link.
        try:
            snap = read_snapshot(self.path)
        except OSError as exc:
            raise env_error("read the lock file", self.path, exc) from exc
        if snap is not None and not self._is_stale(snap.record):
            return None, snap.record, True
        nonce = uuid.uuid4().hex
        temp = self.path.with_name(f"{self.path.name}.new.{nonce}")
        now = time.time()
        raw = encode_record(self.owner, None, nonce, now, now, self.lease_s)
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
                        snap = read_snapshot(self.path)
                        if snap is None:
                            return None, None, False  # vacant again: released just now
                        if not self._is_stale(snap.record):
                            return None, snap.record, True
                        if not take_over(self.path, snap, temp, fd, self.lease_s):
                            return None, snap.record, False
                elif not take_over(self.path, snap, temp, fd, self.lease_s):
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
        """We own the lock name: claim a token, record it, and verify we still own it."""
        try:
            hint = displaced.token if displaced is not None and displaced.token else 0
            token = claim_ticket(self._tickets, hint)
            heartbeat_mono = time.monotonic()
            now = time.time()
            raw = encode_record(self.owner, token, nonce, acquired_at, now, self.lease_s)
            pwrite_all(fd, raw)
            os.fsync(fd)
            snap = read_snapshot(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                remove_if_ours(self.path, nonce)
            raise env_error("record the fencing token", self.path, exc) from exc
        if snap is None or snap.record.nonce != nonce:
            # Paused for longer than a lease since winning: someone took over.
            # Our ticket is simply never used.
            return None
        return Held(
            fd=fd,
            nonce=nonce,
            token=token,
            acquired_at=acquired_at,
            pid=os.getpid(),
            hb_mono=heartbeat_mono,
        )

    def _is_stale(self, record: LockRecord) -> bool:
        # Unknown holders use our lease; known ones the lease they announced.
        lease = record.lease_s if record.lease_s is not None else self.lease_s
        return record.age_s() > lease

    def _own_lease_problem(self, held: Held) -> str | None:
        own_age = time.monotonic() - held.hb_mono
        limit = self.lease_s - self.guard_s
        if own_age > limit:
            return (
                f"own lease expired: last heartbeat written {own_age:.1f} s ago "
                f"(lease {self.lease_s:g} s minus guard "
                f"{self.guard_s:g} s); another process may have taken over"
            )
        return None

    def _file_problem(self, held: Held) -> str | None:
        try:
            with held.io_lock:  # no torn read of our own concurrent heartbeat
                snap = read_snapshot(self.path)
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
        period = self.heartbeat_s
        while not held.stop.wait(period):
            # Never refresh an expired lease: another process may already own it.
            reason = self._own_lease_problem(held) or self._file_problem(held)
            if reason is not None:
                held.lost = reason
                return
            mono = time.monotonic()
            now = time.time()
            raw = encode_record(
                self.owner, held.token, held.nonce, held.acquired_at, now, self.lease_s
            )
            try:
                with held.io_lock:
                    # Writes go to our own inode via the fd we created, so a late
                    # heartbeat after a takeover lands in the tombstone, not in
                    # the new holder's file.
                    pwrite_all(held.fd, raw)
                    os.fsync(held.fd)
            except OSError:
                continue  # transient; the own-lease check will give up in time
            held.hb_mono = mono

    def _timeout_error(self, seen: LockRecord | None, waited: float) -> LockTimeout:
        try:
            current = self.holder() or seen
        except LockError:
            current = seen
        holder = current.describe() if current is not None else "no holder seen (racing)"
        return LockTimeout(
            f"timed out after {waited:.1f} s waiting for lock {self.path}; "
            f"held by {holder}. It will be taken over once that heartbeat is older "
            f"than the lease; if that process is alive, wait for it or stop it."
        )


# --------------------------------------------------------------------------- fenced writes


def write_fenced(lock: LeaseLock, path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data``, only while ``lock`` is still held.

    Steps: write a temp file in the same directory and fsync it; :meth:`LeaseLock.check`
    (token still current, lease not expired from our own point of view, minus
    ``guard_s``); ``os.replace``; fsync the directory; check again.

    Remaining window: the check and the rename are two steps. If this process is
    paused between them (SIGSTOP, VM freeze, swap storm) for longer than
    ``guard_s`` plus the rest of the lease, a takeover can happen in between and
    this stale rename still lands. The second check then raises LockLost so the
    caller at least learns of it; readers that must be immune should also compare
    the fencing token stored inside the data (higher token wins).

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

"""Single-writer lease lock for run directories on shared filesystems.

Many nodes of a SLURM job (and successive or accidentally concurrent launches of
the same run) share one run directory on NFS, Lustre or GPFS. Exactly one process
may write checkpoints and metadata there at a time. ``flock``/``fcntl`` locks are
not reliably coherent between nodes on those filesystems, so this module builds a
lease lock only from operations that *are* atomic on the server:

* exclusive creation of the lock name (``os.link`` of a fully written temp file,
  which fails with ``EEXIST`` if the name exists);
* ``rename`` within one directory (only one of several renames of the same
  source name can succeed);
* exclusive creation (``O_CREAT | O_EXCL``) of numbered ticket files, which
  yields fencing tokens that are never reused.

The owner refreshes a heartbeat inside the lock file's content from a daemon
thread. When the heartbeat is older than the lease, another process may take the
lock over. Every acquisition gets a strictly larger fencing token, and
:func:`write_fenced` refuses to publish data once the token is no longer current
(:class:`LockLost`). See ``docs/single-writer.md`` for the design and the failure
cases it does and does not cover.

Clocks: ``heartbeat_at`` in the file is wall-clock time (``time.time``) because
other hosts compare it with their own clocks, so leases must be much longer than
the clock skew between nodes. Local durations (timeouts, the holder's own view
of its lease) use ``time.monotonic``.

Error types: :class:`LockError` derives from :class:`OSError` (an unusable lock
directory is an I/O-environment problem, and this lets :class:`LockTimeout` be
both a :class:`LockError` and a :class:`TimeoutError`). Misuse of the API (for
example releasing a lock this object does not hold) raises
:class:`LockUsageError`, a :class:`RuntimeError`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = [
    "LeaseConfig",
    "LeaseLock",
    "LockError",
    "LockLost",
    "LockRecord",
    "LockTimeout",
    "LockUsageError",
    "OwnerInfo",
    "write_fenced",
]

_FORMAT = "mjlab_hpc.lease_lock/1"
# Records are padded to a fixed size so a heartbeat rewrites them in place with
# one pwrite of constant length: no truncate, so a reader never sees an empty file.
_RECORD_BYTES = 512
_MAX_IMMEDIATE_RETRIES = 3
_TICKETS_SUFFIX = ".tokens"

_ERRNO_CAUSES: dict[int, tuple[str, str]] = {
    errno.EROFS: (
        "read-only file system",
        "remount it read-write or put the run directory on a writable filesystem",
    ),
    errno.ENOSPC: (
        "no space left on device",
        "free space on that filesystem or move the run directory elsewhere",
    ),
    errno.EDQUOT: (
        "disk quota exceeded",
        "free space under your quota or move the run directory elsewhere",
    ),
    errno.EACCES: (
        "permission denied",
        "make the directory writable by the user that runs the job on every node",
    ),
    errno.EPERM: (
        "operation not permitted",
        "make the directory writable by the user that runs the job on every node",
    ),
    errno.ENOENT: (
        "directory does not exist",
        "create it first (mkdir -p) on the shared filesystem, visible from every node",
    ),
    errno.ENOTDIR: (
        "a path component is not a directory",
        "point the lock at a path inside a directory",
    ),
}


# --------------------------------------------------------------------------- errors


class LockError(OSError):
    """The lock cannot be used: unusable directory (missing, read-only, full), I/O error.

    Subclass of :class:`OSError`; ``errno`` is set when the cause was an OS error.
    """


class LockLost(LockError):
    """The lock is no longer held: it was taken over, or our own lease expired.

    Raised by :meth:`LeaseLock.check` and :func:`write_fenced`, so a former owner
    that wakes up after a takeover cannot publish writes.
    """


class LockTimeout(LockError, TimeoutError):
    """:meth:`LeaseLock.acquire` gave up; the message names the current holder."""


class LockUsageError(RuntimeError):
    """The API was misused (double acquire, release without holding, use after fork)."""


def _env_error(action: str, path: Path, exc: OSError) -> LockError:
    """Turn a low-level OSError into a LockError that says what to do."""
    cause, hint = _ERRNO_CAUSES.get(
        exc.errno or -1, (exc.strerror or str(exc), "check the filesystem and its mount")
    )
    code = errno.errorcode.get(exc.errno or -1, "?")
    err = LockError(f"lock {path}: cannot {action}: {cause} ({code}). What to do: {hint}.")
    err.errno = exc.errno
    return err


# --------------------------------------------------------------------------- data


def _parse_restart_count(raw: str | None) -> int:
    # A malformed variable must not crash a training launch; the count is informative.
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        return 0


@dataclass(frozen=True)
class OwnerInfo:
    """Who holds (or wants) the lock; written into the lock file for diagnostics."""

    host: str
    pid: int
    job_id: str | None = None
    restart_count: int = 0
    rank: int = 0

    @classmethod
    def from_env(cls, rank: int = 0) -> OwnerInfo:
        """Describe the current process from the host name, pid and SLURM/submitit variables.

        ``job_id`` is ``SLURM_JOB_ID``, else ``SUBMITIT_LOCAL_JOB_ID``, else ``None``;
        ``restart_count`` is ``SLURM_RESTART_COUNT`` (0 when unset or malformed).
        """
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            job_id=job_id or None,
            restart_count=_parse_restart_count(os.environ.get("SLURM_RESTART_COUNT")),
            rank=rank,
        )

    def describe(self) -> str:
        """One-line human description, e.g. for error messages."""
        return (
            f"host={self.host} pid={self.pid} job_id={self.job_id} "
            f"restart_count={self.restart_count} rank={self.rank}"
        )


@dataclass(frozen=True)
class LockRecord:
    """The parsed content of a lock file.

    ``owner`` is ``None`` for an unknown holder (a half-written or unparsable
    file); its ``heartbeat_at`` is then the file's mtime.
    """

    owner: OwnerInfo | None
    token: int | None
    heartbeat_at: float
    acquired_at: float | None = None
    lease_s: float | None = None
    nonce: str | None = None

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat by the wall clock (negative under clock skew)."""
        return (time.time() if now is None else now) - self.heartbeat_at

    def describe(self, now: float | None = None) -> str:
        """One-line human description of the holder and its heartbeat age."""
        age = self.age_s(now)
        if self.owner is None:
            return (
                "an unknown holder (lock file half-written or unparsable), "
                f"file last modified {age:.1f} s ago"
            )
        token = "pending" if self.token is None else str(self.token)
        return (
            f"{self.owner.describe()} token={token}, last heartbeat {age:.1f} s ago "
            f"(lease {self.lease_s:g} s)"
        )


@dataclass(frozen=True)
class LeaseConfig:
    """Timing of a :class:`LeaseLock`; all values in seconds.

    lease_s: another process may take over once the holder's heartbeat is older
        than this. Keep it much larger than the clock skew between hosts and
        than any pause you want to survive without losing the lock.
    heartbeat_s: heartbeat period (default ``lease_s / 4``).
    guard_s: the holder treats its lease as expired this long before others may
        take over, to absorb clock skew and the check-then-rename window of
        :func:`write_fenced` (default ``lease_s / 5``).
    poll_s / poll_max_s: initial and maximum wait between acquisition attempts
        (exponential, jittered).
    timeout_s: default timeout of :meth:`LeaseLock.acquire` and of ``with``;
        ``None`` waits forever.
    """

    lease_s: float = 60.0
    heartbeat_s: float | None = None
    guard_s: float | None = None
    poll_s: float = 0.01
    poll_max_s: float = 0.5
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lease_s) and self.lease_s > 0):
            raise ValueError(f"lease_s must be a positive number, got {self.lease_s}")
        if not 0 < self.heartbeat_period_s <= self.lease_s / 2:
            raise ValueError(
                f"heartbeat_s must be in (0, lease_s/2]; got {self.heartbeat_period_s} "
                f"for lease_s={self.lease_s}"
            )
        if not 0 <= self.guard_period_s < self.lease_s - self.heartbeat_period_s:
            raise ValueError(
                f"guard_s must be in [0, lease_s - heartbeat_s); got {self.guard_period_s}"
            )
        if not 0 < self.poll_s <= self.poll_max_s:
            raise ValueError("need 0 < poll_s <= poll_max_s")
        if self.timeout_s is not None and self.timeout_s < 0:
            raise ValueError("timeout_s must be >= 0 or None")

    @property
    def heartbeat_period_s(self) -> float:
        """Effective heartbeat period."""
        return self.lease_s / 4 if self.heartbeat_s is None else self.heartbeat_s

    @property
    def guard_period_s(self) -> float:
        """Effective guard margin."""
        return self.lease_s / 5 if self.guard_s is None else self.guard_s


# --------------------------------------------------------------------------- file helpers


def _encode_record(
    owner: OwnerInfo,
    token: int | None,
    nonce: str,
    acquired_at: float,
    heartbeat_at: float,
    lease_s: float,
) -> bytes:
    doc = {
        "format": _FORMAT,
        "token": token,
        "nonce": nonce,
        "host": owner.host,
        "pid": owner.pid,
        "job_id": owner.job_id,
        "restart_count": owner.restart_count,
        "rank": owner.rank,
        "acquired_at": acquired_at,
        "heartbeat_at": heartbeat_at,
        "lease_s": float(lease_s),
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) >= _RECORD_BYTES:
        raise ValueError(f"lock record too large ({len(raw)} bytes); shorten host or job id")
    return raw.ljust(_RECORD_BYTES - 1) + b"\n"


def _decode_record(raw: bytes, mtime: float) -> LockRecord:
    """Parse a lock file; anything unexpected becomes an unknown holder aged by mtime."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a lock record")
        token = doc["token"]
        if token is not None and (not isinstance(token, int) or token < 1):
            raise ValueError("bad token")
        heartbeat_at = float(doc["heartbeat_at"])
        lease_s = float(doc["lease_s"])
        if not (math.isfinite(heartbeat_at) and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError("bad times")
        job_id = doc["job_id"]
        owner = OwnerInfo(
            host=str(doc["host"]),
            pid=int(doc["pid"]),
            job_id=None if job_id is None else str(job_id),
            restart_count=int(doc["restart_count"]),
            rank=int(doc["rank"]),
        )
        return LockRecord(
            owner=owner,
            token=token,
            heartbeat_at=heartbeat_at,
            acquired_at=float(doc["acquired_at"]),
            lease_s=lease_s,
            nonce=str(doc["nonce"]),
        )
    except (ValueError, KeyError, TypeError, OverflowError):
        return LockRecord(owner=None, token=None, heartbeat_at=mtime)


@dataclass(frozen=True)
class _Snapshot:
    """A lock file as read: raw bytes (compared byte-for-byte on takeover) and parse."""

    raw: bytes
    record: LockRecord


def _read_snapshot(path: Path) -> _Snapshot | None:
    """Read the lock file; ``None`` if it does not exist. Other OSErrors propagate."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        # Read through a fresh open: NFS close-to-open consistency revalidates the
        # content on open, which is why the heartbeat lives in the content, not mtime.
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        mtime = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    return _Snapshot(raw=raw, record=_decode_record(raw, mtime))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _pwrite_all(fd: int, data: bytes) -> None:
    view, offset = memoryview(data), 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _link_exclusive(src: Path, dst: Path, src_fd: int) -> bool:
    """Create ``dst`` as a hard link to ``src``; False if ``dst`` already exists.

    On NFS a retransmitted LINK can report EEXIST although the first attempt
    succeeded; as open(2) recommends, a link count of 2 on our inode means we won.
    """
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return os.fstat(src_fd).st_nlink == 2


def _ticket_exists(tickets: Path, n: int) -> bool:
    return n <= 0 or os.path.exists(tickets / str(n))


def _claim_ticket(tickets: Path, hint: int) -> int:
    """Claim the next fencing token by creating ticket file ``N`` with O_EXCL.

    Ticket files are never deleted, so the set of existing tickets is always
    ``{1..max}`` (every claim starts at or below ``max + 1`` and walks up on
    EEXIST). A claim therefore returns a number larger than every ticket that
    existed before it started: tokens strictly increase and are never reused,
    however processes race, crash or pause. ``hint`` (a known ticket) only
    shortens the search.
    """
    lo = hint if _ticket_exists(tickets, hint) else 0
    # Gallop then bisect for the first missing ticket. A stale negative lookup
    # (NFS dentry cache) can only make us start lower, which O_EXCL corrects.
    step, hi = 1, lo + 1
    while _ticket_exists(tickets, hi):
        lo, step = hi, step * 2
        hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _ticket_exists(tickets, mid):
            lo = mid
        else:
            hi = mid
    n = lo + 1
    while True:
        try:
            fd = os.open(tickets / str(n), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        _fsync_dir(tickets)
        return n


# --------------------------------------------------------------------------- the lock


@dataclass
class _Held:
    """Per-acquisition state of a LeaseLock (mutable, owned by one LeaseLock object)."""

    fd: int
    nonce: str
    token: int
    acquired_at: float
    pid: int
    hb_mono: float  # monotonic time sampled just before the last heartbeat's wall stamp
    stop: threading.Event = field(default_factory=threading.Event)
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    lost: str | None = None  # reason, once known lost
    thread: threading.Thread | None = None


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
        self,
        path: str | os.PathLike[str],
        owner: OwnerInfo | None = None,
        *,
        lease_s: float = 60.0,
        heartbeat_s: float | None = None,
        guard_s: float | None = None,
        poll_s: float = 0.01,
        poll_max_s: float = 0.5,
        timeout_s: float | None = None,
        config: LeaseConfig | None = None,
    ) -> None:
        """Create an (unacquired) lock; ``config`` overrides the individual timing args."""
        self.path = Path(path).absolute()
        self.owner = owner if owner is not None else OwnerInfo.from_env()
        self.config = config or LeaseConfig(
            lease_s=lease_s,
            heartbeat_s=heartbeat_s,
            guard_s=guard_s,
            poll_s=poll_s,
            poll_max_s=poll_max_s,
            timeout_s=timeout_s,
        )
        self._tickets = self.path.with_name(self.path.name + _TICKETS_SUFFIX)
        self._mutex = threading.RLock()
        self._held: _Held | None = None
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
            snap = _read_snapshot(self.path)
        except OSError as exc:
            raise _env_error("read the lock file", self.path, exc) from exc
        return None if snap is None else snap.record

    def acquire(self, timeout_s: float | None = None) -> int:
        """Acquire the lock and start the heartbeat; return the new fencing token.

        Waits with jittered exponential backoff while another process holds a
        fresh lease, and takes over a holder whose heartbeat is older than its
        lease. ``timeout_s`` (default ``config.timeout_s``): ``None`` waits
        forever, ``0`` tries once.

        Raises:
            LockTimeout: not acquired in time; the message names the holder.
            LockError: the lock directory is missing, read-only, full, ...
            LockUsageError: this object already holds the lock.
        """
        if timeout_s is None:
            timeout_s = self.config.timeout_s
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
                if not contended and quick_retries < _MAX_IMMEDIATE_RETRIES:
                    # Lost a race on a vacant/stale lock: retry at once, a bit.
                    quick_retries += 1
                    continue
                quick_retries = 0
                pause = min(self.config.poll_max_s, self.config.poll_s * 1.5**attempt)
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
                removal = self._remove_if_ours(held.nonce)
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

    def _require_held(self, action: str) -> _Held:
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
            raise _env_error(
                f"use the lock directory {parent}",
                self.path,
                FileNotFoundError(errno.ENOENT, "missing"),
            )
        try:
            self._tickets.mkdir(exist_ok=True)
        except OSError as exc:
            raise _env_error(f"create the token directory {self._tickets}", self.path, exc) from exc

    def _try_once(self) -> tuple[_Held | None, LockRecord | None, bool]:
        """One acquisition attempt.

        Returns (held or None, last holder record seen, whether a live holder was seen).
        """
        # Look first: waiting on a live holder then costs one read per poll, not a
        # temp file, fsync and link.
        try:
            snap = _read_snapshot(self.path)
        except OSError as exc:
            raise _env_error("read the lock file", self.path, exc) from exc
        if snap is not None and not self._is_stale(snap.record):
            return None, snap.record, True
        nonce = uuid.uuid4().hex
        temp = self.path.with_name(f"{self.path.name}.new.{nonce}")
        now = time.time()
        raw = _encode_record(self.owner, None, nonce, now, now, self.config.lease_s)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _env_error(
                f"create a file in the lock directory {self.path.parent}", self.path, exc
            ) from exc
        held: _Held | None = None
        try:
            try:
                _write_all(fd, raw)
                os.fsync(fd)
                if snap is None:
                    if _link_exclusive(temp, self.path, fd):
                        snap = None  # won an empty name: nobody displaced
                    else:
                        snap = _read_snapshot(self.path)
                        if snap is None:
                            return None, None, False  # vacant again: released just now
                        if not self._is_stale(snap.record):
                            return None, snap.record, True
                        if not self._take_over(snap, temp, fd):
                            return None, snap.record, False
                elif not self._take_over(snap, temp, fd):
                    return None, snap.record, False
            except OSError as exc:
                raise _env_error("create the lock file", self.path, exc) from exc
            finally:
                _unlink_quietly(temp)  # if we won, the inode lives on as the lock file
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
    ) -> _Held | None:
        """We own the lock name: claim a token, record it, and verify we still own it."""
        try:
            hint = displaced.token if displaced is not None and displaced.token else 0
            token = _claim_ticket(self._tickets, hint)
            heartbeat_mono = time.monotonic()
            now = time.time()
            raw = _encode_record(self.owner, token, nonce, acquired_at, now, self.config.lease_s)
            _pwrite_all(fd, raw)
            os.fsync(fd)
            snap = _read_snapshot(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._remove_if_ours(nonce)
            raise _env_error("record the fencing token", self.path, exc) from exc
        if snap is None or snap.record.nonce != nonce:
            # Paused for longer than a lease since winning: someone took over.
            # Our ticket is simply never used.
            return None
        return _Held(
            fd=fd,
            nonce=nonce,
            token=token,
            acquired_at=acquired_at,
            pid=os.getpid(),
            hb_mono=heartbeat_mono,
        )

    def _is_stale(self, record: LockRecord) -> bool:
        # Unknown holders use our lease; known ones the lease they announced.
        lease = record.lease_s if record.lease_s is not None else self.config.lease_s
        return record.age_s() > lease

    def _take_over(self, stale: _Snapshot, temp: Path, fd: int) -> bool:
        """Replace a stale lock file atomically; True if we now own the lock name.

        1. Racers that judged the same stale content first compete for a breaker
           file named after a hash of that content (O_EXCL): only one of them
           goes on, so racers do not rename each other's fresh locks.
        2. The breaker re-reads the lock file and gives up if it changed.
        3. It renames the lock file to a unique tombstone; of several renames of
           one name exactly one succeeds.
        4. If the tombstone is not byte-identical to what was judged stale (the
           holder heartbeated just now), it is put back (same inode, so its
           holder keeps working) and we give up.
        5. Otherwise our record is linked to the lock name (exclusive).
        """
        digest = hashlib.sha256(stale.raw).hexdigest()[:24]
        breaker = self.path.with_name(f"{self.path.name}.break.{digest}")
        own_breaker = False
        try:
            try:
                os.close(os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC))
                own_breaker = True
            except FileExistsError:
                # Someone else is breaking this lock, unless they crashed doing it.
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - os.stat(breaker).st_mtime <= self.config.lease_s:
                        return False
            current = _read_snapshot(self.path)
            if current is None or current.raw != stale.raw:
                return False
            tomb = self.path.with_name(f"{self.path.name}.tomb.{uuid.uuid4().hex}")
            try:
                os.rename(self.path, tomb)
            except FileNotFoundError:
                return False  # another process renamed it first
            try:
                moved = _read_snapshot(tomb)
                if moved is None or moved.raw != stale.raw:
                    with contextlib.suppress(FileExistsError):
                        os.link(tomb, self.path)
                    return False
                return _link_exclusive(temp, self.path, fd)
            finally:
                _unlink_quietly(tomb)
        finally:
            if own_breaker:
                _unlink_quietly(breaker)

    def _remove_if_ours(self, nonce: str) -> str | None:
        """Remove the lock file if it carries ``nonce``; return a reason if it did not."""
        try:
            snap = _read_snapshot(self.path)
            if snap is None:
                return "the lock file was removed (taken over or deleted)"
            if snap.record.nonce != nonce:
                return f"taken over by {snap.record.describe()}"
            tomb = self.path.with_name(f"{self.path.name}.tomb.{uuid.uuid4().hex}")
            try:
                os.rename(self.path, tomb)
            except FileNotFoundError:
                return "the lock file was removed (taken over) during release"
            try:
                moved = _read_snapshot(tomb)
                if moved is None or moved.record.nonce != nonce:
                    # Taken over between our read and our rename: give it back.
                    with contextlib.suppress(FileExistsError):
                        os.link(tomb, self.path)
                    return "taken over during release"
            finally:
                _unlink_quietly(tomb)
        except OSError as exc:
            raise _env_error("remove the lock file", self.path, exc) from exc
        return None

    def _own_lease_problem(self, held: _Held) -> str | None:
        own_age = time.monotonic() - held.hb_mono
        limit = self.config.lease_s - self.config.guard_period_s
        if own_age > limit:
            return (
                f"own lease expired: last heartbeat written {own_age:.1f} s ago "
                f"(lease {self.config.lease_s:g} s minus guard "
                f"{self.config.guard_period_s:g} s); another process may have taken over"
            )
        return None

    def _file_problem(self, held: _Held) -> str | None:
        try:
            with held.io_lock:  # no torn read of our own concurrent heartbeat
                snap = _read_snapshot(self.path)
        except OSError as exc:
            return f"cannot read the lock file to verify ownership: {exc}"
        if snap is None:
            return "the lock file was removed (taken over or deleted)"
        record = snap.record
        if record.nonce != held.nonce or record.token != held.token:
            return f"taken over by {record.describe()}"
        return None

    def _start_heartbeat(self, held: _Held) -> None:
        thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(held,),
            name=f"lease-heartbeat:{self.path.name}",
            daemon=True,
        )
        held.thread = thread
        thread.start()

    def _heartbeat_loop(self, held: _Held) -> None:
        """Refresh the heartbeat until stopped or until the lock is known lost."""
        period = self.config.heartbeat_period_s
        while not held.stop.wait(period):
            # Never refresh an expired lease: another process may already own it.
            reason = self._own_lease_problem(held) or self._file_problem(held)
            if reason is not None:
                held.lost = reason
                return
            mono = time.monotonic()
            now = time.time()
            raw = _encode_record(
                self.owner, held.token, held.nonce, held.acquired_at, now, self.config.lease_s
            )
            try:
                with held.io_lock:
                    # Writes go to our own inode via the fd we created, so a late
                    # heartbeat after a takeover lands in the tombstone, not in
                    # the new holder's file.
                    _pwrite_all(held.fd, raw)
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
    tmp = target.with_name(f".{target.name}.fenced.{lock.token}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        lock.check()  # the fencing check, as late as possible before publishing
        os.replace(tmp, target)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(target.parent)
    lock.check()

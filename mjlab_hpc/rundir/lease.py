"""The lease on disk: the lock file's owner record, the fencing tokens, the atomic steps.

The owner record has a fixed size, so a heartbeat rewrites it in place. Fencing tokens are
ticket files, never reused. A stale lease is taken over, and a lease given back, in steps
that are atomic on a shared filesystem. `mjlab_hpc.rundir.lock` builds the lock from these
parts; its docstring describes the design.

LockError derives from OSError: an unusable lock directory is a problem of the environment,
and LockTimeout is then both a LockError and a TimeoutError. Misuse of the API (releasing a
lock this object does not hold) raises LockUsageError, a RuntimeError.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mjlab_hpc.procs import alive, machine_id
from mjlab_hpc.rundir.durable import fsync_dir, open_regular

__all__ = [
    "Held",
    "LockError",
    "LockLost",
    "LockRead",
    "LockRecord",
    "LockTimeout",
    "LockUsageError",
    "Observer",
    "OwnerInfo",
    "claim_ticket",
    "decode_record",
    "encode_record",
    "env_error",
    "folder_id",
    "holder_gone",
    "link_exclusive",
    "pwrite_all",
    "read_lock",
    "remove_if_ours",
    "take_over",
    "unlink_quietly",
    "write_all",
]

FORMAT = "mjlab_hpc.lease_lock/1"
# Records are padded to a fixed size so a heartbeat rewrites them in place with
# one pwrite of constant length: no truncate, so a reader never sees an empty file.
RECORD_BYTES = 512
MAX_IMMEDIATE_RETRIES = 3
TICKETS_SUFFIX = ".tokens"

ERRNO_CAUSES: dict[int, tuple[str, str]] = {
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


class LockError(OSError):
    """The lock cannot be used: its directory is missing, read-only or full, or I/O failed.

    `errno` is set when the cause was an OS error.
    """


class LockLost(LockError):
    """The lock is no longer held: it was taken over, or our own lease expired.

    `LeaseLock.check` and `write_fenced` raise it, so a former owner that wakes up after a
    takeover cannot publish anything.
    """


class LockTimeout(LockError, TimeoutError):
    """`LeaseLock.acquire` gave up waiting; the message names the current holder."""


class LockUsageError(RuntimeError):
    """The API was misused (double acquire, release without holding, use after fork)."""


def env_error(action: str, path: Path, exc: OSError) -> LockError:
    """Turn a low-level OSError into a LockError that says what to do."""
    cause, hint = ERRNO_CAUSES.get(
        exc.errno or -1, (exc.strerror or str(exc), "check the filesystem and its mount")
    )
    code = errno.errorcode.get(exc.errno or -1, "?")
    err = LockError(f"lock {path}: cannot {action}: {cause} ({code}). What to do: {hint}.")
    err.errno = exc.errno
    return err


def parse_restart_count(raw: str | None) -> int:
    """Read SLURM_RESTART_COUNT; 0 when it is unset or malformed."""
    # A malformed variable must not crash a training launch: the count is only informative.
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
    machine: str = ""
    """Its kernel's boot and pid namespace (`procs.machine_id`; "": unknown).

    A process with the same one can tell whether `pid` lives."""
    folder: int = 0
    """The inode of the folder holding the lock file when it was taken (0: unknown). A copy of
    that folder (`cp -r` of a live run) has another: its copied lock has no holder there."""

    @classmethod
    def from_env(cls, rank: int = 0) -> OwnerInfo:
        """Describe this process from its host name, pid and Slurm or submitit variables.

        `job_id` is SLURM_JOB_ID, else SUBMITIT_LOCAL_JOB_ID, else None; `restart_count` is
        SLURM_RESTART_COUNT (0 when unset or malformed).
        """
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            job_id=job_id or None,
            restart_count=parse_restart_count(os.environ.get("SLURM_RESTART_COUNT")),
            rank=rank,
            machine=machine_id(),
        )

    def describe(self) -> str:
        """Describe the owner in one line, for messages."""
        return (
            f"host={self.host} pid={self.pid} job_id={self.job_id} "
            f"restart_count={self.restart_count} rank={self.rank}"
        )


@dataclass(frozen=True)
class LockRecord:
    """The parsed content of a lock file.

    `owner` is None for an unknown holder (a half-written or unparsable file); its
    `heartbeat_at` is then the file's mtime, which is shown and never compared.
    """

    owner: OwnerInfo | None
    token: int | None
    heartbeat_at: float
    acquired_at: float | None = None
    lease_s: float | None = None
    nonce: str | None = None

    def describe(self) -> str:
        """Describe the holder in one line.

        The heartbeat's time is the holder's own clock's; no age is given, which would compare
        the clocks of two machines.
        """
        if self.owner is None:
            return "an unknown holder (lock file half-written or unparsable)"
        token = "pending" if self.token is None else str(self.token)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.heartbeat_at))
        return (
            f"{self.owner.describe()} token={token}, last heartbeat {stamp} by its clock "
            f"(lease {self.lease_s:g} s)"
        )


def encode_record(
    owner: OwnerInfo,
    token: int | None,
    nonce: str,
    acquired_at: float,
    heartbeat_at: float,
    lease_s: float,
) -> bytes:
    """Encode a lock record as the lock file's fixed-size content."""
    doc = {
        "format": FORMAT,
        "token": token,
        "nonce": nonce,
        "host": owner.host,
        "pid": owner.pid,
        "job_id": owner.job_id,
        "restart_count": owner.restart_count,
        "rank": owner.rank,
        "machine": owner.machine,
        "folder": owner.folder,
        "acquired_at": acquired_at,
        "heartbeat_at": heartbeat_at,
        "lease_s": float(lease_s),
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) >= RECORD_BYTES:
        raise ValueError(f"lock record too large ({len(raw)} bytes); shorten host or job id")
    return raw.ljust(RECORD_BYTES - 1) + b"\n"


def decode_record(raw: bytes, mtime: float) -> LockRecord:
    """Parse a lock file; anything unexpected becomes an unknown holder stamped by `mtime`."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
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
            machine=str(doc.get("machine") or ""),
            folder=int(doc.get("folder") or 0),
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
class LockRead:
    """A lock file as read: its raw bytes (compared byte for byte on takeover), parsed."""

    raw: bytes
    record: LockRecord


def read_lock(path: Path) -> LockRead | None:
    """Read the lock file; None if it does not exist (other OSErrors propagate).

    Anything but a small regular file in its folder (a FIFO, a link out) is an OSError.
    """
    try:
        # Read through a fresh open: NFS close-to-open consistency revalidates the
        # content on open, which is why the heartbeat lives in the content, not mtime.
        with open_regular(Path(path), 1 << 20) as f:
            raw = f.read(1 << 20)
            mtime = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise OSError(errno.EINVAL, str(exc), str(path)) from None
    return LockRead(raw=raw, record=decode_record(raw, mtime))


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` at `fd`'s position."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pwrite_all(fd: int, data: bytes) -> None:
    """Write all of `data` at the start of `fd`'s file."""
    view, offset = memoryview(data), 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)


def unlink_quietly(path: Path) -> None:
    """Remove `path` if it can be removed."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def link_exclusive(src: Path, dst: Path, src_fd: int) -> bool:
    """Create `dst` as a hard link to `src`; False if `dst` already exists.

    On NFS a retransmitted LINK can report EEXIST although the first attempt succeeded; as
    open(2) recommends, a link count of 2 on our inode means we won.
    """
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return os.fstat(src_fd).st_nlink == 2


def ticket_exists(tickets: Path, n: int) -> bool:
    """Whether ticket `n` was claimed (every number below 1 counts as claimed)."""
    return n <= 0 or os.path.exists(tickets / str(n))


def claim_ticket(tickets: Path, hint: int) -> int:
    """Claim the next fencing token by creating its ticket file with O_EXCL.

    Ticket files are never deleted, so the existing tickets are always 1 to max: every claim
    starts at or below max + 1 and walks up on EEXIST. A claim therefore returns a number
    larger than every ticket that existed before it started. Tokens strictly increase and
    are never reused, however processes race, crash or pause. `hint` (a known ticket) only
    shortens the search.
    """
    lo = hint if ticket_exists(tickets, hint) else 0
    # Gallop then bisect for the first missing ticket. A stale negative lookup
    # (NFS dentry cache) can only make us start lower, which O_EXCL corrects.
    step, hi = 1, lo + 1
    while ticket_exists(tickets, hi):
        lo, step = hi, step * 2
        hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ticket_exists(tickets, mid):
            lo = mid
        else:
            hi = mid
    n = lo + 1
    while True:
        try:
            fd = os.open(
                tickets / str(n), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666
            )
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        fsync_dir(tickets)
        return n


class Observer:
    """Measures how long this process has seen something unchanged, by its own clock.

    This is how a lease is judged: never by comparing another machine's clock (or a file's
    mtime) with ours. Time this process did not run (stopped, a suspended job, a frozen VM)
    does not count. A gap of more than `max_gap_s` between two looks starts the watch again,
    so a waiter stopped together with the holder does not take over when both wake.
    """

    def __init__(self, max_gap_s: float = 5.0) -> None:
        self.max_gap_s = max_gap_s
        self._running = 0.0
        self._last = time.monotonic()
        self._seen: dict[str, tuple[bytes, float]] = {}

    def clock(self) -> float:
        """Seconds this process has run since the observer was made (gaps left out)."""
        now = time.monotonic()
        gap, self._last = now - self._last, now
        if gap > self.max_gap_s:
            self._seen.clear()  # what was seen before the gap says nothing about now
        else:
            self._running += gap
        return self._running

    def unchanged_for(self, key: str, value: bytes) -> float:
        """Seconds `key` has been seen with this `value` (0 on a first or changed look)."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or seen[0] != value:
            self._seen[key] = (value, now)
            return 0.0
        return now - seen[1]


def folder_id(lock: Path) -> int:
    """The inode of the folder holding `lock` (0: it cannot be read)."""
    try:
        return os.stat(lock.parent).st_ino
    except OSError:
        return 0


def holder_gone(record: LockRecord, lock: Path | None = None) -> bool | None:
    """Whether a holder is known to be gone.

    True: its process is gone, or it holds the lock of another folder (`lock` is a copy of
    its lock file). False: it lives (a stopped or suspended one too). None: this process
    cannot know (another machine, a container with other pids, an unknown holder).
    """
    owner = record.owner
    if owner is None:
        return None
    if owner.folder and lock is not None and folder_id(lock) not in (0, owner.folder):
        return True  # a copied lock file (cp -r of a live run): its holder holds another
    if not owner.machine or owner.machine != machine_id():
        return None
    return not alive(owner.pid)


@dataclass
class Held:
    """The state of one acquisition of a LeaseLock (mutable, owned by that object)."""

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


def take_over(
    path: Path, stale: LockRead, temp: Path, fd: int, lease_s: float, observer: Observer
) -> bool:
    """Replace a stale lock file atomically; True if we now own the lock name.

    1. Racers that judged the same stale content first compete for a breaker file named
       after a hash of that content (O_EXCL): only one of them goes on, so racers do not
       rename each other's fresh locks. A breaker that `observer` has seen for longer than
       a lease was left by a racer that crashed: it is removed.
    2. The breaker re-reads the lock file and gives up if it changed.
    3. It renames the lock file to a unique tombstone; of several renames of one name
       exactly one succeeds.
    4. If the tombstone is not byte-identical to what was judged stale (the holder
       heartbeated just now), it is put back (same inode, so its holder keeps working) and
       we give up.
    5. Otherwise our record is linked to the lock name (exclusive).
    """
    digest = hashlib.sha256(stale.raw).hexdigest()[:24]
    breaker = path.with_name(f"{path.name}.break.{digest}")
    own_breaker = False
    try:
        try:
            os.close(os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
            own_breaker = True
        except FileExistsError:
            # Someone else is breaking this lock, unless they crashed doing it (seen here
            # for longer than a lease); then the next attempt may create it.
            if observer.unchanged_for(breaker.name, b"") > lease_s:
                unlink_quietly(breaker)
            return False
        current = read_lock(path)
        if current is None or current.raw != stale.raw:
            return False
        tomb = path.with_name(f"{path.name}.tomb.{uuid.uuid4().hex}")
        try:
            os.rename(path, tomb)
        except FileNotFoundError:
            return False  # another process renamed it first
        try:
            moved = read_lock(tomb)
            if moved is None or moved.raw != stale.raw:
                with contextlib.suppress(FileExistsError):
                    os.link(tomb, path)
                return False
            return link_exclusive(temp, path, fd)
        finally:
            unlink_quietly(tomb)
    finally:
        if own_breaker:
            unlink_quietly(breaker)


def remove_if_ours(path: Path, nonce: str) -> str | None:
    """Remove the lock file if it carries `nonce`; else return why not (None: removed)."""
    try:
        snap = read_lock(path)
        if snap is None:
            return "the lock file was removed (taken over or deleted)"
        if snap.record.nonce != nonce:
            return f"taken over by {snap.record.describe()}"
        tomb = path.with_name(f"{path.name}.tomb.{uuid.uuid4().hex}")
        try:
            os.rename(path, tomb)
        except FileNotFoundError:
            return "the lock file was removed (taken over) during release"
        try:
            moved = read_lock(tomb)
            if moved is None or moved.record.nonce != nonce:
                # Taken over between our read and our rename: give it back.
                with contextlib.suppress(FileExistsError):
                    os.link(tomb, path)
                return "taken over during release"
        finally:
            unlink_quietly(tomb)
    except OSError as exc:
        raise env_error("remove the lock file", path, exc) from exc
    return None

"""Durable writes, the one way this package publishes a file that must survive a crash.

A file is written to a temporary name in the same directory, fsynced, renamed over its final
name, and the directory is fsynced: after a crash (SIGKILL, a lost node, a power cut) readers
find the old file or the whole new one, never a torn one. `before_rename` runs once the data
is durable and just before the rename: the run's single writer checks its fencing token
there, so a writer that lost its lock publishes nothing. `open_regular` is the one way a
file of a run is read back (`read_regular`: a whole record, `read_tail`: the end of a log):
nothing but a regular file of a plausible size inside its folder, and never a wait.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from mjlab_hpc.procs import user_name

__all__ = [
    "LOG_LIMIT",
    "RECORD_LIMIT",
    "create_exclusive",
    "fsync_dir",
    "open_regular",
    "ownership",
    "publish",
    "read_regular",
    "read_tail",
    "temp_path",
    "write_atomic",
    "write_json_atomic",
    "write_new",
]

# Filesystems that cannot fsync a directory say so with one of these; that is not a failure.
_NO_DIR_FSYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


#: The most a record of ours (run.json, a marker, a checksum) holds: anything larger is no record.
RECORD_LIMIT = 64 << 20
#: The most of a log's end that is read (`read_tail`): a log may grow without bound.
LOG_LIMIT = 64 << 20
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "no regular file")


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


def _real(path: Path) -> str:
    """Where `path` really is, as the kernel resolves it (cheaper than os.path.realpath)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(path)
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)


def _confined(path: Path, within: Path) -> str:
    """The real path of `path`, if it lies in `within` (ValueError naming it if not).

    What lies outside is never opened: a link to /dev/zero or a FIFO is named by its kind
    from a stat of its target, a link to a file elsewhere as a link out.
    """
    real = os.path.realpath(path)
    if _inside(real, _real(within)):
        return real
    with contextlib.suppress(OSError):
        mode = os.stat(real).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path.name} is {_kind(mode)}, not a file")
    raise ValueError(f"{path.name} is a link out of {within.name or within}")


@contextlib.contextmanager
def open_regular(path: Path, limit: int | None, within: Path | None = None) -> Iterator[BinaryIO]:
    """Open `path` for reading if it is a regular file of at most `limit` bytes (None: any).

    It must lie in the folder `within` (default: its own folder): what we read in a run
    directory never follows a link out of it. Anything else raises ValueError naming it
    before anything is read, and never waits: /dev/zero read into memory, or a FIFO that
    never ends, would take the reader (a login node) down with it. OSError comes as open(2)
    gives it (a missing file, no permission).
    """
    root = within if within is not None else path.parent
    # A FIFO opens without a writer (O_NONBLOCK); a link is not followed blindly (O_NOFOLLOW):
    # it is followed only to where it leads inside `root`.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = os.open(_confined(path, root), flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is {_kind(st.st_mode)}, not a file")
        if limit is not None and st.st_size > limit:
            raise ValueError(
                f"{path.name} holds {st.st_size:,} bytes, more than such a file can ({limit:,})"
            )
        with contextlib.suppress(OSError):  # where it is: a folder on the way may be a link
            real = os.readlink(f"/proc/self/fd/{fd}")
            # A real path holds no link: one under `root` as written is under `root`.
            if not _inside(real, str(root.absolute())) and not _inside(real, _real(root)):
                raise ValueError(f"{path.name} is a link out of {root.name or root}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def ownership(path: Path) -> str:
    """Say whose `path` is and its mode, for a line that says why it cannot be used.

    For example `it belongs to alice, drwxr-sr-x` ('' when it cannot be looked at).
    """
    try:
        st = path.stat()
    except OSError:
        return ""
    return f"it belongs to {user_name(st.st_uid)}, {stat.filemode(st.st_mode)}"


def read_regular(path: Path, limit: int = RECORD_LIMIT, within: Path | None = None) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (`open_regular`)."""
    with open_regular(path, limit, within) as f:
        data = f.read(os.fstat(f.fileno()).st_size)
        while len(data) <= limit and (more := f.read(1 << 20)):  # it grows as it is read
            data += more
    if len(data) > limit:
        raise ValueError(f"{path.name} holds more than {limit:,} bytes")
    return data


def read_tail(path: Path, limit: int, within: Path | None = None) -> bytes:
    """At most the last `limit` bytes of `path` (`open_regular`), from a line's start.

    For files that may grow large (a log, progress.jsonl): the reader needs their end.
    """
    with open_regular(path, None, within) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - limit))
        data = f.read(limit)
    return data[data.find(b"\n") + 1 :] if size > limit else data


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in directory `path` durable.

    A filesystem that does not support fsync on directories is accepted as it is; any other
    error (the directory is gone, an I/O error) is raised.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def temp_path(path: Path, tag: str = "") -> Path:
    """A hidden temporary name next to `path` that no other writer uses."""
    return path.with_name(f".{path.name}.{tag}{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_new(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Create `path` (it must not exist) holding `data` (or its chunks, in order), fsynced.

    The name is not published anywhere else: this writes the temporary files of the
    functions below.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for chunk in [data] if isinstance(data, bytes) else data:
            _write_fd(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path, before_rename: Callable[[], None] | None = None) -> None:
    """Rename the complete file `tmp` over `path` durably.

    The steps: fsync its data, `before_rename`, rename, fsync the directory. On any failure
    `tmp` is removed and `path` is untouched.
    """
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes, before_rename: Callable[[], None] | None = None) -> None:
    """Replace `path` with `data` so that readers see the old file or the whole new one."""
    tmp = temp_path(path)
    try:
        write_new(tmp, data)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    publish(tmp, path, before_rename)


def write_json_atomic(
    path: Path, data: Any, before_rename: Callable[[], None] | None = None
) -> None:
    """`write_atomic` of `data` as indented, key-sorted JSON with a final newline."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode(), before_rename)


def create_exclusive(path: Path, data: bytes) -> bool:
    """Publish `path` with `data` only if no such name exists; True if this call created it.

    The complete file is hard-linked to its name, which is atomic on NFS too: of several
    racing callers exactly one wins and every reader sees a whole file. On NFS a retransmitted
    LINK can report EEXIST although it succeeded; as open(2) recommends, a link count of 2 on
    our own inode means we won.
    """
    tmp = temp_path(path)
    write_new(tmp, data)
    try:
        try:
            os.link(tmp, path)
            won = True
        except FileExistsError:
            won = os.stat(tmp).st_nlink == 2
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if won:
        fsync_dir(path.parent)
    return won

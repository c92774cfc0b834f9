"""Durable writes, the one way this package publishes a file that must survive a crash.

A file is written to a temporary name in the same directory, fsynced, renamed over its final
name, and the directory is fsynced: after a crash (SIGKILL, a lost node, a power cut) readers
find the old file or the whole new one, never a torn one. `before_rename` runs once the data
is durable and just before the rename: the run's single writer checks its fencing token
there, so a writer that lost its lock publishes nothing. `open_regular` is the one way a
file of a run is read back (`read_regular`: a whole record, `read_tail`: the end of a log):
nothing but a regular file of a plausible size inside its folder, and never a wait.

Every file this package creates, replaces or appends to in a run directory is written here
(`write_atomic`, `create_exclusive`, `append`/`open_append`, `reserve`), and no write follows
a link out of the run: the file's own name is opened with O_NOFOLLOW relative to its folder,
and that folder is reached without following another user's link (`open_dir`); a link met
raises LinkRefused, one line naming it. Temporary files are created exclusively (O_EXCL)
under names nobody can predict.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal, TextIO, overload

from mjlab_hpc.procs import user_name

__all__ = [
    "LOG_LIMIT",
    "RECORD_LIMIT",
    "LinkRefused",
    "append",
    "create_exclusive",
    "fsync_dir",
    "open_append",
    "open_dir",
    "open_regular",
    "ownership",
    "publish",
    "read_regular",
    "read_tail",
    "reserve",
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
    folder = open_dir(path)
    try:
        _fsync_folder(folder)
    finally:
        os.close(folder)


def _fsync_folder(folder: int) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=folder)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


# Writes. Every file this package creates, replaces or appends to in a run directory goes
# through the functions below, so that a symbolic link planted there (by a teammate who
# shares the log root) is never written through: the directory is reached without
# following a link of another user (`open_dir`), and the file itself is opened relative to
# it with O_NOFOLLOW. Temporary files are created exclusively under unpredictable names.

_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO: refused, never waited on
_MAX_LINKS = 40  # as the kernel's own limit (ELOOP)


class LinkRefused(OSError):
    """A write met a symbolic link it will not follow: at the file's own name, or a
    directory on the way that another user's link replaces. Its errno is ELOOP and its
    message one line naming the link and its owner."""

    def __init__(self, link: str | os.PathLike[str], why: str) -> None:
        super().__init__(errno.ELOOP, why, str(link))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _trusted(link: os.stat_result, folder: os.stat_result) -> bool:
    # As the kernel's protected_symlinks: a link of this user, of root, or of the owner of
    # the folder it lies in (who could replace anything there anyway).
    return link.st_uid in (os.geteuid(), 0, folder.st_uid)


def open_dir(path: str | os.PathLike[str]) -> int:
    """An O_PATH descriptor of the directory `path`, for the *at() calls of a write.

    Each component is opened from the one before with O_NOFOLLOW: a symbolic link on the way
    is followed (its target walked the same way) only when it belongs to this user, root or
    the owner of the folder it lies in; another user's raises LinkRefused. The descriptor
    pins the directory: renaming a folder on the way afterwards redirects nothing.
    """
    where = Path(path).absolute()
    todo = list(reversed(where.parts[1:]))
    fd = os.open("/", _PATH_FLAGS)
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            try:
                new = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise
                links += 1
                if links > _MAX_LINKS or not _trusted(st, os.fstat(fd)):
                    raise LinkRefused(
                        where,
                        f"a folder on the way is a symbolic link of {user_name(st.st_uid)} "
                        f"({name} -> {os.readlink(name, dir_fd=fd)}): refused, a write never "
                        "follows another user's link; remove the link",
                    ) from None
                target = Path(os.readlink(name, dir_fd=fd))
                if target.is_absolute():
                    os.close(fd)
                    fd = os.open("/", _PATH_FLAGS)
                todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
                continue
            os.close(fd)
            fd = new
    except LinkRefused:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise OSError(exc.errno, exc.strerror, str(where)) from None
    return fd


def _open_at(folder: int, path: Path, flags: int, mode: int = 0o644) -> int:
    """open(2) of `path`'s name in `folder` with O_NOFOLLOW; a link there raises LinkRefused."""
    try:
        return os.open(path.name, flags | _FILE_FLAGS, mode, dir_fd=folder)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        st = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
        raise LinkRefused(
            path,
            f"is a symbolic link of {user_name(st.st_uid)} "
            f"(-> {os.readlink(path.name, dir_fd=folder)}): refused, a write never follows "
            "a link out of the run directory; remove the link",
        ) from None


def _in_place(folder: int, path: Path, flags: int) -> int:
    """A descriptor to write the existing or new regular file `path` in place (appends, the
    reserve): not a FIFO, device or directory, and not a hard link to a file elsewhere."""
    fd = _open_at(folder, path, os.O_WRONLY | os.O_CREAT | flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = next((n for test, n in _KINDS if test(st.st_mode)), "a file with other names")
        raise LinkRefused(path, f"is {kind}, not a file of the run: refused; remove it")
    os.set_blocking(fd, True)
    return fd


def temp_path(path: Path, tag: str = "") -> Path:
    """A hidden temporary name next to `path` that nobody can predict.

    `.<name>.<tag><pid>.<16 hex>.tmp`: 64 random bits; the pid says whose it is (a writer
    removes those of processes that are gone).
    """
    return path.with_name(f".{path.name}.{tag}{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_new(path: Path, data: bytes | Iterable[bytes], sync: bool = True) -> None:
    """Create `path` (it must not exist: O_EXCL, so no link either) holding `data` (or its
    chunks, in order).

    The name is not published anywhere else: this writes the temporary files of the
    functions below. `sync`: fsync it.
    """
    folder = open_dir(path.parent)
    try:
        fd = _open_at(folder, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    finally:
        os.close(folder)
    try:
        for chunk in [data] if isinstance(data, bytes) else data:
            _write_fd(fd, chunk)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    tmp: Path, path: Path, before_rename: Callable[[], None] | None = None, sync: bool = True
) -> None:
    """Rename the complete file `tmp` over `path` durably.

    The steps: fsync its data, `before_rename`, rename, fsync the directory. On any failure
    `tmp` is removed and `path` is untouched. A rename replaces a link at `path`, never
    follows it.
    """
    src = dst = -1
    try:
        src = open_dir(tmp.parent)
        dst = src if tmp.parent == path.parent else open_dir(path.parent)
        if sync:
            fd = _open_at(src, tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if before_rename is not None:
            before_rename()
        os.replace(tmp.name, path.name, src_dir_fd=src, dst_dir_fd=dst)
        if sync:
            _fsync_folder(dst)
    except BaseException:
        with contextlib.suppress(OSError):
            if src >= 0:
                os.unlink(tmp.name, dir_fd=src)
            else:
                tmp.unlink()
        raise
    finally:
        for fd in {src, dst} - {-1}:
            os.close(fd)


def write_atomic(
    path: Path, data: bytes, before_rename: Callable[[], None] | None = None, sync: bool = True
) -> None:
    """Replace `path` with `data` so that readers see the old file or the whole new one.

    `sync=False` (a heartbeat: liveness only) skips the fsyncs.
    """
    tmp = temp_path(path)
    try:
        write_new(tmp, data, sync)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    publish(tmp, path, before_rename, sync)


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
    folder = open_dir(path.parent)
    try:
        try:
            os.link(tmp.name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            won = True
        except FileExistsError:
            won = os.stat(tmp.name, dir_fd=folder, follow_symlinks=False).st_nlink == 2
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name, dir_fd=folder)
        if won:
            _fsync_folder(folder)
    finally:
        os.close(folder)
    return won


def append(path: Path, data: bytes) -> None:
    """Append `data` to the file `path` (made if missing), never through a link."""
    with open_append(path, text=False) as f:
        f.write(data)


@overload
def open_append(path: Path, text: Literal[True] = ...) -> TextIO: ...
@overload
def open_append(path: Path, text: Literal[False]) -> BinaryIO: ...
def open_append(path: Path, text: bool = True) -> TextIO | BinaryIO:
    """Open the file `path` (made if missing) to append to, never through a link.

    Text is line-buffered (a rank's log: every line reaches the file as it is written).
    """
    folder = open_dir(path.parent)
    try:
        fd = _in_place(folder, path, os.O_APPEND)
    finally:
        os.close(folder)
    if text:
        return open(fd, "a", buffering=1, encoding="utf-8", errors="replace", closefd=True)
    return open(fd, "ab", closefd=True)


def reserve(path: Path, size: int) -> None:
    """Make `path` a file of at least `size` bytes (zeros), fsynced: space set aside.

    An existing file is grown, never followed (a link), never truncated.
    """
    folder = open_dir(path.parent)
    try:
        fd = _in_place(folder, path, 0)
    finally:
        os.close(folder)
    try:
        have = os.fstat(fd).st_size
        if have < size:
            os.pwrite(fd, b"\0" * (size - have), have)
            os.fsync(fd)
    finally:
        os.close(fd)

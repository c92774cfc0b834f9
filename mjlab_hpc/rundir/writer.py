"""The one process that writes a run directory's shared files.

It also runs the side effects that must happen once per run (`once`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.procs import alive, machine_id
from mjlab_hpc.rundir.checkpoint import save_checkpoint
from mjlab_hpc.rundir.durable import LinkRefused, append, open_regular, reserve
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.lock import LeaseLock, LockError, OwnerInfo, write_fenced
from mjlab_hpc.rundir.progress import parse_progress
from mjlab_hpc.rundir.record import RunRecord
from mjlab_hpc.rundir.typed import LINE_LIMIT, Unread, read_json

__all__ = ["RESERVE_BYTES", "RunWriter", "busy_problem", "once"]

log = logging.getLogger("mjlab_hpc")

# durable.temp_path's names: `.<name>.<tag><pid>.<16 hex>.tmp` (8 hex before: older runs).
_TEMP = re.compile(r"(\d+)\.(?:[0-9a-f]{8}){1,2}\.tmp$")
#: Disk space the writer keeps for a run's last records (run.json and friends).
RESERVE_BYTES = 1 << 20


def busy_problem(run: RunDir) -> str | None:
    """Return why no training may start writing `run` now (None: it may).

    Another live training writes it. Asked before any rank starts, and again by rank 0
    before it takes the lock.
    """
    if (busy := _live_writer(run)) is None:
        return None
    return (
        f"another training is writing {run.path} ({busy}): wait for it to end (mjlab-hpc "
        "status), stop it, or start a new run"
    )


def _live_writer(run: RunDir) -> str | None:
    """Describe who writes `run` now, when that is a live process other than this one.

    None: nobody, or a writer that is gone or may be (a crashed one, which a new writer waits
    out). `LeaseLock.live_holder` judges, without comparing clocks.
    """
    try:
        holder = LeaseLock(run.writer_lock).live_holder()
    except LockError:
        return None
    if holder is None or holder.owner is None:
        return None
    me = holder.owner.machine == machine_id()
    return None if me and holder.owner.pid == os.getpid() else holder.describe()


class RunWriter:
    """The one process that writes a run directory's shared files.

    It holds the run's lease lock (`<run>/.writer.lock`) from start to end; every file it
    publishes is fenced by the lock's token, so a former writer that wakes up after another
    process took over (a frozen node, a stale restart) cannot overwrite anything.
    """

    def __init__(self, run: RunDir, lock: LeaseLock) -> None:
        self.run = run
        self.lock = lock

    @classmethod
    def acquire(
        cls, run: RunDir, rank: int, lease_s: float = 30.0, timeout_s: float | None = None
    ) -> RunWriter:
        """Become the writer of `run`, waiting at most `timeout_s`.

        By default it waits about one and a half leases, so that a crashed previous writer's
        lock can expire.
        """
        lock = LeaseLock(run.writer_lock, owner=OwnerInfo.from_env(rank), lease_s=lease_s)
        lock.acquire(timeout_s=lease_s * 1.5 + 5.0 if timeout_s is None else timeout_s)
        writer = cls(run, lock)
        writer._reserve()
        writer._remove_stale_temps()
        return writer

    def _remove_stale_temps(self) -> None:
        # Temporary files of a process killed mid-write (a checkpoint or its sidecar): only
        # the writer publishes here, and the one that made them is gone.
        for path in self.run.path.glob(".*.tmp"):
            m = _TEMP.search(path.name)
            if m and not alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    path.unlink()

    def _reserve(self) -> None:
        # Space set aside while the disk has it, so that the run's last records (failed,
        # stopped) can still be written when the disk fills up during training.
        # A link planted in its place is refused, and said (the run goes on without it).
        try:
            reserve(self.run.writer_reserve, RESERVE_BYTES)
        except LinkRefused as exc:
            log.warning("no space reserved for the run's last records: %s", exc)
        except OSError:
            pass  # a full disk already: nothing to set aside

    def last_records(self, write: Callable[[], None]) -> None:
        """Write the run's last records (`write`), even on a full disk.

        On a full disk the writer gives up its reserved space and tries once more.
        """
        try:
            write()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.run.writer_reserve.unlink(missing_ok=True)
            write()

    def check(self) -> None:
        """Raise LockLost if another process has taken over."""
        self.lock.check()

    def write_text(self, path: Path, text: str) -> None:
        """Publish a whole file (temporary file, fence check, rename)."""
        write_fenced(self.lock, path, text.encode())

    def write_json(self, path: Path, data: Any) -> None:
        """Publish a JSON file (indented, keys sorted)."""
        self.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

    def cut_progress(self, iteration: int) -> int | None:
        """Cut progress.jsonl back to `iteration`, the checkpoint a start resumes from.

        Later iterations, a torn last line and lines that are no record of ours go. The file
        is streamed twice (looked at, then copied if anything goes), never held whole.
        Returns the last iteration it held (None: none). One that is no file of the run (a
        FIFO, a link out of it) is begun anew.
        """
        path, last, cut = self.run.progress, None, False
        try:
            for line, at in _progress_lines(self.run):
                last = at if at is not None else last
                cut = cut or at is None or at > iteration or not line.endswith(b"\n")
        except FileNotFoundError:
            return None
        except ValueError as exc:
            log.warning("%s: begun anew", exc)
            self.write_text(path, "")
            return None
        if cut:
            kept = (
                line.rstrip(b"\n") + b"\n"
                for line, at in _progress_lines(self.run)
                if at is not None and at <= iteration
            )
            write_fenced(self.lock, path, kept)
        return last

    def write_record(self, record: RunRecord) -> None:
        """Publish the run record (run.json)."""
        self.write_json(self.run.record, record.to_json())

    def append_line(self, path: Path, line: str) -> None:
        """Append one line to a log-like file (progress.jsonl, restarts.jsonl)."""
        self.check()
        append(path, (line.rstrip("\n") + "\n").encode())

    def save_checkpoint(
        self, path: Path, state: dict[str, Any], header: dict[str, Any] | None = None
    ) -> None:
        """Save a checkpoint atomically, fenced just before the rename.

        `header` says what it belongs to, for its sidecar.
        """
        save_checkpoint(path, state, before_rename=self.check, header=header)

    def release(self) -> None:
        """Give the run up (the lock is left for a successor to take at once)."""
        with contextlib.suppress(OSError):
            self.run.writer_reserve.unlink(missing_ok=True)
        with contextlib.suppress(LockError):  # lost already: nothing of ours to release
            self.lock.release()


def _progress_lines(run: RunDir) -> Iterator[tuple[bytes, int | None]]:
    """Each line of progress.jsonl and the iteration it records (None: no record of ours).

    A line longer than any record comes in pieces, none of them a record.
    """
    with open_regular(run.progress, None, run.path) as f:
        while line := f.readline(LINE_LIMIT):
            record = parse_progress(line) if len(line) < LINE_LIMIT else None
            yield line, record.iteration if record is not None else None


def once(
    run: RunDir,
    name: str,
    writer: RunWriter | None,
    fn: Callable[[], Any],
    timeout_s: float = 3600.0,
    poll_s: float = 0.2,
) -> Any:
    """Run a side effect that must happen once per run, on the writer only.

    An artifact download or a video is one. Every other rank waits for its result, and so
    does every restart.

    The writer publishes `{"result": ...}` (JSON-able) or `{"error": ...}` as
    `<run>/.once/<name>.json`, fenced by its lock; the others raise the writer's error instead
    of waiting for the timeout.
    """
    marker = run.once_marker(name)
    if writer is not None:
        if marker.exists():  # done by an earlier start of this run
            return _once_result(marker, name)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = fn()
        except Exception as exc:
            writer.write_json(marker, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        writer.write_json(marker, {"result": result})
        return result
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for the writer to finish {name!r}")
        time.sleep(poll_s)
    return _once_result(marker, name)


@dataclass(frozen=True)
class _Once:
    """`.once/<name>.json`: what the writer's side effect gave."""

    result: Any = None
    """Its result (JSON-able)."""
    error: str | None = None
    """Or its error."""


def _once_result(marker: Path, name: str) -> Any:
    try:
        done = read_json(_Once, marker, marker.parent.parent)
    except Unread as exc:
        raise RuntimeError(f"the writer's {name!r}: {exc}") from None
    if done.error is not None:
        raise RuntimeError(f"the writer's {name!r} failed: {done.error}")
    return done.result

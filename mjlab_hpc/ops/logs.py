"""`mjlab-hpc logs`: the per-rank logs of a run, the first traceback across all ranks first.

Every rank writes `logs/rank<k>.log` (the node of each of its starts is in its start
records: `rundir.ends`), and submitit captures each task's stdout and stderr in
`submitit/<job>_<k>_log.out/.err`, where an uncaught exception's traceback lands. The first
traceback in time is usually the cause; the others (peers that lost their connection to the
failed rank) are consequences, as their ranks' end records say (`rundir.ends`): at the same
moment a consequence's traceback comes after the cause's.

A file is read only as a regular file in its run (or its sweep's submitit folder), at most
its last `LOG_LIMIT`: a FIFO, a device or a link out is named and skipped.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from mjlab_hpc.console import inert
from mjlab_hpc.ops.runs import run_jobs
from mjlab_hpc.rundir.durable import LOG_LIMIT, open_regular, read_tail
from mjlab_hpc.rundir.ends import rank_starts, read_end
from mjlab_hpc.rundir.layout import LOGS_DIR, RunDir

__all__ = [
    "RankFiles",
    "Traceback",
    "find_tracebacks",
    "follow",
    "rank_files",
    "rank_host",
    "tail",
    "tracebacks_in",
    "unreadable",
]

Stream = Literal["log", "out", "err"]
TRACEBACK_START = "Traceback (most recent call last):"
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3})")
# Lines that start a new record: a traceback ends at the first of them.
_RECORD = re.compile(
    r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3} |submitit [A-Z]+ \(|srun: |slurmstepd|"
    r"Warp |\[train\] )"
)
_RANK_LOG = re.compile(r"^rank(\d+)\.log$")
_TASK_FILE = re.compile(r"^(?P<job>\d+(?:_\d+)?)_(?P<rank>\d+)_log\.(?P<ext>out|err)$")


@dataclass(frozen=True)
class RankFiles:
    """The files one rank wrote: its own log and its task output (per job of the run)."""

    rank: int
    log: Path | None
    outs: tuple[Path, ...]
    """Task stdout of each of the run's jobs, oldest job first."""
    errs: tuple[Path, ...]
    starts: tuple[tuple[dt.datetime, str], ...] = ()
    """When each start of the rank began and its node, oldest first (its start records)."""
    peer_lost: tuple[bool, ...] = ()
    """For each start: whether it ended because another rank went away (its end record)."""

    def stream(self, which: Stream) -> Path | None:
        """The file of one stream (the current job's task output for out/err)."""
        if which == "log":
            return self.log
        files = self.outs if which == "out" else self.errs
        return files[-1] if files else None


@dataclass(frozen=True)
class Traceback:
    """A traceback found in a rank's log or task stderr."""

    rank: int
    host: str | None
    source: Path
    at: dt.datetime | None
    """Time of the last log record before it (None: the file had none)."""
    text: str

    @property
    def last_line(self) -> str:
        lines = [line for line in self.text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def where(self) -> str:
        when = (
            f" at {self.at:%Y-%m-%d %H:%M:%S}.{self.at.microsecond // 1000:03d}" if self.at else ""
        )
        return f"rank {self.rank} on {self.host or 'unknown host'}{when}"


def rank_files(run_dir: Path, unread: list[str] | None = None) -> list[RankFiles]:
    """Every rank's files, by rank (ranks known from rank logs or task output).

    A damaged start or end record is named in `unread` and left out.
    """
    jobs = run_jobs(run_dir)
    order = {job: i for i, job in enumerate(jobs.job_ids)}
    logs: dict[int, Path] = {}
    logs_dir = run_dir / LOGS_DIR
    if logs_dir.is_dir():
        for entry in logs_dir.iterdir():
            m = _RANK_LOG.match(entry.name)
            if m:
                logs[int(m.group(1))] = entry
    task: dict[int, dict[str, list[tuple[int, Path]]]] = {}
    folder = RunDir(run_dir).task_folder()
    if folder is not None:
        for entry in folder.iterdir():
            m = _TASK_FILE.match(entry.name)
            # A sweep's folder is shared: only this element's job files belong to the run.
            if not m or (order and m.group("job") not in order):
                continue
            per = task.setdefault(int(m.group("rank")), {"out": [], "err": []})
            per[m.group("ext")].append((order.get(m.group("job"), 0), entry))
    out = []
    for rank in sorted(set(logs) | set(task)):
        files = task.get(rank, {"out": [], "err": []})
        starts = rank_starts(run_dir, rank, unread)
        ends = [read_end(run_dir, s, unread) for s in starts]
        out.append(
            RankFiles(
                rank=rank,
                log=logs.get(rank),
                outs=tuple(p for _, p in sorted(files["out"])),
                errs=tuple(p for _, p in sorted(files["err"])),
                starts=tuple((dt.datetime.fromtimestamp(s.at), s.node) for s in starts),
                peer_lost=tuple(e is not None and e.failure == "peer-lost" for e in ends),
            )
        )
    return out


def _stamp(line: str) -> dt.datetime | None:
    m = _STAMP.search(line)
    if not m:
        return None
    try:
        when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return when.replace(microsecond=int(m.group(2)) * 1000)


def _within(path: Path) -> Path:
    """The folder a rank's file may not lead out of: its run (or its sweep, whose submitit
    folder a sweep element's run links to)."""
    return path.parent.parent


def _read_lines(path: Path) -> list[str]:
    try:
        return read_tail(path, LOG_LIMIT, _within(path)).decode(errors="replace").splitlines()
    except (OSError, ValueError):
        return []


def unreadable(path: Path) -> str | None:
    """Why a rank's file is not read (a FIFO, a device, a link out of the run); None: it is."""
    try:
        with open_regular(path, None, _within(path)):
            return None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return str(exc)


def tracebacks_in(path: Path) -> list[tuple[dt.datetime | None, str]]:
    """The tracebacks of one file, each with the time of the log record before it.

    A traceback runs from its `Traceback (most recent call last):` line to the next log
    record (a timestamped line, submitit's or Slurm's own lines) or the end of the file;
    chained exceptions stay in one block.
    """
    lines = _read_lines(path)
    found = []
    last: dt.datetime | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line[:1].isspace():
            last = _stamp(line) or last
        if line.startswith(TRACEBACK_START):
            j = i + 1
            while j < len(lines) and not _RECORD.match(lines[j]):
                j += 1
            block = lines[i:j]
            while block and not block[-1].strip():
                block.pop()
            found.append((last, "\n".join(block)))
            i = j
            continue
        i += 1
    return found


def _start_at(files: RankFiles, at: dt.datetime | None) -> int | None:
    """Which start of the rank ran at time `at`: its latest before it (else its first)."""
    if not files.starts:
        return None
    before = [i for i, (t, _) in enumerate(files.starts) if at is None or t <= at]
    return before[-1] if before else 0


def rank_host(files: RankFiles, at: dt.datetime | None = None) -> str | None:
    """Return the node the rank ran on at time `at` (a requeued rank may move).

    It is the node of its latest start before `at` (its start records). None before the rank
    has started.
    """
    start = _start_at(files, at)
    return files.starts[start][1] if start is not None else None


def _consequence(files: RankFiles, at: dt.datetime | None) -> bool:
    """Whether the rank's start at time `at` ended because another rank went away."""
    start = _start_at(files, at)
    return start is not None and start < len(files.peer_lost) and files.peer_lost[start]


def find_tracebacks(ranks: Sequence[RankFiles]) -> list[Traceback]:
    """Return every rank's tracebacks, earliest first.

    A traceback that the rank log and its task stderr both hold is kept once: the log's copy,
    which has the earlier time.
    """
    found: list[tuple[Traceback, bool]] = []
    seen: set[tuple[int, str]] = set()
    for files in ranks:
        for path in [p for p in (files.log, *files.errs) if p is not None]:
            for at, text in tracebacks_in(path):
                when = at or _mtime(path)
                tb = Traceback(
                    rank=files.rank,
                    host=rank_host(files, when),
                    source=path,
                    at=when,
                    text=text,
                )
                if (files.rank, tb.last_line) in seen:
                    continue
                seen.add((files.rank, tb.last_line))
                found.append((tb, _consequence(files, when)))
    found.sort(key=lambda pair: (pair[0].at or dt.datetime.max, pair[1], pair[0].rank))
    return [tb for tb, _ in found]


def _mtime(path: Path) -> dt.datetime | None:
    try:
        return dt.datetime.fromtimestamp(path.stat().st_mtime)
    except OSError:
        return None


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a file (all of it for 0)."""
    text = _read_lines(path)
    return "\n".join(text[-lines:] if lines > 0 else text)


def follow(
    files: Callable[[], dict[str, Path]],
    active: Callable[[], bool],
    out: TextIO,
    poll_s: float = 0.5,
    start_at_end: bool = True,
    news: Callable[[], list[str]] | None = None,
) -> None:
    """Print what is appended to the files that `files()` names until `active()` is false.

    `files()` maps a prefix to a path and is asked again every poll, so files that appear
    later are followed too; every file is drained at the end. Lines get their prefix when
    there are several files. `news()`: lines to print as they come (the run's faults and
    stops, healed or not).
    """
    positions: dict[Path, int] = {}
    if start_at_end:
        for path in files().values():
            positions[path] = path.stat().st_size if path.exists() else 0
    partial: dict[Path, bytes] = {}
    skipped: set[Path] = set()
    while True:
        running = active()
        current = files()
        for line in news() if news is not None else []:
            out.write(f"{inert(line)}\n")
        for prefix, path in current.items():
            if path in skipped or not path.exists():
                continue
            try:
                with open_regular(path, None, _within(path)) as f:
                    f.seek(positions.get(path, 0))
                    chunk = f.read(LOG_LIMIT)
                    positions[path] = f.tell()
            except ValueError as exc:  # a FIFO, a device, a link out: named once
                skipped.add(path)
                out.write(f"{prefix}{inert(exc)}: skipped\n")
                continue
            except OSError:
                continue
            if not chunk:
                continue
            data = partial.pop(path, b"") + chunk
            complete, _, rest = data.rpartition(b"\n")
            if rest:
                partial[path] = rest  # print whole lines only, so prefixes stay aligned
            for line in complete.decode(errors="replace").splitlines() if complete else []:
                out.write(f"{prefix}{inert(line)}\n" if len(current) > 1 else f"{inert(line)}\n")
            out.flush()
        if not running:
            for rest in partial.values():
                out.write(inert(rest.decode(errors="replace")) + "\n")
            out.flush()
            return
        time.sleep(poll_s)

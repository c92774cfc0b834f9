"""A run's JSON files and JSON lines, read and written as typed values.

Each file of a run directory has one frozen dataclass and one reader and writer in its home
module (run.json: `record`, the rank records: `ends`, progress.jsonl and checkpoints.jsonl:
`progress`, cancelled.json: `state`, the sweep records: `layout`). They all read through
here: a file is read only as a regular file inside its run (`durable.read_regular`), and every
value is checked by the one converter (`mjlab_hpc.convert`: type, finite, in range). A file
or line that does not fit is named (`Unread`) and left out, so one forged or torn record of a
teammate's run never takes down a command that reads a whole log root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from mjlab_hpc.convert import Mismatch, load, parse_json
from mjlab_hpc.rundir.durable import RECORD_LIMIT, read_regular, read_tail

__all__ = [
    "LINE_LIMIT",
    "Lines",
    "Unread",
    "parse_line",
    "plain",
    "read_json",
    "read_lines",
    "read_optional",
]

T = TypeVar("T")

#: The most one JSON line of ours holds (a progress line is about 300 bytes): a longer one is
#: no record, and is not parsed.
LINE_LIMIT = 64 << 10
# The most a JSON-lines file is read whole (progress.jsonl of a very long run).
_LINES_LIMIT = 1 << 30


class Unread(ValueError):
    """A file (or a line of one) of a run that was not read: the message names it and why."""


def _name(path: Path, within: Path | None) -> str:
    """The file as people find it: its path inside the run, else its name."""
    if within is not None:
        try:
            return str(path.relative_to(within))
        except ValueError:
            pass
    return path.name


def _damaged(name: str, problem: str) -> Unread:
    return Unread(f"{name} is damaged ({problem})")


def read_json(cls: type[T], path: Path, within: Path | None = None, limit: int = RECORD_LIMIT) -> T:
    """Read the JSON file `path` as a `cls`.

    FileNotFoundError when there is none; Unread naming it for anything else (a FIFO, a link
    out of `within`, not JSON, a value that does not fit).
    """
    name = _name(path, within)
    try:
        data = read_regular(path, limit, within)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        why = str(exc).removeprefix(f"{path.name} ")
        raise Unread(f"{name} {why}" if why != str(exc) else f"{name}: {why}") from None
    return parse_line(cls, data, name)


def read_optional(
    cls: type[T],
    path: Path,
    within: Path | None = None,
    unread: list[str] | None = None,
    limit: int = RECORD_LIMIT,
) -> T | None:
    """`read_json`, None where there is no file, or where it is damaged: then named in
    `unread`."""
    try:
        return read_json(cls, path, within, limit)
    except FileNotFoundError:
        return None
    except Unread as exc:
        if unread is not None:
            unread.append(str(exc))
        return None


def parse_line(cls: type[T], data: bytes, name: str) -> T:
    """Parse one JSON text (a file's, a line's) as a `cls`; Unread naming it (`name`) if not."""
    try:
        value = parse_json(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _damaged(name, "it is not JSON") from None
    try:
        return load(cls, value, "record")  # type: ignore[no-any-return]
    except Mismatch as exc:
        raise _damaged(name, str(exc).replace("'record.", "'", 1)) from None


@dataclass(frozen=True)
class Lines(Generic[T]):
    """The lines of a JSON-lines file that were read, and those that were not."""

    values: tuple[T, ...] = ()
    """Every line that fits, in order."""
    unread: tuple[str, ...] = ()
    """The file, or each line left out, and why."""


def read_lines(
    cls: type[T], path: Path, within: Path | None = None, last: int | None = None
) -> Lines[T]:
    """Read the JSON lines of `path` as `cls` (`last`: only about the last so many lines).

    A missing file has none. A torn last line (a writer in mid-append) is skipped without a
    word; any other line that is not JSON or does not fit, or is longer than any record
    (`LINE_LIMIT`), is left out and named.
    """
    name = _name(path, within)
    try:
        if last is None:
            data = read_regular(path, _LINES_LIMIT, within)
        else:  # from the end: a long run's file is never read whole for its last lines
            data = read_tail(path, 1024 * (last + 1), within if within is not None else path.parent)
    except FileNotFoundError:
        return Lines()
    except (OSError, ValueError) as exc:
        why = str(exc).removeprefix(f"{path.name} ")
        return Lines(unread=(f"{name} {why}" if why != str(exc) else f"{name}: {why}",))
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # after the last newline: empty, or in mid-append
    values: list[T] = []
    unread: list[str] = []
    first = 1 if last is None else None
    for i, line in enumerate(lines):
        where = f"{name} line {first + i}" if first is not None else f"a line of {name}"
        if not line.strip():
            continue
        if len(line) > LINE_LIMIT:
            unread.append(f"{where} holds {len(line):,} bytes, more than a record ({LINE_LIMIT:,})")
            continue
        try:
            values.append(parse_line(cls, line, where))
        except Unread as exc:
            unread.append(str(exc))
    if torn.strip():  # a last line without its newline: complete, or torn (said nothing of)
        with contextlib.suppress(Unread):
            values.append(parse_line(cls, torn, name))
    if last is not None:
        values = values[-last:]
    return Lines(tuple(values), tuple(unread))


def plain(value: Any) -> Any:
    """A typed value as plain JSON data: dataclasses as objects, tuples as lists, enums and
    paths as their values (what `read_json` reads back)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value

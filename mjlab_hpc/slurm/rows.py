"""Slurm's table output read by its header: the one reader of squeue, sacct, sinfo, sacctmgr.

Every command runs with its header on and `|` between fields (`--parsable2`, or `-o` with
`|`), and each row is keyed by the header's names, so a column Slurm adds, drops or moves
between versions is found or missed by name, never read as its neighbour. Every value is
checked as it is read (a job id is a job id, a count is a whole number in range, a time is
a real date): a row that does not fit is named and left out, the other rows are read.
`--json` would do the keying too, but its schema differs between the versions we support
(22.05: openapi v0.0.38, 24.11: v0.0.42), while this text is the same in both.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from mjlab_hpc.slurm.units import slurm_seconds

__all__ = [
    "BadValue",
    "count",
    "cpu_seconds",
    "epoch",
    "job_id",
    "read_rows",
    "rss_bytes",
    "state",
    "text",
]

T = TypeVar("T")

# Bounds of what one Slurm value may be: far past any real cluster, short of an overflow.
_MAX_COUNT = 10**9
_MAX_SECONDS = 100 * 365 * 86400
_EARLIEST = dt.datetime(2000, 1, 1).timestamp()
_LATEST = dt.datetime(2200, 1, 1).timestamp()
_JOB_ID = re.compile(r"\d+(?:_(?:\d+|\[[\d,%-]+\]))?(?:\+\d+)?(?:\.[\w-]+)?", re.ASCII)
_STATE = re.compile(r"[A-Z_]+", re.ASCII)
_RSS = re.compile(r"(\d+(?:\.\d+)?)([KMGTP]?)", re.ASCII)
_NONE = ("", "None", "Unknown", "N/A", "(null)")


class BadValue(ValueError):
    """A value of a Slurm row that is not what its column holds."""


def count(value: str, column: str, high: int = _MAX_COUNT) -> int | None:
    """A whole number 0..high (None: empty, `N/A`)."""
    value = value.strip()
    if value in _NONE:
        return None
    if not value.isascii() or not value.isdigit() or int(value) > high:
        raise BadValue(f"{column} {value[:40]!r} is not a whole number 0-{high}")
    return int(value)


def epoch(value: str, column: str) -> float | None:
    """sacct's local time (`2026-11-28T17:50:01`) in epoch seconds (None: `Unknown`, `None`)."""
    value = value.strip()
    if value in _NONE:
        return None
    try:
        at = dt.datetime.fromisoformat(value).timestamp()
    except (ValueError, OverflowError, OSError):
        raise BadValue(f"{column} {value[:40]!r} is not a time") from None
    if not _EARLIEST <= at <= _LATEST:
        raise BadValue(f"{column} {value[:40]!r} is not a time a job can have")
    return at


def cpu_seconds(value: str, column: str) -> float | None:
    """A duration (`[D-][HH:]MM:SS[.mmm]`) in seconds (None: empty)."""
    value = value.strip()
    if value in _NONE:
        return None
    whole, _, fraction = value.partition(".")
    seconds = slurm_seconds(whole) if whole else None
    if seconds is None or seconds > _MAX_SECONDS or (fraction and not fraction.isdigit()):
        raise BadValue(f"{column} {value[:40]!r} is not a duration")
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def rss_bytes(value: str, column: str) -> int | None:
    """A size (`123456K`, `12M`, `0`) in bytes (None: empty)."""
    value = value.strip()
    if value in _NONE:
        return None
    m = _RSS.fullmatch(value)
    size = float(m.group(1)) * 1024 ** "_KMGTP".index(m.group(2) or "_") if m else math.inf
    if not size < 2**60:
        raise BadValue(f"{column} {value[:40]!r} is not a size")
    return int(size)


def job_id(value: str, column: str) -> str:
    """A job id: `4711`, `4711_2`, `4711_[0-3%2]`, `4711+1`, `4711.batch`."""
    if not _JOB_ID.fullmatch(value.strip()):
        raise BadValue(f"{column} {value[:40]!r} is not a job id")
    return value.strip()


def state(value: str, column: str) -> str:
    """A job or node state's first word (`CANCELLED by 0` -> CANCELLED)."""
    first = value.split(" ", 1)[0].strip()
    if not _STATE.fullmatch(first):
        raise BadValue(f"{column} {value[:40]!r} is not a state")
    return first


def text(value: str, column: str) -> str:
    """A name, node list or reason: printable text (`N/A`, `None`, `(null)` read as "")."""
    value = value.strip()
    if not value.isprintable() or len(value) > 4096:
        raise BadValue(f"{column} {value[:40]!r} is not printable text")
    return "" if value in _NONE else value


def read_rows(
    command: str,
    output: str,
    columns: Sequence[str],
    make: Callable[[Mapping[str, str]], T],
    bad: list[str],
) -> list[T]:
    """Read a Slurm table: its first line names the columns, each later line is a row.

    `columns` are the header's names the caller needs (a name printed twice, as squeue's
    `JOBID` for `%i` and `%A`, is asked twice: the second is keyed `JOBID#2`).
    `make` builds the caller's value from a row keyed by those names and raises BadValue (or
    ValueError) for a value that does not fit: that row is named in `bad` and left out. A
    header that lacks a column leaves every row out, named once.
    """
    lines = output.splitlines()
    if not lines:
        return []
    header = [name.strip().upper() for name in lines[0].split("|")]
    places: dict[str, int] = {}
    for name in columns:
        found = [i for i, h in enumerate(header) if h == name.upper() and i not in places.values()]
        if not found:
            bad.append(f"{command}: no column {name} in its header {lines[0][:200]!r}")
            return []
        asked = sum(1 for key in places if key.partition("#")[0] == name)
        places[f"{name}#{asked + 1}" if asked else name] = found[0]
    out = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("|")
        try:
            if len(fields) != len(header):
                raise BadValue(f"{len(fields)} fields, the header has {len(header)}")
            out.append(make({name: fields[i] for name, i in places.items()}))
        except ValueError as e:
            bad.append(f"{command}: line {number} {line[:120]!r} left out: {e}")
    return out

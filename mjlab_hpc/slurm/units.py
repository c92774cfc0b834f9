"""Slurm's own notations for time limits and memory sizes."""

from __future__ import annotations

import math
import re

from mjlab_hpc.errors import SpecError

__all__ = ["MAX_DAYS", "check_mem", "mem_bytes", "slurm_seconds", "slurm_time_minutes"]

# Whole-string matches of ASCII digits only: the value is written into an #SBATCH line as
# given, so a trailing newline or another script's digits must not pass.
_TIME_FORMATS = tuple(
    (re.compile(pattern, re.ASCII), units)
    for pattern, units in (
        (r"(\d+)", ("m",)),
        (r"(\d+):(\d{1,2})", ("m", "s")),
        (r"(\d+):(\d{1,2}):(\d{1,2})", ("h", "m", "s")),
        (r"(\d+)-(\d+)", ("d", "h")),
        (r"(\d+)-(\d+):(\d{1,2})", ("d", "h", "m")),
        (r"(\d+)-(\d+):(\d{1,2}):(\d{1,2})", ("d", "h", "m", "s")),
    )
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# The largest value of a field that follows a larger unit (hours after days, ...).
_FIELD_MAX = {"h": 23, "m": 59, "s": 59}
# Longer limits are surely typos (Slurm itself caps MaxTime per partition).
MAX_DAYS = 365
_MEM = re.compile(r"(\d+)([KMGT]?)B?", re.IGNORECASE | re.ASCII)


def slurm_time_minutes(value: str, flag: str = "--time") -> int:
    """Return the minutes of a Slurm time limit, rounded up to whole minutes as Slurm does.

    The forms are `30`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM` and `D-HH:MM:SS`; anything
    else raises SpecError naming `flag`.
    """
    for pattern, units in _TIME_FORMATS:
        m = pattern.fullmatch(value)
        if m:
            fields = list(zip(units, (int(g) for g in m.groups()), strict=True))
            for unit, number in fields[1:]:  # the first field may exceed its unit
                if number > _FIELD_MAX[unit]:
                    raise SpecError(
                        flag,
                        f"{value!r}: {number} is not a valid number of "
                        f"{ {'h': 'hours', 'm': 'minutes', 's': 'seconds'}[unit] } "
                        f"(at most {_FIELD_MAX[unit]} there)",
                    )
            seconds = sum(number * _SECONDS[unit] for unit, number in fields)
            if seconds <= 0:
                break
            if seconds > MAX_DAYS * 86400:
                raise SpecError(
                    flag, f"{value!r} is more than {MAX_DAYS} days; give the limit you mean"
                )
            return math.ceil(seconds / 60)
    raise SpecError(
        flag,
        f"{value!r} is not a Slurm time limit; use minutes (90), HH:MM:SS (12:00:00) "
        "or D-HH:MM:SS (1-00:00:00)",
    )


def check_mem(value: str, flag: str = "--mem") -> str:
    """Check a Slurm memory size (`64G`, `500M`, `1024`) and return it as given.

    Anything else raises SpecError naming `flag`.
    """
    if not _MEM.fullmatch(value):
        raise SpecError(flag, f"{value!r} is not a Slurm memory size (e.g. 64G, 500M)")
    return value


def mem_bytes(value: str) -> int:
    """Bytes of a Slurm memory size (checked by `check_mem`): megabytes without a unit."""
    m = _MEM.fullmatch(check_mem(value))
    assert m is not None
    return int(m.group(1)) * 1024 ** "KMGT".index((m.group(2) or "M").upper()) * 1024


def slurm_seconds(value: str) -> int | None:
    """Return the seconds of a duration as Slurm prints it (`[D-]HH:MM:SS`, `MM:SS`).

    None for anything else (`UNLIMITED`, `INVALID`, empty).
    """
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value.strip())
    if m is None:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds

"""Slurm's own notations for time limits and memory sizes."""

from __future__ import annotations

import math
import re

from mjlab_hpc.errors import SpecError

__all__ = ["check_mem", "slurm_time_minutes"]

_TIME_FORMATS = (
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d{1,2})$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2})$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2}):(\d{1,2})$"), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)


def slurm_time_minutes(value: str, flag: str = "--time") -> int:
    """Minutes of a Slurm time limit (`30`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`,
    `D-HH:MM:SS`), rounded up to whole minutes as Slurm does; SpecError naming `flag`."""
    text = value.strip()
    for pattern, units in _TIME_FORMATS:
        m = pattern.match(text)
        if m:
            seconds = sum(int(g) * _SECONDS[u] for g, u in zip(m.groups(), units, strict=True))
            if seconds <= 0:
                break
            return math.ceil(seconds / 60)
    raise SpecError(
        flag,
        f"{value!r} is not a Slurm time limit; use minutes (90), HH:MM:SS (12:00:00) "
        "or D-HH:MM:SS (1-00:00:00)",
    )


def check_mem(value: str, flag: str = "--mem") -> str:
    """A Slurm memory size (`64G`, `500M`, `1024`), as given; SpecError naming `flag`."""
    if not _MEM.match(value):
        raise SpecError(flag, f"{value!r} is not a Slurm memory size (e.g. 64G, 500M)")
    return value

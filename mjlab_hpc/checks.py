"""The rules a value must follow for the place it ends up in: a path component, an `#SBATCH`
value, a shell line, a Slurm name. Each check returns the value, or raises SpecError naming
the flag and saying what would work.

Values are refused rather than escaped where escaping cannot keep them in place: a newline or
another control character would end an `#SBATCH` line (what follows runs as a command), and a
`/` or `..` in a name that becomes a folder would write outside the log root.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess

from mjlab_hpc.errors import SpecError

__all__ = [
    "NAME_MAX",
    "job_name",
    "no_control",
    "path_component",
    "positive_seconds",
    "sbatch_value",
    "shell_line",
    "slurm_name",
]

#: The longest file or folder name Linux filesystems take, in bytes.
NAME_MAX = 255

# C0 and C1 control characters and Unicode's line and paragraph separators: each ends a line
# for somebody (bash, Python's splitlines, a terminal).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+@:,-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.+@:,&|()\[\]*!-]+$")


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def no_control(flag: str, value: str, allow_tab: bool = False) -> str:
    """`value` without newlines or other control characters (they would end a script line or a
    log record)."""
    bad = _CONTROL.search(value.replace("\t", "") if allow_tab else value)
    if bad:
        raise SpecError(
            flag,
            f"{_shown(value)} holds the control character {bad.group()!r} (a newline would end "
            "the line it is written into); remove it",
        )
    return value


def path_component(flag: str, value: str, reserved: int = 0) -> str:
    """A name that becomes one folder: not empty, no `/`, not `.`/`..`, not hidden, no control
    characters, and short enough that it fits NAME_MAX with `reserved` more bytes (a
    timestamp and suffix around a run name)."""
    no_control(flag, value)
    if not value:
        raise SpecError(flag, "must not be empty")
    if value != value.strip():
        # Records are read back stripped: a requeued job would look for another folder.
        raise SpecError(flag, f"{_shown(value)} starts or ends with white space; remove it")
    if "/" in value or value in (".", ".."):
        raise SpecError(
            flag, f"{_shown(value)} must be a plain name without '/' (a folder of its own)"
        )
    if value.startswith("."):
        raise SpecError(
            flag, f"{_shown(value)} must not start with '.' (hidden folders are the toolkit's)"
        )
    size = len(os.fsencode(value)) + reserved
    if size > NAME_MAX:
        raise SpecError(
            flag,
            f"{len(value)} characters is too long: a folder name holds at most {NAME_MAX} bytes "
            f"({reserved} of them are taken by the timestamp); use at most {NAME_MAX - reserved}",
        )
    return value


def sbatch_value(flag: str, value: str) -> str:
    """A value written into an `#SBATCH` line (quoted there): no control characters."""
    return no_control(flag, value)


def job_name(flag: str, value: str) -> str:
    """A Slurm job name: an `#SBATCH` value that also fills `%x` in output paths, so no `/`
    either (it would put the batch log outside its folder)."""
    no_control(flag, value)
    if not value.strip():
        raise SpecError(flag, "must not be empty")
    if "/" in value:
        raise SpecError(
            flag, f"{_shown(value)} holds '/', and Slurm puts the job name into file names "
            "(%x); use a name without '/'"
        )  # fmt: skip
    return value


def slurm_name(flag: str, value: str, constraint: bool = False) -> str:
    """A Slurm partition, account or QOS name (comma-separated lists allowed), or with
    `constraint` a feature expression (`a100&ib`, `[a|b]`)."""
    no_control(flag, value)
    pattern = _CONSTRAINT if constraint else _SLURM_NAME
    if not pattern.match(value):
        allowed = "letters, digits and _.+@:,-" + ("&|()[]*!" if constraint else "")
        raise SpecError(flag, f"{_shown(value)} is not a Slurm name (allowed: {allowed})")
    return value


def shell_line(flag: str, value: str) -> str:
    """One complete shell line (a `--setup` command): no newline or other control character
    but tab, and it parses (`bash -n`; shlex where bash is missing)."""
    no_control(flag, value, allow_tab=True)
    if not value.strip():
        raise SpecError(flag, "is empty: give a command (e.g. 'module load cuda')")
    if value.lstrip().startswith("#"):
        # sbatch reads `#SBATCH` lines up to the first command, and submitit's script has none
        # before its setup lines: such a line would change the job's options.
        raise SpecError(
            flag,
            f"{_shown(value)} is a comment (an #SBATCH line would change the job): give a "
            "command, and set job options with mjlab-submit's flags or --sbatch-arg",
        )
    if re.search(r"(?<!\\)(\\\\)*\\\s*$", value):
        # A line continued into the next would take the next line (the next --setup, or the
        # command that starts the ranks) as its arguments.
        raise SpecError(flag, f"{_shown(value)} ends with '\\' (continued into the next line)")
    bash = shutil.which("bash")
    if bash is not None:
        # The line, then a marker line: bash must parse both as commands, without a warning
        # (an open here-document parses, but swallows every line after it).
        proc = subprocess.run([bash, "-n"], input=value + "\n:\n", capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if proc.returncode != 0 or proc.stderr.strip():
            why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "a syntax error"
            why = re.sub(r"^.*?line \d+: ", "", why)
            raise SpecError(flag, f"{_shown(value)} is not a complete shell line ({why})")
        return value
    try:
        shlex.split(value)
    except ValueError as exc:
        raise SpecError(flag, f"{_shown(value)} is not a complete shell line ({exc})") from None
    return value


def positive_seconds(flag: str, value: float, minimum: float = 0.0) -> float:
    """A finite duration of at least `minimum` seconds (nan and inf are refused)."""
    if not math.isfinite(value) or value < minimum:
        raise SpecError(flag, f"must be a number of seconds >= {minimum:g}, got {value}")
    return value

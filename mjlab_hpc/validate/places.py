"""What a user's text may hold, by where the toolkit writes it.

The places are a folder name, an `#SBATCH` line, a Slurm name, a shell line and a job's file
paths. Each check returns the value or raises SpecError naming the flag and what would work.
Values are refused rather than escaped where no escape keeps them in place: a newline would
end an `#SBATCH` line (what follows runs as a command), and a `/` or `..` in a folder name
would write outside the log root.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import unicodedata
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import ResolvedSpec

__all__ = [
    "NAME_MAX",
    "RUN_NAME_PREFIX",
    "check_job_paths",
    "job_name",
    "no_control",
    "path_component",
    "run_name",
    "sbatch_value",
    "shell_line",
    "slurm_name",
]

#: The longest file or folder name Linux filesystems take, in bytes.
NAME_MAX = 255
#: What a run's folder name holds before the run name: `2026-11-23_09-12-51_`.
RUN_NAME_PREFIX = "YYYY-mm-dd_HH-MM-SS_"

# C0 and C1 control characters and Unicode's line and paragraph separators: each ends a line
# for somebody (bash, Python's splitlines, a terminal).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Invisible format characters (bidi overrides and isolates, zero-width spaces, BOM, soft
# hyphen, tags) and lone surrogates (bytes that are not UTF-8): they reorder or hide what
# `ls`, status tables and logs show. The joiners ZWJ/ZWNJ stay: words of Persian and Indic
# scripts need them.
_JOINERS = frozenset({"\u200c", "\u200d"})
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+@:,-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.+@:,&|()\[\]*!-]+$")


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def no_control(flag: str, value: str, allow_tab: bool = False) -> str:
    """Refuse newlines, other control characters and invisible ones in `value`.

    A newline would end the script line or log record the value is written into.
    """
    bad = _CONTROL.search(value.replace("\t", "") if allow_tab else value)
    if bad:
        raise SpecError(
            flag,
            f"{_shown(value)} holds the control character {bad.group()!r} (a newline would end "
            "the line it is written into); remove it",
        )
    for char in value:
        kind = unicodedata.category(char)
        if kind == "Cs":
            raise SpecError(flag, f"{_shown(value)} holds bytes that are not UTF-8; use UTF-8")
        if kind == "Cf" and char not in _JOINERS:
            raise SpecError(
                flag,
                f"{_shown(value)} holds U+{ord(char):04X} ({unicodedata.name(char, '?')}), an "
                "invisible character that reorders or hides what ls, status and logs show; "
                "remove it",
            )
    return value


def path_component(flag: str, value: str, reserved: int = 0) -> str:
    """Check a name that becomes one folder.

    It must not be empty, hold `/` or control characters, be `.`/`..`, or be hidden. It must
    fit NAME_MAX with `reserved` more bytes (a timestamp and suffix around a run name).
    """
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
    size = len(os.fsencode(value))
    if size + reserved > NAME_MAX:
        chars = f" ({len(value)} characters)" if len(value) != size else ""
        raise SpecError(
            flag,
            f"{size} bytes{chars} is too long: a folder name holds at most {NAME_MAX} bytes "
            f"({reserved} of them are taken by the timestamp); use at most "
            f"{NAME_MAX - reserved} bytes (a non-ASCII character takes 2-4)",
        )
    return value


def run_name(flag: str, value: str) -> str:
    """Check a run name, which ends a run's folder: `<YYYY-mm-dd_HH-MM-SS>_<run-name>[-<n>]`."""
    return path_component(flag, value, reserved=len(RUN_NAME_PREFIX) + 5)


def check_job_paths(resolved: ResolvedSpec) -> None:
    """Refuse a `%` in the user's pieces of a job's file paths.

    Slurm expands %-patterns in the --output/--error paths of sbatch and srun (`%j` the job
    id, `%x` the job name, `%20x`). Submitit replaces `%j`, `%t`, `%A`, `%a` in its folder by
    plain text substitution. No escape keeps such a path exact in both: a run would split
    over two directories, or its job fail at launch with no log anywhere.
    """
    train = resolved.train
    for flag, value in (
        ("--log-root", str(Path(train.log_root).absolute())),
        ("--run-dir", str(Path(train.run_dir).absolute()) if train.run_dir else ""),
        ("--experiment-name", resolved.experiment_name),
        ("--run-name", train.run_name),
    ):
        if "%" in value:
            raise SpecError(
                flag,
                f"{_shown(value)} holds '%', which Slurm and submitit expand in the job's "
                "file names (%j: the job id, %x: the job name), so the run's files would "
                "not stay in one place: use a name (and folder) without '%'",
            )


def sbatch_value(flag: str, value: str) -> str:
    """Check a value written into an `#SBATCH` line (quoted there): no control characters."""
    return no_control(flag, value)


def job_name(flag: str, value: str) -> str:
    """Check a Slurm job name: an `#SBATCH` value without `/`.

    The name also fills `%x` in output paths, where a `/` would put the batch log outside
    its folder.
    """
    no_control(flag, value)
    if not value.strip():
        raise SpecError(flag, "must not be empty")
    if "/" in value:
        raise SpecError(
            flag,
            f"{_shown(value)} holds '/', and Slurm puts the job name into file names "
            "(%x); use a name without '/'",
        )
    return value


def slurm_name(flag: str, value: str, constraint: bool = False) -> str:
    """Check a Slurm partition, account or QOS name (comma-separated lists allowed).

    With `constraint`, a feature expression (`a100&ib`, `[a|b]`).
    """
    no_control(flag, value)
    pattern = _CONSTRAINT if constraint else _SLURM_NAME
    if not pattern.match(value):
        allowed = "letters, digits and _.+@:,-" + ("&|()[]*!" if constraint else "")
        raise SpecError(flag, f"{_shown(value)} is not a Slurm name (allowed: {allowed})")
    return value


def shell_line(flag: str, value: str) -> str:
    """Check one complete shell line (a `--setup` command).

    It holds no newline or other control character but tab, and it parses (`bash -n`; shlex
    where bash is missing).
    """
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
        proc = subprocess.run(
            [bash, "-n"], input=value + "\n:\n", capture_output=True, text=True, timeout=10
        )
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

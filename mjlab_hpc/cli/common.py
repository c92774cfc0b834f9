"""What every CLI shares: parsing (unknown `--env.*`/`--agent.*` arguments become overrides)
and turning errors into one clear line and an exit code."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import tyro
from rich.console import Console
from rich.markup import escape

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_FAILED, LaunchError, SpecError, SubmitError
from mjlab_hpc.spec import split_overrides

__all__ = ["error_line", "guarded", "parse_with_overrides", "resume_command"]

T = TypeVar("T")


def error_line(label: str, message: object) -> None:
    """Print `label: message` on stderr (markup in the message is shown as typed)."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]{label}:[/] {escape(str(message))}"
    )


def guarded(body: Callable[[], int]) -> int:
    """Run a command body; bad input (SpecError, LaunchError) becomes one line and exit 2, a
    refused submission one line and exit 1."""
    try:
        return body()
    except (SpecError, LaunchError) as exc:
        error_line("error", exc)
        return EXIT_BAD_INPUT
    except SubmitError as exc:
        error_line("not submitted", exc)
        return EXIT_FAILED


def parse_with_overrides(
    cls: type[T],
    argv: Sequence[str] | None,
    description: str | None,
    attach: Callable[[T, tuple[str, ...]], T],
) -> T | int:
    """Parse `argv` into `cls`; arguments tyro does not know are `--env.*`/`--agent.*`
    overrides (as mjlab's own train takes them), given to `attach`. An exit code when an
    argument is neither."""
    spec, unknown = tyro.cli(cls, args=argv, description=description, return_unknown_args=True)
    try:
        return attach(spec, split_overrides(unknown))
    except SpecError as exc:
        error_line("error", exc)
        return EXIT_BAD_INPUT


def resume_command(prog: str, argv: Sequence[str], run_dir: str | Path) -> str:
    """The command that continues a run: the same arguments, naming its run directory."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--resume", "--no-resume", "--restart-from-scratch"):
            continue
        if arg == "--run-dir":
            skip = True
            continue
        if arg.startswith("--run-dir="):
            continue
        args.append(arg)
    return shlex.join([prog, *args, "--run-dir", str(run_dir)])

"""What every CLI shares: parsing, and errors turned into one clear line and an exit code.

Arguments the CLI does not know become `--env.*`/`--agent.*` overrides, as mjlab's own train
takes them; mjlab's spellings of booleans and lists work too.
"""

from __future__ import annotations

import ast
import dataclasses
import getpass
import os
import shlex
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import tyro
from rich.console import Console

from mjlab_hpc.console import inert
from mjlab_hpc.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Diverged,
    LaunchError,
    SpecError,
    SubmitError,
)
from mjlab_hpc.rank.context import SCRIPT_ENVS, set_by_our_script
from mjlab_hpc.rundir.durable import LinkRefused, ownership
from mjlab_hpc.rundir.layout import keep_runs_private
from mjlab_hpc.spec import split_overrides

__all__ = [
    "drop_internal_variables",
    "error_line",
    "guarded",
    "mjlab_booleans",
    "parse_command",
    "parse_with_overrides",
    "python_lists",
    "resume_command",
]

T = TypeVar("T")
# mjlab's CLI spells booleans `--flag True` (tyro's FlagConversionOff, mjlab.TYRO_FLAGS).
_BOOL_WORDS = {"true": True, "false": False}


def error_line(label: str, message: object) -> None:
    """Print `label: message` on stderr (markup in the message is shown as typed)."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]{label}:[/] {inert(message, markup=True)}"
    )


def drop_internal_variables() -> None:
    """Drop the `_MJLAB_HPC_*` variables from a command a person started, saying so.

    Our launchers set them for the ranks they start, and our batch scripts for the commands
    they run (those are kept: the script's mark says so). Anywhere else nobody of ours set
    them (left exported, copied from a job's environment), and they would change how the
    command runs (a run that ignores Ctrl-C).
    """
    ours = SCRIPT_ENVS if set_by_our_script(os.environ) else ()
    found = sorted(k for k in os.environ if k.startswith("_MJLAB_HPC_") and k not in ours)
    for key in found:
        del os.environ[key]
    if found:
        print(
            f"warning: ignored {', '.join(found)}: internal variable(s) of mjlab_hpc's "
            "own launchers, not settings (unset them)",
            file=sys.stderr,
            flush=True,
        )


def _permission_problem(exc: PermissionError) -> str:
    """Say in one line what a PermissionError means: which file or folder, whose, for whom."""
    if not exc.filename:
        return f"permission denied: {exc}"
    where = Path(exc.filename).absolute()
    # The first folder on the way that this user may not enter, else the file itself.
    blocked = next((p for p in (where, *where.parents) if os.access(p.parent, os.X_OK)), where)
    whose = f" ({ownership(blocked)})" if ownership(blocked) else ""
    return (
        f"{blocked} cannot be read or written by {getpass.getuser()}{whose}: ask its owner "
        "for access (chmod g+rX for the group), or use your own runs"
    )


def guarded(body: Callable[[], T]) -> T | int:
    """Run a command body, turning its errors into one line and an exit code.

    Bad input (SpecError, LaunchError) exits 2, a refused submission 1, a link planted in a
    run 1, and a Ctrl-C that reached no handler of ours 130. What the command creates is its
    user's alone (`keep_runs_private`).
    """
    keep_runs_private()
    try:
        return body()
    except (SpecError, LaunchError) as exc:
        error_line("error", exc)
        return EXIT_BAD_INPUT
    except SubmitError as exc:
        error_line("not submitted", exc)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C before the work began (or after it ended)
        error_line("interrupted", "stopped at once (Ctrl-C); nothing was started")
        return EXIT_INTERRUPTED
    except Diverged as exc:  # the numbers went non-finite: a fact of the settings, one line
        error_line("failed", exc)
        return EXIT_FAILED
    except LinkRefused as exc:  # a write would have followed a link out of the run
        error_line("error", exc)
        return EXIT_FAILED
    except PermissionError as exc:  # another user's file or folder (a team's log root)
        error_line("error", _permission_problem(exc))
        return EXIT_FAILED
    except BrokenPipeError:
        # The reader went away (`mjlab-hpc status --json | head`): nothing more to say, and
        # the interpreter's own flush at exit must not fail either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def parse_with_overrides(
    cls: type[T],
    argv: Sequence[str] | None,
    description: str | None,
    attach: Callable[[T, tuple[str, ...]], T],
) -> T | int:
    """Parse `argv` into `cls`, or return an exit code when an argument is bad.

    Arguments tyro does not know are `--env.*`/`--agent.*` overrides, given to `attach`.
    """
    parsed = parse_command(cls, argv, description, attach)
    return parsed if isinstance(parsed, int) else parsed[0]


def parse_command(
    cls: type[T],
    argv: Sequence[str] | None,
    description: str | None,
    attach: Callable[[T, tuple[str, ...]], T],
    prog: str | None = None,
) -> tuple[T, frozenset[str]] | int:
    """Parse `argv` into `cls` and say which fields it set, or return an exit code.

    The one parse of every command's flags (mjlab-submit, mjlab-train, mjlab-hpc's commands).
    The fields set are found from the parse, not the text: the arguments are parsed again
    against defaults that differ from the real ones in every field, and a field that comes
    out alike both times was set by the command (`--seed 42` sets seed, though 42 is its
    default; `--no-video`, `--max_iterations=3` and mjlab's `--video True` count as typed).
    Fields of a nested spec (SubmitSpec's `train`) are named without prefix; `overrides`
    and repeatable flags count as set when not empty, fields without a default always.
    """
    given = list(argv) if argv is not None else sys.argv[1:]

    def parse() -> tuple[T, frozenset[str]]:
        args = mjlab_booleans(cls, python_lists(_none_values(given)))
        spec, unknown = tyro.cli(
            cls, prog=prog, args=args, description=description, return_unknown_args=True
        )
        default = _defaults_of(spec)
        other, _ = tyro.cli(
            cls,
            prog=prog,
            args=args,
            default=_shifted(default),
            return_unknown_args=True,
            add_help=False,
        )
        return attach(spec, split_overrides(unknown)), _set_fields(spec, other, default)

    # A Ctrl-C while it loads, or a list that names nothing: one line.
    return guarded(parse)


def _set_fields(a: object, b: object, default: object) -> frozenset[str]:
    """The fields that parsed alike against two different defaults: the command set them."""
    named: set[str] = set()
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y, d = (getattr(o, f.name) for o in (a, b, default))
        if dataclasses.is_dataclass(x):
            named |= _set_fields(x, y, d)
        elif x != d if isinstance(d, tuple) else x == y:
            named.add(f.name)
    return frozenset(named)


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _defaults_of(spec: T) -> T:
    """`spec` (a dataclass) with every field that has a default set to it, nested specs'
    too; a field without one (a positional argument) keeps its value."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            changes[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            changes[f.name] = f.default_factory()
    return dataclasses.replace(spec, **changes)  # type: ignore[type-var]


def _shifted(default: T) -> T:
    """`default` (`_defaults_of`) with every field that has a default changed to another value.

    Tuple-valued fields (repeatable flags, which tyro appends to the default) keep theirs.
    """
    hints = typing.get_type_hints(type(default), include_extras=True)
    changes = {}
    for f in dataclasses.fields(default):  # type: ignore[arg-type]
        value = getattr(default, f.name)
        if not _has_default(f) or isinstance(value, tuple):
            continue
        changes[f.name] = (
            _shifted(value) if dataclasses.is_dataclass(value) else _other(value, hints[f.name])
        )
    return dataclasses.replace(default, **changes)  # type: ignore[type-var]


def _other(value: object, hint: object) -> object:
    """A value of type `hint` other than `value`."""
    if typing.get_origin(hint) is typing.Annotated:
        return _other(value, typing.get_args(hint)[0])
    arms = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in typing.get_args(hint) if a != value)
    if arms and typing.get_origin(hint) is not tuple:  # a union: the arm `value` is of
        literals = [a for a in arms if typing.get_origin(a) is typing.Literal]
        if any(value in typing.get_args(a) for a in literals):
            return _other(value, next(a for a in literals if value in typing.get_args(a)))
        plain = [a for a in arms if isinstance(a, type) and a is not tuple]
        return _other(value, plain[0] if plain else arms[0])
    if hint is bool:
        return not value
    if hint in (int, float):
        return hint((value or 0) + 1)  # type: ignore[operator]
    if hint is str:
        return f"{value or ''}~"
    return (*(value if isinstance(value, tuple) else ()), 0)  # tuple[int, ...]


def _bool_flags(cls: type) -> set[str]:
    """Return `--name` of every boolean field of a spec dataclass, a nested spec's too.

    A nested spec's flags carry no prefix here.
    """
    found = set()
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
        if base is bool:
            found.add("--" + f.name.replace("_", "-"))
        elif dataclasses.is_dataclass(base) and isinstance(base, type):
            found |= _bool_flags(base)
    return found


def mjlab_booleans(cls: type, argv: list[str] | None) -> list[str] | None:
    """Turn mjlab's spelling of booleans in `argv` into ours, for every boolean flag of `cls`.

    `--video True` becomes `--video` and `--video=false` `--no-video`, so commands typed for
    mjlab's train run unchanged.
    """
    if argv is None:
        return None
    flags = _bool_flags(cls)
    out: list[str] = []
    items = list(argv)
    while items:
        arg = items.pop(0)
        name, eq, value = arg.partition("=")
        name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if name in flags and not eq and items and items[0].lower() in _BOOL_WORDS:
            value, eq = items.pop(0), "="
        if name in flags and eq and value.lower() in _BOOL_WORDS:
            out.append(name if _BOOL_WORDS[value.lower()] else "--no-" + name[2:])
        else:
            out.append(arg)
    return out


# Flags whose value may be `none` (tyro only knows `None`).
_NONE_FLAGS = ("--hang-timeout-s", "--save-every-min")


def _none_values(argv: Sequence[str]) -> list[str]:
    """Spell `--hang-timeout-s none` as tyro reads it (`None`), in either form of the flag."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag in _NONE_FLAGS and eq and value.lower() == "none":
            out[i] = f"{flag}=None"
        elif arg in _NONE_FLAGS and i + 1 < len(out) and out[i + 1].lower() == "none":
            out[i + 1] = "None"
    return out


# Flags that mjlab's own train reads in Python's syntax for lists (`--gpu-ids "[0, 1]"`,
# tyro's UsePythonSyntaxForLiteralCollections); ours also take the values one by one.
_LIST_FLAGS = ("--gpu-ids",)


def python_lists(argv: Sequence[str]) -> list[str]:
    """Turn mjlab's `--gpu-ids "[0, 1]"` into `--gpu-ids 0 1`.

    `--gpu-ids=[0,1]` and the unquoted list work too. SpecError for a list that is empty or
    not of whole numbers.
    """
    out: list[str] = []
    items = list(argv)
    while items:
        arg = items.pop(0)
        flag, eq, value = arg.partition("=")
        if not eq and items:
            value = items[0]
        if flag not in _LIST_FLAGS or not value.lstrip().startswith(("[", "(")):
            out.append(arg)
            continue
        if not eq:
            items.pop(0)
        # Unquoted, the shell split it: the words up to the one that closes it (no flag).
        while not value.rstrip().endswith(("]", ")")) and items and not items[0].startswith("-"):
            value += " " + items.pop(0)
        try:
            ids = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            ids = None
        if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
            fix = f'write {flag} 0 1 or {flag} "[0, 1]"'
            raise SpecError(flag, f"{value!r} is not a list of GPU ids: {fix}")
        if not ids:
            raise SpecError(flag, f"{value!r} names no GPU: use {flag} None for the CPU")
        out += [flag, *(str(i) for i in ids)]
    return out


def resume_command(prog: str, argv: Sequence[str], run_dir: str | Path) -> str:
    """Return the command that continues a run: the same arguments, naming its run directory."""
    args: list[str] = []
    items = list(argv)
    while items:
        arg = items.pop(0)
        name = arg.partition("=")[0]
        if name in ("--resume", "--no-resume", "--restart-from-scratch"):
            if "=" not in arg and items and items[0].lower() in _BOOL_WORDS:
                items.pop(0)  # mjlab's spelling: `--resume True`
            continue
        if arg == "--run-dir":
            items = items[1:]
            continue
        if name == "--run-dir":
            continue
        args.append(arg)
    return shlex.join([prog, *args, "--run-dir", str(run_dir)])

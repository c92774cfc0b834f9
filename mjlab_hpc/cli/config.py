"""Site defaults of mjlab-submit's flags, from TOML files, and named profiles of them.

Two files hold them: the project's `mjlab-hpc.toml` (the nearest one upward from the working
directory) and the user's `$XDG_CONFIG_HOME/mjlab-hpc/config.toml` (`~/.config/...`). Each
holds a `[defaults]` table and `[profile.NAME]` tables whose keys are mjlab-submit's flags
(`gpus-per-node = 4`). From lowest to highest: the built-in defaults, the user's [defaults],
the project's [defaults], the profile `--profile` names (the project's over the user's), and
the flags typed on the command line. The CLIs read these files (mjlab-submit; mjlab-hpc's
doctor and render, which take its flags; its run commands, for the log root), so they live
here; `write_profile` adds a table for `mjlab-hpc doctor --write-profile`. mjlab-train reads
none: the ranks run it with the values that were submitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import sys
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tyro

from mjlab_hpc.convert import Mismatch, describe, load
from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir.durable import ownership, read_regular, write_atomic
from mjlab_hpc.spec import SubmitSpec, TrainSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli where it is installed (it is no dependency)
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

__all__ = [
    "PROJECT_FILE",
    "Setting",
    "Source",
    "allowed_keys",
    "applied_lines",
    "config_files",
    "default_log_root",
    "naming_sources",
    "typed_fields",
    "user_file",
    "with_site_defaults",
    "write_profile",
]

#: The project's file, found upward from the working directory.
PROJECT_FILE = "mjlab-hpc.toml"
# Flags that say what one command does, not how a site runs jobs: typed each time.
_NOT_DEFAULTS = frozenset(
    {
        "task",
        "run_dir",
        "resume",
        "restart_from_scratch",
        "fresh_envs",
        "wandb_run_path",
        "wandb_checkpoint_name",
        "dry_run",
        "sweep",
        "after",
        "profile",
    }
)
_LIMIT = 1 << 20  # a config file larger than this is no config file
_NO = object()  # a value that does not fit a field's type


@dataclass(frozen=True)
class Source:
    """Where a value came from: a file and a table of it."""

    path: Path
    """The config file."""
    table: str
    """`defaults` or `profile.NAME`."""

    def __str__(self) -> str:
        return f"{self.path} [{self.table}]"


@dataclass(frozen=True)
class Setting:
    """A flag's value that a config file gave (none was typed)."""

    key: str
    """The flag's name, as the file spells it (`gpus-per-node`)."""
    value: object
    """Its value, as the spec holds it."""
    source: Source
    """The file and table it came from."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _is_flag(kind: Any) -> bool:
    """Whether a field of type `kind` is a flag: not a nested spec, not hidden from --help."""
    if typing.get_origin(kind) is typing.Annotated:
        base, *marks = typing.get_args(kind)
        return tyro.conf.Suppress not in marks and _is_flag(base)
    return not dataclasses.is_dataclass(kind)


def allowed_keys() -> dict[str, Any]:
    """Every key a config file may hold, by field name, with the field's type.

    They are mjlab-submit's flags (TrainSpec's and SubmitSpec's fields) but those of one
    command (`_NOT_DEFAULTS`).
    """
    return {
        name: kind
        for cls in (TrainSpec, SubmitSpec)
        for name, kind in _hints(cls).items()
        if name not in _NOT_DEFAULTS and _is_flag(kind)
    }


def _convert(kind: Any, value: object) -> object:
    """Return `value` as a field of type `kind` holds it, or `_NO` when it does not fit.

    The one converter's TOML mode (`mjlab_hpc.convert`): `"none"` for None, finite numbers.
    """
    try:
        return load(kind, value, mode="toml")
    except Mismatch:
        return _NO


def _describe(kind: Any) -> str:
    """Say in words what a field of type `kind` takes."""
    return describe(kind, "toml")


def _toml(value: object) -> str:
    """Write `value` (a plain value of a spec) as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if value is None:
        return '"none"'
    # JSON's string escapes are TOML's, but for DEL, which TOML wants escaped too.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def _example(name: str) -> str:
    """A value of field `name` in TOML: its built-in default where it has one."""
    for spec in (TrainSpec(), SubmitSpec()):
        if (value := getattr(spec, name, None)) not in (None, ()):
            return _toml(value)
    kind = allowed_keys()[name]
    return next(e for v, e in ((["..."], '["..."]'), (1, "1"), ("", '"..."')) if _fits(kind, v))


def _fits(kind: Any, value: object) -> bool:
    return _convert(kind, value) is not _NO


def _key(name: str) -> str:
    return name.replace("_", "-")


def user_file() -> Path:
    """The user's config file (XDG_CONFIG_HOME respected when it is an absolute path)."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".config"
    return base / "mjlab-hpc" / "config.toml"


def _yours(path: Path) -> bool:
    """Whether `path` is this user's (or root's); else say that it is left out.

    Its setup lines run in every job: one that another user left upward of here (in /tmp,
    a shared folder) is not taken, as git takes no repository of another user.
    """
    if path.stat().st_uid in (os.getuid(), 0):
        return True
    print(
        f"warning: ignored {path}: it is not yours ({ownership(path)}); copy it, or put its "
        f"tables in {user_file()}",
        file=sys.stderr,
    )
    return False


def config_files(cwd: Path | None = None) -> tuple[Path | None, Path]:
    """The project's file (None: no mjlab-hpc.toml of this user upward of `cwd`) and the
    user's file."""
    here = (cwd or Path.cwd()).absolute()
    found = (d / PROJECT_FILE for d in (here, *here.parents) if (d / PROJECT_FILE).is_file())
    return next((p for p in found if _yours(p)), None), user_file()


def _load(path: Path) -> dict[str, dict[str, object]]:
    """Read a config file's tables, values by field name; SpecError (exit 2) naming the file,
    table and key of the first thing that is wrong."""
    if tomllib is None:
        raise SpecError(
            str(path), "reading it needs Python 3.11 (tomllib), or `pip install tomli` on 3.10"
        )
    try:
        text = read_regular(path, _LIMIT).decode()
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(path), f"not valid TOML ({exc}): fix it there") from None
    except UnicodeDecodeError:
        raise SpecError(str(path), "not UTF-8 text: write it as UTF-8 TOML") from None
    except (OSError, ValueError) as exc:
        raise SpecError(str(path), f"cannot be read ({exc}): fix it or move it aside") from None
    if other := [k for k in data if k not in ("defaults", "profile")]:
        problem = f"unknown table or key {other[0]!r}: the file holds [defaults] and [profile.NAME]"
        raise SpecError(str(path), problem)
    tables = {"defaults": data.get("defaults", {})}
    profiles = data.get("profile", {})
    if not isinstance(profiles, dict):
        raise SpecError(str(path), "`profile` must be tables: [profile.NAME]")
    tables |= {f"profile.{name}": table for name, table in profiles.items()}
    for table, values in tables.items():
        if not isinstance(values, dict):
            raise SpecError(f"{path} [{table}]", "must be a table of flag = value lines")
    return {table: _check(Source(path, table), values) for table, values in tables.items()}


def _check(source: Source, values: Mapping[str, object]) -> dict[str, object]:
    """Return a table's values by field name; SpecError naming the first key that is wrong."""
    allowed = allowed_keys()
    out = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        where = f"{source} {key}"
        if name in _NOT_DEFAULTS:
            flag = f"--{_key(name)}"
            raise SpecError(where, f"{flag} says what one command does: type it, not a default")
        if name not in allowed:
            close = difflib.get_close_matches(_key(name), [_key(k) for k in allowed], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problem = f"unknown key{hint}: keys are mjlab-submit's flags (mjlab-submit --help)"
            raise SpecError(where, problem)
        if (got := _convert(allowed[name], value)) is _NO:
            shown = _toml(value) if isinstance(value, (str, int, float, list)) else str(value)
            problem = f"is {shown}, but takes {_describe(allowed[name])}"
            raise SpecError(where, f"{problem}: write it like {_key(name)} = {_example(name)}")
        out[name] = got
    return out


def _layers(profile: str | None, cwd: Path | None) -> list[tuple[Source, dict[str, object]]]:
    """The tables that apply, from the lowest to the highest."""
    project, user = config_files(cwd)
    files = [(p, _load(p)) for p in (user, project) if p is not None and p.is_file()]
    layers = [(Source(p, "defaults"), t["defaults"]) for p, t in files]
    if profile is None:
        return layers
    table = f"profile.{profile}"
    found = [(Source(p, table), t[table]) for p, t in files if table in t]
    if not found:
        names = sorted({k.removeprefix("profile.") for _, t in files for k in t if k != "defaults"})
        where = " and ".join(str(p) for p, _ in files) or (
            f"any config file (none: neither {user} nor a {PROJECT_FILE} upward of here)"
        )
        there = (
            f"the profiles there are: {', '.join(names)}"
            if names
            else "there are none (mjlab-hpc doctor --write-profile NAME writes one)"
        )
        raise SpecError("--profile", f"no profile {profile!r} in {where}; {there}")
    return [*layers, *found]


def typed_fields(argv: Sequence[str]) -> frozenset[str]:
    """The fields of mjlab-submit's flags that mjlab-hpc's `argv` types (`--no-video` too).

    mjlab-submit knows its own from its parse (`cli.common.parse_command`); mjlab-hpc's
    commands hold the same flags in other dataclasses, so their long flags are read here.
    """
    fields = {*_hints(SubmitSpec), *_hints(TrainSpec)}
    typed = set()
    for arg in argv:
        name = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else ""
        typed.add(name[3:] if name.startswith("no_") and name[3:] in fields else name)
    return frozenset(typed & fields)


def with_site_defaults(
    spec: SubmitSpec, named: frozenset[str], cwd: Path | None = None
) -> tuple[SubmitSpec, tuple[Setting, ...]]:
    """Return `spec` with the config files' values for every field the command did not set.

    Also returns those values with where each came from. SpecError (exit 2, nothing done)
    for a malformed file, an unknown key, a wrong type or a --profile that no file has.
    """
    chosen: dict[str, Setting] = {}
    for source, values in _layers(spec.profile, cwd):
        for name, value in values.items():
            if name not in named:
                chosen[name] = Setting(_key(name), value, source)
    train = {n: s.value for n, s in chosen.items() if n in _hints(TrainSpec)}
    submit = {n: s.value for n, s in chosen.items() if n not in train}
    spec = spec.replace(train=spec.train.replace(**train), **submit)
    return spec, tuple(chosen.values())


def default_log_root(given: str, named: frozenset[str], cwd: Path | None = None) -> str:
    """The log root where mjlab-hpc's run commands (status, logs, ...) look for runs.

    That is `given` when --log-root was typed (`named`), else the files' `[defaults]`
    log-root, else `given`. A bad file is said in a warning and left out: a run is still
    found and cancelled.
    """
    if "log_root" in named:
        return given
    try:
        layers = _layers(None, cwd)
    except SpecError as exc:
        print(f"warning: {exc}; its log-root is not used", file=sys.stderr)
        return given
    found = [values["log_root"] for _, values in layers if "log_root" in values]
    return str(found[-1]) if found else given


@contextlib.contextmanager
def naming_sources(site: Sequence[Setting]) -> Iterator[None]:
    """Name the file and table of a value from a config file that a check refuses."""
    try:
        yield
    except SpecError as exc:
        given = {f"--{s.key}": s for s in site}
        if exc.flag not in given:
            raise
        raise SpecError(f"{exc.flag} (set in {given[exc.flag].source})", exc.problem) from None


def _name_ok(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9_-]+", name) is not None


def _profile_span(text: str, name: str) -> tuple[int, int] | None:
    """The characters of a `[profile.NAME]` table in `text` (its header to the next header)."""
    quoted = "|".join(f"{q}{re.escape(name)}{q}" for q in ("", '"', "'"))
    header = rf"^[ \t]*\[[ \t]*profile[ \t]*\.[ \t]*(?:{quoted})[ \t]*\][ \t]*(?:#.*)?$"
    start = re.compile(header, re.MULTILINE).search(text)
    if start is None:
        return None
    following = re.compile(r"^[ \t]*\[", re.MULTILINE).search(text, start.end())
    return start.start(), following.start() if following else len(text)


def write_profile(
    path: Path,
    name: str,
    values: Mapping[str, object],
    notes: Sequence[str] = (),
    force: bool = False,
) -> str:
    """Add the table `[profile.NAME]` of `values` (flag names) to the config file `path`.

    The file is made where there is none; what it holds stays as it is, but an existing
    profile of that name, which only `force` replaces. `notes` become comment lines above
    the values. Returns what was written for the profile. SpecError (nothing written) for a
    name TOML cannot hold bare, a malformed file or a profile there without `force`.
    """
    if not _name_ok(name):
        raise SpecError("--write-profile", f"{name!r}: use letters, digits, - and _ only")
    lines = [f"[profile.{name}]", *(f"# {n}" for n in notes)]
    lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    table = "\n".join(lines) + "\n"
    if tomllib is None:
        raise SpecError(str(path), "writing it needs Python 3.11 (tomllib), or tomli on 3.10")
    _check(Source(path, f"profile.{name}"), tomllib.loads(table)["profile"][name])
    tables = _load(path) if path.is_file() else {}  # a malformed file: refused, left as it is
    old = read_regular(path, _LIMIT).decode() if tables else ""
    if old:
        if f"profile.{name}" in tables:
            span = _profile_span(old, name)
            if not force:
                raise SpecError(
                    "--write-profile",
                    f"{path} already has [profile.{name}]: pass --force to replace it, or "
                    "choose another name",
                )
            if span is None:
                raise SpecError(
                    "--write-profile",
                    f"{path} defines profile {name!r} in a way this cannot replace: edit it there",
                )
            new = old[: span[0]] + table + ("\n" if span[1] < len(old) else "") + old[span[1] :]
        else:
            new = old + ("" if old.endswith("\n") else "\n") + "\n" + table
    else:
        new = table
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, new.encode())
    _load(path)  # what was written reads back (it was checked before: this cannot fail)
    return table


def applied_lines(settings: Sequence[Setting]) -> list[str]:
    """One line per value a file gave: `key = value  (file [table])`."""
    return [f"{s.key} = {_toml(s.value)}  ({s.source})" for s in settings]

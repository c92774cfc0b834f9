"""Site defaults of mjlab-submit's flags, from TOML files, and named profiles of them.

Two files hold them: the project's `mjlab-hpc.toml` (the nearest one upward from the working
directory) and the user's `$XDG_CONFIG_HOME/mjlab-hpc/config.toml` (`~/.config/...`). Each
holds a `[defaults]` table and `[profile.NAME]` tables whose keys are mjlab-submit's flags
(`gpus-per-node = 4`). From lowest to highest: the built-in defaults, the user's [defaults],
the project's [defaults], the profile `--profile` names (the project's over the user's), and
the flags typed on the command line; a run that a command continues keeps its own settings
over every file's. The CLIs read these files (mjlab-submit; mjlab-hpc's doctor and render,
which take its flags; its run commands, for the log root), so they live here;
`write_profile` adds a table for `mjlab-hpc doctor --write-profile` (with tomlkit, which
keeps the file's formatting and comments). mjlab-train reads none: the ranks run it with the
values that were submitted.

A file's setup lines run in every job: a file that another user wrote, or could write (it or
a folder above it), is left out with a warning, as ssh reads no key that others can write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import grp
import json
import os
import pwd
import re
import stat
import sys
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
import tyro

from mjlab_hpc.convert import Mismatch, describe, load
from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.plan import Origin
from mjlab_hpc.procs import user_name
from mjlab_hpc.rundir.durable import read_regular, write_atomic
from mjlab_hpc.spec import SubmitSpec, TrainSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomlkit reads them (tomllib is 3.11's)
    tomllib = None  # type: ignore[assignment]

__all__ = [
    "PROJECT_FILE",
    "Setting",
    "Source",
    "allowed_keys",
    "config_files",
    "default_log_root",
    "naming_sources",
    "origin_lines",
    "site_given",
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


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's own group (named after them, nobody else in it): its
    write bit lets nobody else write (a umask of 002 with user private groups)."""
    try:
        me, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _changeable(path: Path, name: str) -> str | None:
    """Why a user other than this one (and root) can change what `path` (called `name`)
    holds, None when nobody can: it is theirs, or they may write it (a folder: unless it is
    sticky, as /tmp, where nobody moves or replaces what is not theirs)."""
    st = path.lstat()
    if st.st_uid not in (os.geteuid(), 0):
        return f"{name} belongs to {user_name(st.st_uid)}"
    sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if stat.S_ISLNK(st.st_mode) or sticky:
        return None  # a link's owner alone decides where it leads
    mode = stat.filemode(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        return f"every user can write {name} ({mode})"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid):
        return f"group {_group_name(st.st_gid)} can write {name} ({mode})"
    return None


def _untrusted(path: Path) -> str | None:
    """Why the config file (or folder) `path` may hold what another user wrote; None when it
    and every folder above it, as named and as its links lead, are this user's (or root's)
    alone."""
    try:
        real = path.resolve()
        for p in dict.fromkeys((path, *path.parents, real, *real.parents)):
            if (why := _changeable(p, "it" if p == path else str(p))) is not None:
                return why
    except OSError as exc:
        return f"{exc.filename or path} cannot be looked at ({exc.strerror or exc})"
    return None


def _usable(path: Path | None) -> bool:
    """Whether a config file at `path` is read; a warning says why one there is left out."""
    if path is None or not os.path.lexists(path):
        return False
    why = _untrusted(path)
    if why is None and not path.is_file():
        why = "it is not a regular file"
    if why is not None:
        mine = f", or put its tables in {user_file()}" if path != user_file() else ""
        print(
            f"warning: ignored {path}: {why}; its setup lines would run in your jobs: make it "
            f"and its folders yours alone (chmod go-w){mine}",
            file=sys.stderr,
        )
    return why is None


def config_files(cwd: Path | None = None) -> tuple[Path | None, Path | None]:
    """The project's file (the nearest mjlab-hpc.toml upward of `cwd` that is read) and the
    user's file; None for either where none is read (`_usable`)."""
    here = (cwd or Path.cwd()).absolute()
    found = (d / PROJECT_FILE for d in (here, *here.parents))
    project = next((p for p in found if os.path.lexists(p) and _usable(p)), None)
    user = user_file()
    return project, user if _usable(user) else None


_TOML_ERRORS = (tomllib.TOMLDecodeError,) if tomllib is not None else ()


def _parse(text: str) -> dict[str, Any]:
    """A TOML text's tables as plain values."""
    return tomllib.loads(text) if tomllib is not None else tomlkit.parse(text).unwrap()


def _load(path: Path) -> dict[str, dict[str, object]]:
    """Read a config file's tables, values by field name; SpecError (exit 2) naming the file,
    table and key of the first thing that is wrong."""
    try:
        text = read_regular(path.resolve(), _LIMIT).decode()  # checked: `_usable`
        data = _parse(text)
    except RecursionError:
        raise SpecError(str(path), "nested too deeply to be a table of flags: fix it") from None
    except (tomlkit.exceptions.ParseError, *_TOML_ERRORS) as exc:
        raise SpecError(str(path), f"not valid TOML ({exc}): fix it there") from None
    except UnicodeDecodeError:
        raise SpecError(str(path), "not UTF-8 text: write it as UTF-8 TOML") from None
    except (OSError, ValueError) as exc:
        raise SpecError(str(path), f"cannot be read ({exc}): fix it or move it aside") from None
    return _tables(path, data)


def _tables(path: Path, data: Mapping[str, Any]) -> dict[str, dict[str, object]]:
    """The tables of a config file's parsed `data`, values by field name (`_load`)."""
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
    files = [(p, _load(p)) for p in (user, project) if p is not None]
    layers = [(Source(p, "defaults"), t["defaults"]) for p, t in files]
    if profile is None:
        return layers
    table = f"profile.{profile}"
    found = [(Source(p, table), t[table]) for p, t in files if table in t]
    if not found:
        names = sorted({k.removeprefix("profile.") for _, t in files for k in t if k != "defaults"})
        where = " and ".join(str(p) for p, _ in files) or (
            f"any config file (none: neither {user_file()} nor a {PROJECT_FILE} upward of here)"
        )
        there = (
            f"the profiles there are: {', '.join(names)}"
            if names
            else "there are none (mjlab-hpc doctor --write-profile NAME writes one)"
        )
        raise SpecError("--profile", f"no profile {profile!r} in {where}; {there}")
    return [*layers, *found]


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


def _plain(value: object) -> object:
    """A spec's value as TOML holds it (None: "none", as the command line spells it)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return "none" if value is None else value


def write_profile(
    path: Path,
    name: str,
    values: Mapping[str, object],
    notes: Sequence[str] = (),
    force: bool = False,
) -> str:
    """Add the table `[profile.NAME]` of `values` (flag names) to the config file `path`.

    The file is made where there is none; what it holds stays as it is, formatting and
    comments included, but an existing profile of that name, which only `force` replaces.
    `notes` become comment lines above the values. Returns what was written for the profile.
    SpecError (nothing written) for a name TOML cannot hold bare, a malformed file, a file
    others can write (it would be ignored), or a profile there without `force`.
    """
    if not _name_ok(name):
        raise SpecError("--write-profile", f"{name!r}: use letters, digits, - and _ only")
    table = tomlkit.table()
    for note in notes:
        table.add(tomlkit.comment(note))
    for key, value in values.items():
        table.add(key, _plain(value))
    shown = tomlkit.document()
    shown.add("profile", tomlkit.table(is_super_table=True))
    shown["profile"].add(name, table)  # type: ignore[union-attr]
    text = tomlkit.dumps(shown).rstrip("\n") + "\n"
    checked = _check(Source(path, f"profile.{name}"), _parse(text)["profile"][name])
    existing = path if os.path.lexists(path) else next(p for p in path.parents if p.exists())
    if (why := _untrusted(existing)) is not None:
        raise SpecError("--write-profile", f"{why}: not written there (it would be ignored)")
    there = os.path.lexists(path)
    tables = _load(path) if there else {"defaults": {}}  # a malformed file: refused, kept
    if f"profile.{name}" in tables and not force:
        raise SpecError(
            "--write-profile",
            f"{path} already has [profile.{name}]: pass --force to replace it, or choose "
            "another name",
        )
    new = _with_profile(path, name, table) if there else text
    expected = {**tables, f"profile.{name}": checked}
    try:
        after = _parse(new)
    except (tomlkit.exceptions.ParseError, *_TOML_ERRORS):
        after = None
    if after is None or _tables(path, after) != expected:
        raise SpecError(
            "--write-profile",
            f"{path} defines profile {name!r} in a way this cannot replace: edit it there",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path.resolve(), new.encode())  # a link of the user's (dotfiles) stays
    return text


def _with_profile(path: Path, name: str, table: Any) -> str:
    """The config file `path` with `[profile.NAME]` set to `table` (in place of one there),
    as text; "" when it holds its profiles in a form tomlkit cannot add to."""
    try:
        doc = tomlkit.parse(read_regular(path.resolve(), _LIMIT).decode())
        if "profile" not in doc:
            doc.add("profile", tomlkit.table(is_super_table=True))
        doc["profile"][name] = table  # type: ignore[index]
        return tomlkit.dumps(doc)
    except (TypeError, ValueError, KeyError, tomlkit.exceptions.TOMLKitError):
        return ""


def site_given(site: Sequence[Setting]) -> dict[str, tuple[object, str]]:
    """The config files' values by field name, with the file and table of each."""
    return {s.key.replace("-", "_"): (s.value, str(s.source)) for s in site}


def origin_lines(origins: Sequence[Origin], site_only: bool = False) -> list[str]:
    """One line per value of a plan that is no built-in default: `key = value  (where)`.

    A config file's value that the run a command continues replaced with its own is said on
    its line. `site_only`: what a submission says on the console: the config files' values
    (`site default: ...`) and those a continued run replaced (`note: ...`).
    """
    out = []
    for o in origins:
        where = {"typed": "typed", "site": o.source, "kept": f"kept from {o.source}"}[o.kind]
        unused = ""
        if o.replaced is not None:
            value, source = o.replaced
            unused = f"{o.key} = {_toml(value)} of {source} is not applied: the run keeps its own"
        line = f"{o.key} = {_toml(o.value)}  ({where}{'; ' * bool(unused)}{unused})"
        if not site_only:
            out.append(line)
        elif o.kind == "site":
            out.append(f"site default: {line}")
        elif unused:
            out.append(f"note: {unused} ({_toml(o.value)}; type --{o.key} to change it)")
    return out

"""Plain data to typed values: the one converter from JSON, TOML and command-line text.

Every file of a run directory (`rundir/`), a config file (`cli/config.py`) and a `--sweep`
value (`validate/sweep.py`) becomes a typed value here, checked against the type it is read
as (a frozen dataclass, a tuple, a Literal, an enum, ...): its type, a number that is finite,
a number in its field's range (`Range`, in the field's `Annotated` hint) and a time that is
no later than now (`EpochS`). A value that does not fit raises `Mismatch`, naming where it is
and what the field takes: a reader leaves that file or line out and names it, so one forged
or torn record never takes down a command that reads many.

The three sources differ only in their leaves: JSON has null, TOML spells it `"none"` (as
the command line does), and command-line text is all strings (`"4"`, `"true"`). Hand-written
because no kept library does this job: pydantic or cattrs would be a new dependency for what
is two pages here, and neither reads TOML's `"none"` or the command line's words.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import re
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Count",
    "EpochS",
    "Mismatch",
    "Mode",
    "NonNegative",
    "Positive",
    "Range",
    "Seconds",
    "describe",
    "fits",
    "load",
    "parse_json",
]

#: Where a value comes from: a JSON file, a TOML file, or command-line text.
Mode = Literal["json", "toml", "text"]

# A time may lie this far ahead of this machine's clock (another node's clock).
_AHEAD_S = 86_400.0


@dataclass(frozen=True)
class Range:
    """The bounds of a number field, in its hint: `Annotated[int, Range(0)]`."""

    low: float | None = None
    """The least value (None: no bound)."""
    high: float | None = None
    """The greatest value (None: no bound)."""
    until_now: bool = False
    """No later than now (and a day's clock skew): a time that has happened."""


# Every number read has an upper bound too: a finite 1e300 or a 400-digit integer in a file
# others can write would overflow a sum, a float or a timedelta of any command reading it.
_MOST = float(2**53)  # the largest whole number a float holds exactly
#: A count, an index or an iteration: a whole number from 0.
Count = typing.Annotated[int, Range(0, _MOST)]
#: A number from 1 (ranks in a world, a pid).
Positive = typing.Annotated[int, Range(1, _MOST)]
#: A duration in seconds, from 0 (at most about 30 years).
Seconds = typing.Annotated[float, Range(0, 1e9)]
#: An amount that is never below 0 (a rate, a length).
NonNegative = typing.Annotated[float, Range(0, 1e15)]
#: A moment in epoch seconds that has happened.
EpochS = typing.Annotated[float, Range(0, until_now=True)]

# Command-line text: plain ASCII numbers only. Python's int() also reads other scripts' digits
# and `1_0`, which would make values that look different and are the same.
_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a path",
}


class Mismatch(ValueError):
    """A value that does not fit the type it is read as."""

    def __init__(self, where: str, value: object, want: str) -> None:
        self.where = where
        self.value = value
        self.want = want
        super().__init__(f"its {where!r} is {_shown(value)}, not {want}")


def _shown(value: object) -> str:
    """The value as its file spells it, cut to 40 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_json(data: bytes | str) -> object:
    """Parse JSON text; ValueError for what is not JSON, NaN and Infinity included.

    Python's json reads NaN and Infinity, which JSON has no words for: no writer of ours
    writes them.
    """

    def refuse(word: str) -> object:
        raise ValueError(f"{word} is no JSON number")

    return json.loads(data, parse_constant=refuse)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def describe(hint: Any, mode: Mode = "json") -> str:
    """Say in words what a value of type `hint` is (`an integer`, `a list of strings`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        base = describe(args[0], mode)
        bounds = next((a for a in args[1:] if isinstance(a, Range)), None)
        if bounds is None:
            return base
        if bounds.until_now:
            return "a time (epoch s) no later than now"
        if bounds.high is None:
            return f"{base} >= {bounds.low:g}"
        if bounds.high == _MOST:
            return f"{base} >= {bounds.low:g} (below 2^53)"
        return f"{base} from {bounds.low:g} to {bounds.high:g}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a, mode) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin is tuple or origin is list or hint in (tuple, list):
        item = describe(args[0], mode).removeprefix("a ").removeprefix("an ") if args else "value"
        return f"a list of {item}s"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in hint)
    if dataclasses.is_dataclass(hint) or origin in (Mapping, dict) or hint is dict:
        return "a JSON object"
    if hint is type(None):
        return "null" if mode == "json" else '"none"'
    return _WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def fits(hint: Any, value: object, mode: Mode = "json") -> bool:
    """Whether `value` is one a field of type `hint` holds."""
    try:
        load(hint, value, mode=mode)
    except Mismatch:
        return False
    return True


def load(hint: Any, value: object, where: str = "value", mode: Mode = "json") -> Any:
    """Return `value` as a field of type `hint` holds it; Mismatch naming `where` if not.

    A dataclass is read from an object of its fields: a null (or missing) field takes its
    default, a field without a default must be there, and keys it does not know are left out.
    Lists become tuples where the hint says tuple. Numbers must be finite and in range.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Annotated:
        got = load(args[0], value, where, mode)
        for bounds in (a for a in args[1:] if isinstance(a, Range)):
            _check_range(bounds, got, where, hint)
        return got
    if origin in (typing.Union, types.UnionType):
        return _union(args, value, where, mode, hint)
    if origin is Literal:
        if any(type(a) is type(value) and a == value for a in args):
            return value
        raise Mismatch(where, value, describe(hint))
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, where, mode)  # type: ignore[arg-type]
    if origin is tuple or hint is tuple:
        return _tuple(args, value, where, mode, hint)
    if origin in (Mapping, dict) or hint is dict:
        if not isinstance(value, dict):
            raise Mismatch(where, value, "a JSON object")
        if not args:
            return dict(value)
        return {str(k): load(args[1], v, f"{where}.{k}", mode) for k, v in value.items()}
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise Mismatch(where, value, "a list")
        if not args:
            return value
        return [load(args[0], v, f"{where}[{i}]", mode) for i, v in enumerate(value)]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except (ValueError, TypeError):
            raise Mismatch(where, value, describe(hint)) from None
    return _leaf(hint, value, where, mode)


def _union(args: tuple[Any, ...], value: object, where: str, mode: Mode, hint: Any) -> Any:
    none = type(None) in args
    if none and value is None and mode == "json":
        return None
    # On the command line `none` is None first, whatever else the field takes (`--x none`).
    if none and mode == "text" and isinstance(value, str) and value.lower() == "none":
        return None
    problems = []
    for option in args:
        try:
            return load(option, value, where, mode)
        except Mismatch as exc:
            problems.append(exc)
    # The first option's words, as a field of one type would say (`not an integer`).
    first = problems[0] if problems else Mismatch(where, value, describe(hint))
    raise first


def _dataclass(cls: type, value: object, where: str, mode: Mode) -> Any:
    if not isinstance(value, dict):
        raise Mismatch(where, value, "a JSON object")
    hints = _hints(cls)
    given = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = value.get(f.name)
        if raw is None:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.init:
                raise Mismatch(f"{where}.{f.name}", raw, describe(hints[f.name]))
            continue  # null: the field's default
        if f.init:
            given[f.name] = load(hints[f.name], raw, f"{where}.{f.name}", mode)
    return cls(**given)


def _tuple(args: tuple[Any, ...], value: object, where: str, mode: Mode, hint: Any) -> Any:
    if not isinstance(value, list | tuple):
        raise Mismatch(where, value, "a list")
    if not args:
        return tuple(value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(load(args[0], v, f"{where}[{i}]", mode) for i, v in enumerate(value))
    if len(args) != len(value):
        raise Mismatch(where, value, f"a list of {len(args)}")
    pairs = enumerate(zip(args, value, strict=True))
    return tuple(load(a, v, f"{where}[{i}]", mode) for i, (a, v) in pairs)


def _leaf(hint: Any, value: object, where: str, mode: Mode) -> Any:
    if mode == "text":
        return _text(hint, value, where)
    if hint is type(None):  # TOML has no null: `none`, as the command line spells it
        if value is None or (mode == "toml" and isinstance(value, str) and value.lower() == "none"):
            return None
        raise Mismatch(where, value, describe(hint, mode))
    if hint is float and type(value) in (int, float):
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:  # an int of 400 digits
            number = math.inf
        if math.isfinite(number):
            return number
    elif hint in (bool, int, str) and type(value) is hint:
        return value
    elif hint is Path and type(value) is str and value:
        return Path(value)
    raise Mismatch(where, value, describe(hint))


def _text(hint: Any, text: object, where: str) -> Any:
    """A leaf of command-line text (`--sweep seed=4`)."""
    if not isinstance(text, str):
        raise Mismatch(where, text, "text")
    if hint is bool and text.lower() in (*_TRUE, *_FALSE):
        return text.lower() in _TRUE
    if hint is int and _INT.fullmatch(text):
        return int(text)
    if hint is float and _FLOAT.fullmatch(text) and math.isfinite(float(text)):
        return float(text)
    if hint is str:
        return text
    if hint is Path and text:
        return Path(text)
    raise Mismatch(where, text, describe(hint))


def _check_range(bounds: Range, value: object, where: str, hint: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    high = bounds.high
    if bounds.until_now:
        high = time.time() + _AHEAD_S
    low_ok = bounds.low is None or value >= bounds.low
    if not low_ok or (high is not None and value > high):
        raise Mismatch(where, value, describe(hint))

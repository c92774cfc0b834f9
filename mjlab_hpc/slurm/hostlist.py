"""Slurm hostlist expressions (`gpu[001-004,010]`) expanded without Slurm, as `scontrol show
hostnames` does (Slurm's `hostlist.c`): groups separated by `,` or white space outside
brackets; brackets of `N` and `N-M` ranges kept in the order written, zero-padded to the
digits of the range's start; several brackets in a name expand as a product in Slurm's order.
Malformed forms Slurm silently mangles (`n[1-]`, `n[ 1]`, a stray `]`) are refused here.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from mjlab_hpc.slurm.client import SlurmClient

__all__ = [
    "MAX_HOSTS",
    "SCONTROL_TIMEOUT_S",
    "SLURM_MAX_RANGE",
    "HostlistError",
    "expand_hostlist",
    "first_host",
]

#: Default cap on the hosts one expression may expand to, so that a typo such as
#: ``n[1-99999]x[1-99999]`` fails fast instead of exhausting memory.
MAX_HOSTS = 1_000_000

#: Slurm rejects a single range, and the values of any bracket that is not the
#: last one in a name, spanning more than this many hosts (``MAX_RANGE`` and
#: ``MAX_PREFIX_CNT`` in ``hostlist.h``); mirrored so both accept the same lists.
SLURM_MAX_RANGE = 64 * 1024

#: Seconds ``first_host`` waits for ``scontrol`` before using the parser.
SCONTROL_TIMEOUT_S = 10.0

# hostlist_create() tokenises on "\t, \n": whitespace separates like a comma.
_SEPARATORS = frozenset(",\t\n ")
# ASCII digits only: str.isdigit() and int() would also take other scripts' digits.
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_BRACKET_RE = re.compile(r"\[([^\]]*)\]")
_MAX_QUOTED = 200


def _quote(expr: str) -> str:
    """Quote ``expr`` for an error message, shortened if huge."""
    if len(expr) <= _MAX_QUOTED:
        return repr(expr)
    return f"{expr[:_MAX_QUOTED]!r}... ({len(expr)} characters)"


class HostlistError(ValueError):
    """A hostlist expression that cannot be expanded.

    ``expr`` is the whole expression and ``reason`` says what is wrong with it.
    """

    def __init__(self, expr: str, reason: str) -> None:
        super().__init__(f"invalid hostlist expression {_quote(expr)}: {reason}")
        self.expr = expr
        self.reason = reason

    def __reduce__(self) -> tuple[type[HostlistError], tuple[str, str]]:
        # Default pickling would call __init__ with the message only; keep it
        # picklable because errors travel back from submitit / multiprocessing.
        return (type(self), (self.expr, self.reason))


class _Range(NamedTuple):
    lo: int
    hi: int
    width: int  # digits of the range's start: Slurm's zero-padding width

    def size(self) -> int:
        return self.hi - self.lo + 1


class _Name(NamedTuple):
    """One group: literal ``texts`` around ``len(texts) - 1`` bracket lists."""

    texts: tuple[str, ...]
    brackets: tuple[tuple[_Range, ...], ...]

    def size(self) -> int:
        total = 1
        for ranges in self.brackets:
            total *= sum(r.size() for r in ranges)
        return total


def _split_groups(expr: str) -> list[str]:
    """Split ``expr`` into groups at separators outside brackets."""
    groups: list[str] = []
    start: int | None = None
    open_at: int | None = None
    for i, ch in enumerate(expr):
        if open_at is None and ch in _SEPARATORS:
            if start is not None:
                groups.append(expr[start:i])
                start = None
            continue
        if start is None:
            start = i
        if ch == "[":
            if open_at is not None:
                raise HostlistError(
                    expr, f"nested '[' at position {i} (the '[' at {open_at} is still open)"
                )
            open_at = i
        elif ch == "]":
            if open_at is None:
                raise HostlistError(expr, f"unbalanced ']' at position {i} has no matching '['")
            open_at = None
        elif ch in "{}":
            raise HostlistError(
                expr,
                f"{ch!r} at position {i}: hostlist functions such as feature{{...}} are "
                "expanded by slurmctld, use scontrol",
            )
    if open_at is not None:
        raise HostlistError(expr, f"unbalanced '[' at position {open_at} has no matching ']'")
    if start is not None:
        groups.append(expr[start:])
    return groups


def _parse_range(expr: str, group: str, item: str) -> _Range:
    """Parse one ``N`` or ``N-M`` item of a bracket list."""
    match = _RANGE_RE.fullmatch(item)
    if match is not None:
        lo = int(match.group(1))
        hi = lo if match.group(2) is None else int(match.group(2))
        if lo <= hi and hi - lo + 1 <= SLURM_MAX_RANGE:
            return _Range(lo, hi, len(match.group(1)))  # valid: no message to build
    # Only an error quotes the group: quoting it for every item made a list of thousands of
    # items (one bracket of a 10,000-node allocation) quadratic.
    where = f"in {_quote(group)}"
    if not item:
        raise HostlistError(expr, f"empty range {where}")
    if match is None:
        if ":" in item:
            reason = f"stepped range {item!r} {where}: Slurm hostlists have no step syntax"
        elif item.startswith("-"):
            reason = f"range {item!r} {where} has no start (negative numbers are not allowed)"
        elif item.endswith("-"):
            reason = f"range {item!r} {where} has no end"
        else:
            reason = f"non-numeric range {item!r} {where}"
        raise HostlistError(expr, reason)
    start, end = match.group(1), match.group(2)
    lo = int(start)
    hi = lo if end is None else int(end)
    if lo > hi:
        raise HostlistError(expr, f"descending range {item!r} {where}: start must not exceed end")
    if hi - lo + 1 > SLURM_MAX_RANGE:
        raise HostlistError(
            expr,
            f"range {item!r} {where} spans {hi - lo + 1} hosts; "
            f"Slurm allows at most {SLURM_MAX_RANGE} per range",
        )
    return _Range(lo, hi, len(start))


def _parse_name(expr: str, group: str) -> _Name:
    """Parse one group (brackets already checked balanced and not nested)."""
    # re.split with one capture group alternates literal text and bracket bodies.
    parts = _BRACKET_RE.split(group)
    texts = tuple(parts[0::2])
    if "" in parts[1::2]:
        raise HostlistError(expr, f"empty brackets '[]' in {group!r}")
    brackets = tuple(
        tuple(_parse_range(expr, group, item) for item in body.split(",")) for body in parts[1::2]
    )
    # Slurm caps the values of every bracket but the last (MAX_PREFIX_CNT).
    for ranges in brackets[:-1]:
        size = sum(r.size() for r in ranges)
        if size > SLURM_MAX_RANGE:
            raise HostlistError(
                expr,
                f"a bracket in {group!r} holds {size} values; Slurm allows at most "
                f"{SLURM_MAX_RANGE} in any bracket but the last",
            )
    return _Name(texts, brackets)


def _check_str(expr: object) -> None:
    if not isinstance(expr, str):
        raise TypeError(f"hostlist expression must be a str, not {type(expr).__name__}")


def _parse(expr: str, max_hosts: int) -> list[_Name]:
    """Parse and validate ``expr`` completely, without expanding it."""
    _check_str(expr)
    names = [_parse_name(expr, group) for group in _split_groups(expr)]
    if not names:
        raise HostlistError(expr, "empty expression (no host names)")
    total = 0
    for name in names:
        total += name.size()
        # Checked before expanding anything so a huge expression costs no memory.
        if total > max_hosts:
            raise HostlistError(expr, f"expands to more than {max_hosts} hosts")
    return names


def _values(ranges: Sequence[_Range]) -> list[str]:
    """The numbers of one bracket, zero-padded like Slurm's ``%0*lu``."""
    return [f"{n:0{r.width}d}" for r in ranges for n in range(r.lo, r.hi + 1)]


def _iter_name(name: _Name) -> Iterator[str]:
    """Hosts of one group in ``scontrol show hostnames`` order."""
    texts, brackets = name.texts, name.brackets
    if not brackets:
        yield texts[0]
        return
    if len(brackets) == 1:  # the common `node[0001-9999]`: no product to build
        prefix, suffix = texts
        yield from (prefix + value + suffix for value in _values(brackets[0]))
        return
    # _push_range_list() in hostlist.c expands the last bracket innermost and
    # the others right to left from the outside in: for b1, b2, b3 the loop nest
    # is b2 (outer), b1, b3 (inner). For two brackets this is plain product order.
    order = [*range(len(brackets) - 2, -1, -1), len(brackets) - 1]
    columns = [_values(brackets[k]) for k in order]
    picks = [""] * len(brackets)
    for combo in itertools.product(*columns):
        for k, value in zip(order, combo, strict=True):
            picks[k] = value
        parts = [texts[0]]
        for value, text in zip(picks, texts[1:], strict=True):
            parts += (value, text)
        yield "".join(parts)


def expand_hostlist(expr: str, *, max_hosts: int = MAX_HOSTS) -> list[str]:
    """Expand a Slurm hostlist expression into host names.

    The result equals the lines of ``scontrol show hostnames EXPR``: order as
    written, duplicates kept. For example ``"gpu[001-002,010],a[1-2]-ib[3-4]"``
    gives ``gpu001, gpu002, gpu010, a1-ib3, a1-ib4, a2-ib3, a2-ib4``.

    With three or more brackets in one name Slurm's order is not the plain
    cartesian product: the last bracket varies fastest, then the first, second,
    ... so ``a[1-2]b[3-4]c[5-6]`` starts ``a1b3c5, a1b3c6, a2b3c5, a2b3c6,
    a1b4c5``.

    Raises:
        HostlistError: the expression is empty or malformed, or expands to more
            than ``max_hosts`` hosts (checked before anything is expanded).
    """
    names = _parse(expr, max_hosts)
    return [host for name in names for host in _iter_name(name)]


def first_host(
    expr: str,
    *,
    scontrol: str | None = "scontrol",
    env: Mapping[str, str] | None = None,
    timeout_s: float = SCONTROL_TIMEOUT_S,
) -> str:
    """First host of a Slurm hostlist expression, e.g. the rendezvous node.

    If ``scontrol`` (a name looked up on ``PATH`` -- ``env["PATH"]`` when ``env``
    is given -- or a path) is found, the answer is the first line of
    ``scontrol show hostnames EXPR`` run with ``env`` as its environment
    (``None``: inherit ours). If it is missing, exits non-zero, prints nothing
    or takes longer than ``timeout_s``, the answer comes from
    :func:`expand_hostlist` instead; ``scontrol=None`` always uses the parser.

    Raises:
        HostlistError: scontrol gave no answer and the parser rejects ``expr``.
    """
    _check_str(expr)
    if scontrol is not None and expr.strip(" ,\t\n"):
        hosts = SlurmClient(env=env, timeout_s=timeout_s).hostnames(expr, scontrol)
        if hosts:
            return hosts[0]
    names = _parse(expr, MAX_HOSTS)
    # Only the first host is needed: validate everything, expand one.
    return next(_iter_name(names[0]))

"""Render docs/reference.md, the flags of every command, from the spec dataclasses.

The source is the one tyro reads for `--help`: each field of `TrainSpec`, `SubmitSpec` and the
`mjlab-hpc` subcommands' dataclasses, with its default and the first sentence of its docstring.
`python tools/flag_reference.py` rewrites the page; `--check` exits 1 when the page is not what
the code renders now (tests/test_docs.py does the same).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import typing
from pathlib import Path

import tyro

from mjlab_hpc.cli import hpc
from mjlab_hpc.spec import SubmitSpec, TrainSpec

__all__ = ["PAGE", "render"]

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"

HEADER = """\
# Flag reference

Generated from the code by `python tools/flag_reference.py` (the field docstrings that
`--help` shows); `tests/test_docs.py` fails when this page is out of date. Each command's
`--help` has the full text. Booleans also take mjlab's spelling (`--video True`).
"""

# The mjlab-hpc subcommands, in the order of their help.
SUBCOMMANDS = (
    ("list-tasks", hpc.ListTasks),
    ("render", hpc.Render),
    ("run-dir", hpc.RunDirCommand),
    ("status", hpc.Status),
    ("logs", hpc.Logs),
    ("cancel", hpc.Cancel),
    ("doctor", hpc.Doctor),
    ("plot", hpc.Plot),
    ("report", hpc.Report),
    ("heal", hpc.Heal),
)
# A spec nested without a prefix is one row that links its own table.
NESTED = {
    TrainSpec: "every flag of [mjlab-train](#mjlab-train)",
    SubmitSpec: "every flag of [mjlab-submit](#mjlab-submit)",
}
ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|etc)\.$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right after its annotation), as tyro reads it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _code_spans(text: str) -> str:
    """Paths with `<placeholders>` as code, so that markdown does not take them for HTML."""

    def span(token: str) -> str:
        if "<" not in token or ">" not in token or "`" in token:
            return token
        lead = token[: len(token) - len(token.lstrip("("))]
        core = token[len(lead) :]
        while core[-1] in "),;:" or (core.endswith(".") and not core.endswith("...")):
            core = core[:-1]
        return f"{lead}`{core}`{token[len(lead) + len(core) :]}"

    return " ".join(span(t) for t in text.split(" "))


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not one inside `e.g.`)."""
    for match in re.finditer(r"[.!?](?=\s+[A-Z`]|$)", text):
        if not ABBREVIATIONS.search(text[: match.end()]):
            return text[: match.end()]
    return text


def cell(doc: str | None) -> str:
    """A docstring's first sentence, as a table cell."""
    return _code_spans(first_sentence(" ".join((doc or "").split()))).replace("|", "\\|")


def _unwrap(annotation: object) -> tuple[object, tuple[object, ...]]:
    """A field's type and its Annotated metadata."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extras = typing.get_args(annotation)
        return base, tuple(extras)
    return annotation, ()


def _default(f: dataclasses.Field[object]) -> str:
    """A field's default as the table shows it ("-" for an empty one)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value in ((), ""):
        return "-"
    return f"`{value}`"


def rows(cls: type) -> list[str]:
    """One table row per flag of `cls`; a nested spec is one row that links its table."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        base, extras = _unwrap(hints[f.name])
        if tyro.conf.Suppress in extras:
            continue
        if base in NESTED:
            out.append(f"| {NESTED[base]} | | |")
            continue
        dashed = f.name.replace("_", "-")
        if tyro.conf.Positional in extras:
            metavar = next((e.metavar for e in extras if getattr(e, "metavar", None)), None)
            flag = f"`{metavar or f.name.upper()}`".replace("|", "\\|")
        elif base is bool and f.default is True:
            flag = f"`--{dashed}`, `--no-{dashed}`"
        else:
            flag = f"`--{dashed}`"
        out.append(f"| {flag} | {_default(f)} | {cell(docs.get(f.name))} |")
    return out


def _table(cls: type) -> list[str]:
    """The flags of `cls` as a table (none for a command without flags)."""
    body = rows(cls)
    return ["| flag | default | what |", "|---|---|---|", *body] if body else []


def render() -> str:
    """The whole page."""
    lines = [HEADER]
    lines += ["## mjlab-train", "", "`mjlab-train TASK [flags] [--env.* ...] [--agent.* ...]`", ""]
    lines += [*_table(TrainSpec), ""]
    lines += ["## mjlab-submit", "", "`mjlab-submit TASK [flags]`", ""]
    lines += [*_table(SubmitSpec), ""]
    lines += ["## mjlab-hpc", ""]
    for name, cls in SUBCOMMANDS:
        lines += [f"### {name}", "", cell(cls.__doc__), ""]
        table = _table(cls)
        if table:
            lines += [*table, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    """Write the page, or with --check say whether it is current."""
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/flag_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

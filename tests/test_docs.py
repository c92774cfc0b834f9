"""The docs: the flag reference is what the code renders now, README and docs stay within their
word limits, every relative link and anchor resolves, and no path of one machine appears."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

sys.path.insert(0, str(ROOT / "tools"))
import flag_reference  # noqa: E402  (tools/ is not a package)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def words(path: Path) -> int:
    """Words as `wc -w` counts them."""
    return len(path.read_text().split())


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in CODE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_reference_is_what_the_code_renders() -> None:
    rendered = flag_reference.render()
    assert flag_reference.PAGE.read_text() == rendered, (
        "docs/reference.md is out of date: run python tools/flag_reference.py"
    )


def test_reference_names_every_flag() -> None:
    text = flag_reference.PAGE.read_text()
    for cls in (flag_reference.TrainSpec, flag_reference.SubmitSpec):
        for name in cls.__dataclass_fields__:
            if name not in ("task", "train", "overrides"):
                assert f"`--{name.replace('_', '-')}`" in text, name
    for name, _ in flag_reference.SUBCOMMANDS:
        assert f"### {name}\n" in text, name


def test_word_limits() -> None:
    readme = words(ROOT / "README.md")
    total = sum(words(p) for p in PAGES)
    assert readme <= 1500, f"README.md has {readme} words (at most 1,500)"
    assert total <= 15000, f"README.md and docs/*.md have {total} words (at most 15,000)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_machine_specific_paths(page: Path) -> None:
    found = re.findall(r"(?<![\w.~$])/(?:home|Users|work|root|mnt|scratch)/\S*", page.read_text())
    assert not found, f"{page.name}: {found}"

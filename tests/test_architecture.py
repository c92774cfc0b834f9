"""The package's shape, checked from its source: imports flow one way between layers, no
import cycle (function-level imports included), a docstring and `__all__` on every module,
and `import mjlab_hpc` and the CLIs stay light. Sizes are not checked: a file is split where
its parts have different readers, not to pass a count."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mjlab_hpc"

# Layers, bottom up: a module may import its own subpackage and any lower layer, nothing else.
LAYERS = {
    "errors": 0,
    "procs": 1,
    "console": 1,
    "convert": 1,
    "spec": 2,
    "slurm": 3,
    "tasks": 3,
    "rundir": 3,
    "rank": 4,
    "validate": 5,
    "launch": 6,
    "ops": 7,
    "cli": 8,
}
# The public facade sits above everything.
FACADES = {"mjlab_hpc"}
# Imports of our own modules inside functions: only where loading them at the top would
# defeat their purpose (heavy code that a light command must not load).
LAZY_ALLOWED = {
    ("mjlab_hpc.rank", "mjlab_hpc.rank.train"),  # the submitter pickles RankJob: no torch
    ("mjlab_hpc.cli.train", "mjlab_hpc.rank.train"),  # bad input is refused before torch loads
    ("mjlab_hpc.cli.train", "mjlab_hpc.rank.stop"),
    ("mjlab_hpc.cli.train", "mjlab_hpc.rank.preflight"),
    ("mjlab_hpc.cli.hpc", "mjlab_hpc.ops.plot"),  # tensorboard, matplotlib
    ("mjlab_hpc.tasks.builtin", "mjlab_hpc.tasks.cartpole"),  # environments: torch, warp
    ("mjlab_hpc.tasks.builtin", "mjlab_hpc.tasks.ant"),
    ("mjlab_hpc.tasks.mjlab", "mjlab_hpc.tasks.envstate"),
}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(name: str, path: Path) -> Iterator[tuple[str, bool]]:
    """(imported mjlab_hpc module, imported inside a function) for every import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    known = {m for m, _ in modules()}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from mjlab_hpc.rundir import record` imports the module mjlab_hpc.rundir.record.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in targets:
            if target == "mjlab_hpc" or target.startswith("mjlab_hpc."):
                yield target, id(node) in nested


def layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1]
    return top, LAYERS[top]


def test_every_top_level_module_has_a_layer() -> None:
    tops = {m.split(".")[1] for m, _ in modules() if m not in FACADES}
    assert tops == set(LAYERS), tops ^ set(LAYERS)


def test_imports_flow_down_the_layers() -> None:
    wrong = []
    for name, path in modules():
        if name in FACADES:
            continue
        here, level = layer(name)
        for target, _ in imports_of(name, path):
            if target in FACADES:
                wrong.append(f"{name} imports the facade {target}")
                continue
            there, other = layer(target)
            if there != here and other >= level:
                wrong.append(f"{name} (layer {level}) imports {target} (layer {other})")
    assert not wrong, "\n".join(wrong)


def test_own_modules_are_imported_at_the_top() -> None:
    lazy = {
        (name, target)
        for name, path in modules()
        for target, nested in imports_of(name, path)
        if nested
    }
    assert lazy <= LAZY_ALLOWED, sorted(lazy - LAZY_ALLOWED)


def test_no_import_cycle() -> None:
    graph = {name: {t for t, _ in imports_of(name, path) if t != name} for name, path in modules()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend([*stack[stack.index(nxt) :], nxt] if nxt in stack else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, [*stack, nxt]):
                return True
        state[node] = 2
        return False

    for node in sorted(graph):
        if state.get(node) is None and visit(node, [node]):
            break
    assert not cycle, " -> ".join(cycle)


def test_every_module_has_a_docstring_and_public_modules_an_all() -> None:
    missing_doc, missing_all = [], []
    for name, path in modules():
        tree = ast.parse(path.read_text())
        if ast.get_docstring(tree) is None:
            missing_doc.append(name)
        is_init = path.name == "__init__.py"
        defines = any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n in tree.body)
        has_all = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", None) == "__all__" for t in n.targets)
            for n in tree.body
        )
        if (
            (defines or (is_init and len(tree.body) > 1))
            and not has_all
            and path.name != "__main__.py"
        ):
            missing_all.append(name)
    assert not missing_doc, missing_doc
    assert not missing_all, missing_all


@pytest.mark.parametrize(
    "code",
    [
        "import mjlab_hpc",
        "import mjlab_hpc.cli.hpc, mjlab_hpc.cli.train, mjlab_hpc.cli.submit",
        "import mjlab_hpc.ops.status, mjlab_hpc.launch.submit",
    ],
)
def test_light_imports(code: str) -> None:
    """The commands parse and validate before torch, warp, rsl-rl or mjlab load."""
    heavy = {"torch", "warp", "mujoco", "mujoco_warp", "rsl_rl", "mjlab", "matplotlib"}
    probe = (
        f"{code}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_public_api() -> None:
    import mjlab_hpc

    assert set(mjlab_hpc.__all__) == {*mjlab_hpc._EXPORTS, "__version__"}
    for name in mjlab_hpc.__all__:
        assert getattr(mjlab_hpc, name) is not None, name
    assert mjlab_hpc.TrainSpec().task == "cartpole"
    assert mjlab_hpc.resolve(mjlab_hpc.TrainSpec()).num_envs == 64
    with pytest.raises(AttributeError):
        _ = mjlab_hpc.no_such_name


def test_formatting_is_ruffs() -> None:
    """The code is formatted as ruff formats it: no `# fmt: skip` keeps a line squeezed."""
    root = PACKAGE.parent
    skips = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("mjlab_hpc", "tests", "benchmarks", "tools")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    ]
    assert len(skips) <= 5, f"{len(skips)} lines skip ruff's formatting: {skips}"
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.fail(f"ruff is not installed beside {sys.executable}: make install")
    found = subprocess.run(
        [str(ruff), "format", "--check", "--quiet", "."], cwd=root, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout + found.stderr

"""The code a run runs: a copy of the git repository that mjlab-submit was run from.

The copy is taken at submit time; the repository is the user's task package, or mjlab_hpc
itself when developing it. `plan_snapshot` decides what would be copied (git's tracked files
and the untracked ones it does not ignore) and refuses a repository too large to copy per
job, before anything is made. `write_snapshot` copies it into `<run>/code/src/` and records
it. Every rank of the job and of all its requeues puts the copy's import roots first on
PYTHONPATH (`import_path`), ahead of an editable install of the same package, so editing the
checkout after submitting changes nothing in the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError
from mjlab_hpc.procs import run_command
from mjlab_hpc.rundir.durable import read_regular, write_atomic, write_json_atomic
from mjlab_hpc.rundir.layout import (
    CODE_COPY,
    CODE_DIFF,
    CODE_DIR,
    SNAPSHOT_RECORD,
    read_element,
)
from mjlab_hpc.rundir.record import now_iso

__all__ = [
    "MAX_BYTES",
    "MAX_FILES",
    "Snapshot",
    "code_record",
    "import_path",
    "imported_from",
    "plan_snapshot",
    "planned_record",
    "read_snapshot",
    "record_code",
    "snapshot_for",
    "with_snapshot",
    "write_code_record",
    "write_snapshot",
]

#: Above these a repository holds data, not code: copying it per job is refused.
MAX_BYTES = 200 * 1024 * 1024
MAX_FILES = 20_000


@dataclass(frozen=True)
class Snapshot:
    """What a submission's snapshot copies (decided before anything is made)."""

    root: Path
    """The repository's top folder."""
    commit: str | None
    """HEAD (None in a repository without commits)."""
    files: tuple[str, ...]
    """Paths relative to `root`: tracked files that exist, and untracked ones git does not
    ignore."""
    untracked: tuple[str, ...]
    size: int
    """Bytes of all files."""
    roots: tuple[str, ...]
    """Folders (relative to `root`) the running interpreter imports from: where an editable
    install points, else the top folder and `src/`."""


def _git(root: Path, *args: str) -> str | None:
    proc = run_command(["git", "-C", str(root), *args], timeout_s=60)
    if proc is None or proc.returncode != 0:
        return None
    return proc.stdout


def _import_roots(root: Path, files: Sequence[str]) -> tuple[str, ...]:
    """Return the folders of `root` this interpreter imports packages from.

    They are sys.path entries (an old-style editable install's .pth) and the folders
    setuptools' editable finders map packages to; the top folder and `src/` when there is
    neither. Only folders the copy holds (`files`, relative to `root`) count: a virtual
    environment inside the repository that git ignores is on sys.path too, and would stand
    in for the user's code.
    """
    found: list[str] = []
    copied = {str(Path(f).parent) for f in files}
    folders = {str(p) for f in copied for p in (Path(f), *Path(f).parents)}

    def add(path: str | os.PathLike[str]) -> None:
        # sys.path also holds path-hook names (setuptools' editable finder): folders only.
        if not Path(path).is_absolute() or not Path(path).is_dir():
            return
        try:
            rel = Path(path).resolve().relative_to(root)
        except (ValueError, OSError):
            return
        if str(rel) in folders and str(rel) not in found:
            found.append(str(rel))

    for entry in sys.path:
        if entry:
            add(entry)
    for name, module in list(sys.modules.items()):
        mapping = getattr(module, "MAPPING", None)
        if name.startswith("__editable__") and isinstance(mapping, dict):
            for target in mapping.values():
                add(Path(target).parent)
    if not found:
        found = ["."] + (["src"] if (root / "src").is_dir() else [])
    return tuple(found)


def plan_snapshot(cwd: Path, off: bool = False) -> Snapshot | str:
    """Plan the snapshot of the git repository holding `cwd`, or say why there is none.

    There is none outside a git repository, without git, or when `off` (--no-snapshot). A
    repository too large to copy raises SpecError naming --no-snapshot.
    """
    if off:
        return "--no-snapshot: the job runs the code as it is when it starts"
    top = _git(cwd, "rev-parse", "--show-toplevel")
    if top is None:
        return "not in a git repository (or git is not installed)"
    root = Path(top.strip()).resolve()
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    others = _git(root, "ls-files", "-z", "--others", "--exclude-standard")
    if listed is None or others is None:
        return f"git could not list the files of {root}"
    files, size = [], 0
    for rel in dict.fromkeys(p for p in listed.split("\0") if p):
        path = root / rel
        if path.is_symlink():
            files.append(rel)
        elif path.is_file():  # a deleted tracked file, or a submodule (a folder): skipped
            files.append(rel)
            size += path.stat().st_size
    if size > MAX_BYTES or len(files) > MAX_FILES:
        raise SpecError(
            "--no-snapshot",
            f"the repository {root} holds {len(files)} files, {size / 2**20:.0f} MiB not "
            f"ignored by git (at most {MAX_FILES} files, {MAX_BYTES // 2**20} MiB are copied "
            "per job): add data to .gitignore, or submit with --no-snapshot",
        )
    commit = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    return Snapshot(
        root=root,
        commit=commit.strip() if commit else None,
        files=tuple(files),
        untracked=tuple(p for p in others.split("\0") if p),
        size=size,
        roots=_import_roots(root, files),
    )


def write_snapshot(plan: Snapshot, dest: Path) -> dict[str, Any]:
    """Copy the planned files into `dest/code/src` and record them; the record.

    `code/snapshot.json` records the repository, commit, whether it was dirty and the files;
    `code/changes.diff` holds the uncommitted changes.
    """
    code = dest / CODE_DIR
    src = _free_copy(dest)
    for rel in plan.files:
        source, target = plan.root / rel, src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    diff = _git(plan.root, "diff", "--binary", "HEAD") if plan.commit else None
    if diff:
        write_atomic(code / CODE_DIFF, diff.encode())
    record = {
        "repository": str(plan.root),
        "commit": plan.commit,
        "dirty": bool(diff) or bool(plan.untracked) or plan.commit is None,
        "diff": CODE_DIFF if diff else None,
        "untracked": list(plan.untracked),
        "files": len(plan.files),
        "bytes": plan.size,
        "copy": str(src),
        "import_roots": list(plan.roots),
        "taken_at": now_iso(),
    }
    write_code_record(dest, record)
    return record


def _free_copy(dest: Path) -> Path:
    """Where the next copy of the code goes in a run (or sweep) directory: `code/src`, or
    `code/src-2`, ... in a resumed run, whose earlier copy stays for the earlier job's
    requeues."""
    code = dest / CODE_DIR
    src, n = code / CODE_COPY, 1
    while src.exists():
        n += 1
        src = code / f"{CODE_COPY}-{n}"
    return src


def write_code_record(dest: Path, record: dict[str, Any]) -> None:
    """Write a code record into a run (or sweep) directory's `code/` folder."""
    (dest / CODE_DIR).mkdir(parents=True, exist_ok=True)
    write_json_atomic(dest / CODE_DIR / SNAPSHOT_RECORD, record)


def read_snapshot(folder: Path) -> dict[str, Any] | None:
    """The snapshot record of a run (or sweep) directory, None without one."""
    try:
        return dict(json.loads(read_regular(folder / CODE_DIR / SNAPSHOT_RECORD)))
    except (OSError, ValueError, TypeError):
        return None


def import_path(record: dict[str, Any]) -> str:
    """The PYTHONPATH entries (joined by ':') that make a process import the copy first."""
    copy = Path(record["copy"])
    return os.pathsep.join(str((copy / r).resolve()) for r in record.get("import_roots", ["."]))


def code_record(run_dir: Path) -> dict[str, Any] | None:
    """Return what the submission recorded about the run's code.

    That is the run's own record, or its sweep's (one copy for all elements); None for runs
    that mjlab-submit did not start.
    """
    own = read_snapshot(run_dir)
    if own is not None:
        return own
    element = read_element(run_dir)
    return read_snapshot(element.sweep_dir) if element is not None else None


def snapshot_for(run_dir: Path) -> dict[str, Any] | None:
    """The snapshot a run runs from, None when it runs the code as it is."""
    record = code_record(run_dir)
    return record if record is not None and record.get("copy") else None


def record_code(plan: Snapshot | str, dest: Path) -> dict[str, Any]:
    """Write the snapshot into `dest` (a run or sweep directory); the record.

    When `plan` is a reason, not a snapshot, the record says why there is none.
    """
    if isinstance(plan, Snapshot):
        return write_snapshot(plan, dest)
    record = {"copy": None, "why": plan, "taken_at": now_iso()}
    write_code_record(dest, record)
    return record


def imported_from(record: dict[str, Any] | None) -> dict[str, str]:
    """Return where this process imported the top-level packages that the snapshot holds.

    Each is a folder inside the copy, or the path it came from instead (the copy was not
    used for it).
    """
    if record is None or not record.get("copy"):
        return {}
    copy = Path(record["copy"]).resolve()
    names: dict[str, str] = {}
    for root in record.get("import_roots", ["."]):
        folder = copy / root
        with contextlib.suppress(OSError):
            for entry in folder.iterdir():
                name = entry.stem if entry.suffix == ".py" else entry.name
                if entry.suffix == ".py" or (entry / "__init__.py").is_file():
                    names.setdefault(name, "")
    for name in names:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where:  # a package: its folder; a module: its file
            path = Path(where)
            names[name] = str(path.parent if path.name == "__init__.py" else path)
    return {n: w for n, w in sorted(names.items()) if w}


def planned_record(plan: Snapshot | str, dest: Path) -> dict[str, Any] | None:
    """Return what `record_code(plan, dest)` would record about the copy, without copying.

    Dry runs show it: the script holds the import roots the job will have. None without a
    snapshot.
    """
    if isinstance(plan, str):
        return None
    return {"copy": str(_free_copy(dest)), "import_roots": list(plan.roots)}


def with_snapshot(env: dict[str, str], record: dict[str, Any] | None) -> dict[str, str]:
    """Return `env` with the snapshot's import roots first on PYTHONPATH (unchanged without).

    PYTHONSAFEPATH is set too: `python -m` (how submitit starts ranks) would otherwise put
    the working directory, the checkout itself when submitted from it, ahead of PYTHONPATH.
    """
    if record is None:
        return env
    before = env.get("PYTHONPATH", "")
    return {
        **env,
        "PYTHONPATH": import_path(record) + (os.pathsep + before if before else ""),
        "PYTHONSAFEPATH": "1",
    }

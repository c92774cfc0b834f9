"""What `mjlab-hpc doctor` runs on every task of its probe job: this node's Python and what it
imports, the GPUs it is given, and whether it sees the submitting host's token in the log root.

Started as `python -m mjlab_hpc.ops.probe DIR [--mjlab]` by the probe job's srun step. It
writes `DIR/task<rank>.json` (the doctor reads it on the submitting host) and never raises:
an import that fails is reported, not fatal. Only the standard library is imported at the
top, so that a node whose environment is broken can still say how.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

__all__ = ["TOKEN_FILE", "Check", "Result", "main", "probe", "read_probe"]

Result = Literal["ok", "warn", "fail", "skip"]

#: The token the submitting host writes into the probe folder before submitting.
TOKEN_FILE = "token"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    """What was checked."""
    result: Result
    detail: str
    """What was found."""
    fix: str = ""
    """What to do when it is not ok."""


def _try_import(name: str) -> dict[str, Any]:
    """Import a module; its version and file, or the error's last line."""
    try:
        __import__(name)
    except BaseException as exc:  # a broken install raises anything, SystemExit included
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {"ok": False, "error": last[:500]}
    top = sys.modules[name.split(".")[0]]
    return {
        "ok": True,
        "version": str(getattr(top, "__version__", "")),
        "file": str(getattr(top, "__file__", "")),
    }


def _gpus() -> dict[str, Any]:
    """The GPUs Slurm gave this task and those torch can use."""
    out: dict[str, Any] = {
        name: os.environ.get(name)
        for name in (
            "CUDA_VISIBLE_DEVICES",
            "SLURM_STEP_GPUS",
            "SLURM_JOB_GPUS",
            "SLURM_GPUS_ON_NODE",
        )
    }
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["torch_devices"] = torch.cuda.device_count() if torch.version.cuda else 0
    except BaseException as exc:
        out["torch_error"] = str(exc)[:300]
    return out


def probe(folder: Path, mjlab: bool) -> dict[str, Any]:
    """What this task found (see the module docstring)."""
    try:
        token = (folder / TOKEN_FILE).read_text().strip()
    except OSError:
        token = None
    info: dict[str, Any] = {
        "rank": int(os.environ.get("SLURM_PROCID", "0") or 0),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "token": token,
        "folder": os.path.realpath(folder),
        # What a rank imports: torch, warp, rsl-rl and our rank code.
        "mjlab_hpc": _try_import("mjlab_hpc.rank.train"),
        "gpus": _gpus(),
    }
    if mjlab:
        info["mjlab"] = _try_import("mjlab.tasks")
    return info


# --- on the submitting host: what the tasks' files say -------------------------------------


def _version() -> str:
    """This host's mjlab-hpc version, as the nodes' `mjlab_hpc.__version__` reports theirs."""
    try:
        return version("mjlab-hpc")
    except PackageNotFoundError:
        return "0+unknown"


def _read_tasks(folder: Path) -> dict[int, dict[str, Any]]:
    tasks = {}
    for path in folder.glob("task*.json"):
        try:
            tasks[int(path.stem[4:])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return tasks


def _shared(folder: Path, nodes: list[str], tasks: dict[int, dict[str, Any]]) -> Check:
    """Whether this host and every node read each other's writes in the log root."""
    shells = {p.name: p.read_text().split() for p in folder.glob("shell-*")}
    if not shells:
        return Check(
            "log root shared",
            "fail",
            f"no task's note reached {folder.parent.parent} as this host sees it: the nodes "
            f"({','.join(nodes) or '?'}) see a different folder there",
            "give --log-root a shared filesystem that the nodes mount at the same path (not "
            "/tmp or node-local /scratch); ask your admins which one",
        )
    token = (folder / TOKEN_FILE).read_text().strip()
    problems = []
    blind = sorted({w[0] for w in shells.values() if len(w) < 2 or w[1] != token})
    if blind:
        problems.append(f"nodes that do not see this host's writes: {', '.join(blind)}")
    silent = sorted(set(nodes) - {w[0] for w in shells.values() if w})
    if silent:
        problems.append(f"nodes whose writes this host does not see: {', '.join(silent)}")
    for path in folder.glob("seen-*"):
        if (seen := len(path.read_text().split())) < len(shells):
            problems.append(f"task {path.name[5:]} saw {seen} of {len(shells)} notes")
    if problems:
        return Check(
            "log root shared",
            "fail",
            "; ".join(problems),
            "give --log-root a filesystem every node mounts at the same path",
        )
    hosts = len({w[0] for w in shells.values() if w})
    seen = f"{len(shells)} task(s) on {hosts} node(s) and this host read each other's writes"
    # The writes went through, so the same path works everywhere; a different real path (a
    # symbolic link on one side, an automounter) is worth knowing, not a failure.
    here = str(folder.resolve())
    other = sorted({str(t.get("folder")) for t in tasks.values() if t.get("folder")} - {here})
    if other:
        return Check(
            "log root shared",
            "warn",
            f"{seen}; its real path is {other[0]} on a node, {here} here",
            "fine as long as the path resolves the same way on every node",
        )
    return Check("log root shared", "ok", seen)


def _python(folder: Path, ranks: int, tasks: dict[int, dict[str, Any]], mjlab: bool) -> list[Check]:
    """The nodes' Python, mjlab_hpc (and mjlab) against this host's."""
    out = []
    here, ours = ".".join(map(str, sys.version_info[:3])), _version()
    missing = sorted(set(range(ranks)) - set(tasks))
    if missing:
        errs = [
            (folder / f"py-{r}.err").read_text(errors="replace").strip()
            for r in missing
            if (folder / f"py-{r}.err").is_file()
        ]
        said = next((e.splitlines()[-1] for e in errs if e), "no output")
        out.append(
            Check(
                "Python on nodes",
                "fail",
                f"tasks {missing[:8]} could not run {sys.executable}: {said}",
                "install the same environment on the nodes at the same path (a shared "
                "filesystem), or activate it with --setup",
            )
        )
    versions = {t.get("python_version") for t in tasks.values()}
    if tasks and versions != {here}:
        out.append(
            Check(
                "Python on nodes",
                "fail",
                f"Python {sorted(map(str, versions))} there, {here} here",
                "use the same interpreter on the nodes (--setup to activate it)",
            )
        )
    elif tasks and not missing:
        out.append(Check("Python on nodes", "ok", f"{sys.executable} ({here}) on every task"))
    for name in ("mjlab_hpc", "mjlab")[: 1 + int(mjlab)]:
        if not tasks:
            continue
        bad = [
            (r, t.get(name, {})) for r, t in sorted(tasks.items()) if not t.get(name, {}).get("ok")
        ]
        versions = {str(t[name].get("version")) for t in tasks.values() if t.get(name)}
        extra = "'mjlab-hpc[mjlab]'" if name == "mjlab" else "the same mjlab-hpc"
        if bad:
            out.append(
                Check(
                    f"{name} on nodes",
                    "fail",
                    f"task {bad[0][0]}: {bad[0][1].get('error', 'not reported')}",
                    f"pip install {extra} in the nodes' environment",
                )
            )
        elif name == "mjlab_hpc" and versions != {ours}:
            out.append(
                Check(
                    "mjlab_hpc on nodes",
                    "fail",
                    f"version {sorted(versions)} there, {ours} here",
                    "install the same version on both",
                )
            )
        else:
            what = f"{ours} and the rank code's imports" if name == "mjlab_hpc" else "imports"
            out.append(Check(f"{name} on nodes", "ok", what))
    return out


def _gpus_check(gpus_per_node: int, tasks: dict[int, dict[str, Any]]) -> Check:
    """Every task sees GPUs from Slurm, and torch can use them."""
    if gpus_per_node == 0:
        return Check("GPUs", "skip", "CPU ranks (--gpus-per-node 0)")
    problems, counts = [], []
    # The count: the node's tasks together must see the GPUs asked for (each task sees all of
    # its node's GPUs, or its own one with a per-task binding, where Slurm may number each
    # task's GPU 0: then the GPUs Slurm names for the step or job on that node count).
    seen: dict[str, set[str]] = {}
    for rank, info in sorted(tasks.items()):
        gpus = info.get("gpus", {})
        visible = [g for g in (gpus.get("CUDA_VISIBLE_DEVICES") or "").split(",") if g]
        given = gpus.get("SLURM_STEP_GPUS") or gpus.get("SLURM_JOB_GPUS") or ""
        physical = {f"slurm:{g}" for g in given.split(",") if g}
        seen.setdefault(str(info.get("node")), set()).update(physical or visible)
        if not visible:
            problems.append(f"task {rank} on {info.get('node')}: Slurm set no CUDA_VISIBLE_DEVICES")
        elif not gpus.get("torch_devices"):
            why = gpus.get("torch_error") or (
                "a CPU build of torch" if not gpus.get("torch_cuda") else "no driver answers"
            )
            problems.append(
                f"task {rank} on {info.get('node')}: torch sees no GPU ({why}); "
                f"Slurm gave {','.join(visible)}; the ranks would train on CPU"
            )
        elif int(gpus["torch_devices"]) < len(visible):
            counts.append(
                f"task on {info.get('node')}: torch sees {gpus['torch_devices']} of the "
                f"{len(visible)} GPU(s) Slurm gave it"
            )
    if problems:
        return Check(
            "GPUs",
            "fail",
            "; ".join(problems[:4]),
            "install torch's CUDA build on the nodes (make install GPU=1), or ask "
            "your admins about the partition's GPU gres",
        )
    short = {node: len(ids) for node, ids in seen.items() if len(ids) < gpus_per_node}
    if short:
        counts.insert(
            0,
            ", ".join(f"{node}: {n}" for node, n in sorted(short.items()))
            + f" GPU(s) visible to the node's tasks, {gpus_per_node} per node asked for",
        )
    if counts:
        return Check(
            "GPUs",
            "fail",
            "; ".join(counts[:4]),
            "ask for what the partition's nodes have (scontrol show partition; sinfo -o "
            "'%P %G'), or ask your admins why Slurm hides GPUs (gres.conf, cgroups)",
        )
    return Check("GPUs", "ok", f"every task sees its GPU(s), {gpus_per_node} per node")


def read_probe(
    folder: Path, nodes: list[str], ranks: int, gpus_per_node: int, mjlab: bool
) -> list[Check]:
    """What the shape probe's files in `folder` say, read on the submitting host: the shared
    log root, the nodes' Python and imports, and their GPUs."""
    tasks = _read_tasks(folder)
    shared = _shared(folder, nodes, tasks)
    if shared.result == "fail" and not tasks:
        return [shared]
    return [shared, *_python(folder, ranks, tasks, mjlab), _gpus_check(gpus_per_node, tasks)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the probe (one per task)."""
    args = list(sys.argv[1:] if argv is None else argv)
    folder = Path(args[0])
    info = probe(folder, "--mjlab" in args[1:])
    target = folder / f"task{info['rank']}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

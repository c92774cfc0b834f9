"""What a command that continues a run means: every setting of the run it does not name is
the run's (from run.json), and what it names of where the run is (its experiment, run name, log
root) must be where the run is. `world.continue_target` then compares what it names with the
run, and says each change or refuses it (docs/preemption.md, "What a continuation may change").

Only the CLIs know what a command named (its arguments, `named_flags`): the specs hold every
field, given or default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mjlab_hpc.errors import DamagedRecord, SpecError
from mjlab_hpc.rundir.layout import latest_run
from mjlab_hpc.rundir.state import read_record
from mjlab_hpc.spec import SubmitSpec, TrainSpec
from mjlab_hpc.validate.rules import resolve

__all__ = ["continued", "named_flags", "override_values"]

S = TypeVar("S", TrainSpec, SubmitSpec)

#: How one start of a run begins, never taken from the run.
_THIS_START = frozenset(
    ("run_dir", "resume", "restart_from_scratch", "fresh_envs", "wandb_run_path",
     "wandb_checkpoint_name", "torchrunx_log_dir")
)  # fmt: skip
#: What names the number of ranks, by command.
_WORLD = {TrainSpec: ("num_procs", "gpu_ids"),
          SubmitSpec: ("nodes", "tasks_per_node", "gpus_per_node")}  # fmt: skip


def _fields(cls: type) -> set[str]:
    names = set()
    for f in dataclasses.fields(cls):
        if f.name == "train" and cls is SubmitSpec:
            names |= _fields(TrainSpec)  # its flags carry no prefix
        else:
            names.add(f.name)
    return names


def named_flags(spec: TrainSpec | SubmitSpec, argv: Sequence[str]) -> frozenset[str]:
    """The fields a command's arguments name (`--max-iterations 3`, `--no-video`,
    `--save_interval=2`; `task` when TASK is given; `overrides` are named by themselves)."""
    fields = _fields(type(spec))
    train = spec.train if isinstance(spec, SubmitSpec) else spec
    named = {"task"} if train.task in argv else set()
    for arg in argv:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0].replace("-", "_")
        name = name[3:] if name.startswith("no_") and name[3:] in fields else name
        if name in fields:
            named.add(name)
    return frozenset(named)


def _override_key(arg: str) -> str:
    return arg.partition("=")[0].replace("_", "-")


def override_values(args: Iterable[str]) -> dict[str, str]:
    """`--env.*`/`--agent.*` arguments as {flag: value as typed} (`--a.b=1` and `--a.b 1`
    alike)."""
    values: dict[str, list[str]] = {}
    key = ""
    for arg in args:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            key = _override_key(key)
            values[key] = [value] if eq else []
        elif key:
            values[key].append(arg)
    return {k: " ".join(v) for k, v in values.items()}


def _merged_overrides(theirs: Iterable[str], ours: tuple[str, ...]) -> tuple[str, ...]:
    """The run's `--env.*`/`--agent.*` arguments this command does not set, then its own."""
    named = {_override_key(a) for a in ours if a.startswith("--")}
    kept: list[str] = []
    keep = False
    for arg in theirs:
        if arg.startswith("--"):
            keep = _override_key(arg) not in named
        if keep:
            kept.append(arg)
    return (*kept, *ours)


def _fits_type(value: object, hint: object) -> bool:
    """Whether a value read back from run.json is one a field of type `hint` holds."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _fits_type(value, typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_fits_type(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is tuple:
        return isinstance(value, tuple) and all(isinstance(v, int) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def _run_of(train: TrainSpec) -> Path | None:
    """The existing run a command continues (--run-dir, or the one --resume finds)."""
    if train.run_dir:
        path = Path(train.run_dir)
        return path if path.is_dir() else None
    if not train.resume:
        return None
    experiment = train.experiment_name or resolve(train).experiment_name
    try:
        return latest_run(train.log_root, experiment)
    except DamagedRecord:
        return None  # refused, naming the record, where --resume is checked


def _check_place(run: Path, train: TrainSpec, before: dict[str, Any], named: frozenset[str],
                 effective: dict[str, Any]) -> None:  # fmt: skip
    """What the command names of where the run lies must be where it lies."""
    experiment = effective.get("experiment_name") or before.get("experiment_name")
    for field, what, were, ours in (
        ("experiment_name", "experiment", experiment, train.experiment_name),
        ("run_name", "run name", before.get("run_name"), train.run_name),
    ):
        if field in named and were is not None and ours != were:
            flag = f"--{field.replace('_', '-')}"
            raise SpecError(
                flag,
                f"{run} is a run of {what} {were!r}, not {ours!r}: drop {flag} to continue it "
                "there, or give another run directory",
            )
    if "log_root" in named and train.run_dir:
        root = Path(train.log_root).resolve()
        if root not in run.resolve().parents:
            raise SpecError(
                "--log-root",
                f"{run} is not under {train.log_root}: drop --log-root to continue it there",
            )


def continued(spec: S, named: frozenset[str], rank: bool = False) -> S:
    """`spec` with every setting of the run it continues that the command did not name taken
    from the run (as recorded in run.json); unchanged when it continues no run. `rank`: a
    rank of torchrun or srun, whose number of ranks its launcher says."""
    train = spec.train if isinstance(spec, SubmitSpec) else spec
    run = _run_of(train)
    record = read_record(run) if run is not None else {}
    before = record.get("spec") or {}
    if run is None or not before:
        return spec
    effective = record.get("effective") or {}
    _check_place(run, train, before, named, effective)
    hints = typing.get_type_hints(TrainSpec, include_extras=True)
    world = _WORLD[type(spec)]
    keep_world = not rank and not named & set(world)
    # What --resume found the run by stays what the command says.
    found_by = {"log_root"} if train.run_dir else {"log_root", "experiment_name"}
    changes: dict[str, Any] = {}
    for name, value in before.items():
        if name not in hints or name in named or name in {*_THIS_START, *found_by, "overrides"}:
            continue
        if name in _WORLD[TrainSpec] and not (keep_world and isinstance(spec, TrainSpec)):
            continue
        value = tuple(value) if name == "gpu_ids" and isinstance(value, list) else value
        if _fits_type(value, hints[name]):
            changes[name] = value
    if "log_root" not in named and train.run_dir and run.parent.parent != run.parent:
        changes["log_root"] = str(run.parent.parent)  # where the run is, wherever it ran from
    changes["overrides"] = _merged_overrides(before.get("overrides") or (), train.overrides)
    size, device = record.get("world_size"), str(record.get("device") or "")
    cpu_ranks = isinstance(size, int) and size > 1 and device.startswith("cpu")
    if isinstance(spec, TrainSpec) and keep_world and cpu_ranks:
        changes["num_procs"] = size  # a job's CPU ranks (--tasks-per-node) are its ranks here
    new_train = dataclasses.replace(train, **changes)
    if isinstance(spec, TrainSpec):
        return new_train  # type: ignore[return-value]
    layout: dict[str, Any] = {}
    nodes = record.get("num_nodes")
    if keep_world and isinstance(size, int) and isinstance(nodes, int) and 0 < nodes <= size:
        per_node = size // nodes
        gpus = per_node if device.startswith("cuda") else 0
        layout = {
            "nodes": nodes,
            "gpus_per_node": gpus,
            "tasks_per_node": None if gpus else per_node,
        }
    return dataclasses.replace(spec, train=new_train, **layout)  # type: ignore[return-value]

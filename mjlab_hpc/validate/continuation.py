"""What a command that continues a run means, and what it may change.

`continued` fills every setting the command does not name from the run (run.json); what it
names of where the run is must be where the run is. Which fields a command named comes from
how it parsed (`mjlab_hpc.cli.common.parse_command`), not from its text. `continue_target`
then decides the run target (`RunTarget`: new, continue or restart, and where) and says each
change of the run's settings, or refuses one that its saved environments do not fit
(docs/preemption.md, "What a continuation may change").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mjlab_hpc.errors import DamagedRecord, SpecError
from mjlab_hpc.rundir.checkpoint import Checkpoints, cannot_continue
from mjlab_hpc.rundir.layout import (
    RUN_RECORD,
    RunDir,
    checkpoint_iteration,
    is_run_dir,
    latest_run,
    list_checkpoints,
)
from mjlab_hpc.rundir.record import (
    Effective,
    NewerRecord,
    changed_settings,
    read_record,
    versions,
)
from mjlab_hpc.rundir.writer import busy_problem
from mjlab_hpc.spec import (
    KEPT_ON_CONTINUATION,
    NOT_RUN_SETTINGS,
    SIMULATOR_PACKAGES,
    ResolvedSpec,
    RunKind,
    RunTarget,
    SubmitSpec,
    TrainSpec,
)
from mjlab_hpc.tasks.mjlab import configured_cfgs
from mjlab_hpc.tasks.registry import experiment_of
from mjlab_hpc.validate.world import check_run_dir

__all__ = ["continuation", "continue_target", "continued", "override_values"]

S = TypeVar("S", TrainSpec, SubmitSpec)

#: How one start of a run begins, never taken from the run (where the run lies is checked).
_THIS_START = frozenset(NOT_RUN_SETTINGS) - {"task", "log_root", "experiment_name", "run_name"}
#: What names the number of ranks, by command.
_WORLD = {
    TrainSpec: ("num_procs", "gpu_ids"),
    SubmitSpec: ("nodes", "tasks_per_node", "gpus_per_node"),
}


def _override_key(arg: str) -> str:
    return arg.partition("=")[0].replace("_", "-")


def override_values(args: Iterable[str]) -> dict[str, str]:
    """Map `--env.*`/`--agent.*` arguments to {flag: value as typed} (`--a.b=1` like `--a.b 1`)."""
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
    """Return the run's `--env.*`/`--agent.*` arguments this command does not set, then its own."""
    named = {_override_key(a) for a in ours if a.startswith("--")}
    kept: list[str] = []
    keep = False
    for arg in theirs:
        if arg.startswith("--"):
            keep = _override_key(arg) not in named
        if keep:
            kept.append(arg)
    return (*kept, *ours)


def _found_run(train: TrainSpec, experiment: str) -> Path:
    """Return the run --resume continues: the latest of `experiment` under --log-root.

    SpecError names --resume when there is none, or when the record naming it is damaged.
    """
    try:
        run = latest_run(train.log_root, experiment)
    except DamagedRecord as exc:
        raise SpecError("--resume", str(exc)) from None
    if run is None:
        raise SpecError(
            "--resume",
            f"no earlier run of {experiment} under {train.log_root} to continue; drop "
            "--resume to start one, or name it with --run-dir",
        )
    return run


def _check_place(
    run: Path,
    train: TrainSpec,
    before: TrainSpec,
    named: frozenset[str],
    effective: Effective,
    found: bool,
) -> None:
    """Refuse an experiment, run name or log root the command names that the run is not in.

    `found`: --resume found the run (under --log-root, in its experiment).
    """
    experiment = effective.experiment_name or before.experiment_name
    for field, what, were, ours in (
        ("experiment_name", "experiment", experiment, train.experiment_name),
        ("run_name", "run name", before.run_name, train.run_name),
    ):
        if field in named and were is not None and ours != were:
            flag = f"--{field.replace('_', '-')}"
            raise SpecError(
                flag,
                f"{run} is a run of {what} {were!r}, not {ours!r}: drop {flag} to continue it "
                "there, or give another run directory",
            )
    if "log_root" in named and not found:
        root = Path(train.log_root).resolve()
        if root not in run.resolve().parents:
            raise SpecError(
                "--log-root",
                f"{run} is not under {train.log_root}: drop --log-root to continue it there",
            )


def continued(spec: S, named: frozenset[str], rank: bool = False) -> S:
    """Return `spec` with every setting the command did not name taken from the run it continues.

    The run is --run-dir, or the one --resume finds, which becomes the spec's run directory
    (found once). The settings are the run's as recorded in run.json; `spec` is otherwise
    unchanged when it continues no run. `named`: the fields the command set. `rank`: a rank
    of torchrun or srun, whose number of ranks its launcher says.
    """
    return continuation(spec, named, rank)[0]


def continuation(spec: S, named: frozenset[str], rank: bool = False) -> tuple[S, dict[str, str]]:
    """`continued`, and where each field it set came from: the run's directory for what the
    run kept, the run found for `run_dir` (--resume), by field name."""
    train = spec.train if isinstance(spec, SubmitSpec) else spec
    found = train.resume and not train.run_dir  # else --run-dir names it
    if found:
        train = train.replace(run_dir=str(_found_run(train, experiment_of(train))))
        spec = spec.replace(train=train) if isinstance(spec, SubmitSpec) else train  # type: ignore[assignment]
    run = Path(train.run_dir) if train.run_dir and Path(train.run_dir).is_dir() else None
    record = read_record(run) if run is not None else None
    before = record.spec if record is not None else None
    where = {"run_dir": f"the run --resume found under {train.log_root}"} if found else {}
    if run is None or record is None or before is None:
        return spec, where
    _check_place(run, train, before, named, record.effective, found)
    world = _WORLD[type(spec)]
    keep_world = not rank and not named & set(world)
    # What --resume found the run by stays what the command says.
    found_by = {"log_root", "experiment_name"} if found else {"log_root"}
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(TrainSpec):  # typed as the record was read
        name = f.name
        if name in named or name in {*_THIS_START, *found_by, "overrides"}:
            continue
        if name in _WORLD[TrainSpec] and not (keep_world and isinstance(spec, TrainSpec)):
            continue
        changes[name] = getattr(before, name)
    if "log_root" not in named and not found and run.parent.parent != run.parent:
        changes["log_root"] = str(run.parent.parent)  # where the run is, wherever it ran from
    if before.overrides:
        changes["overrides"] = _merged_overrides(before.overrides, train.overrides)
    size, device = record.world_size, record.device or ""
    cpu_ranks = isinstance(size, int) and size > 1 and device.startswith("cpu")
    if isinstance(spec, TrainSpec) and keep_world and cpu_ranks:
        changes["num_procs"] = size  # a job's CPU ranks (--tasks-per-node) are its ranks here
    new_train = dataclasses.replace(train, **changes)
    layout: dict[str, Any] = {}
    nodes = record.num_nodes
    world_kept = keep_world and isinstance(size, int) and isinstance(nodes, int)
    if isinstance(spec, SubmitSpec) and world_kept and 0 < nodes <= size:  # type: ignore[operator]
        per_node = size // nodes  # type: ignore[operator]
        gpus = per_node if device.startswith("cuda") else 0
        layout = {
            "nodes": nodes,
            "gpus_per_node": gpus,
            "tasks_per_node": None if gpus else per_node,
        }
    kept = f"the run {run}"
    where |= {name: kept for name in [*changes, *layout]}
    if isinstance(spec, TrainSpec):
        return new_train, where  # type: ignore[return-value]
    return dataclasses.replace(spec, train=new_train, **layout), where  # type: ignore[return-value]


def continue_target(
    resolved: ResolvedSpec,
    world: tuple[int | None, str] = (None, "--num-procs"),
    say: Callable[[str], None] = lambda line: None,
    launcher: bool = True,
) -> ResolvedSpec:
    """Return `resolved` with its run target decided, after checking it: the one place.

    No run directory: a new run, made when the target is realised. An existing run directory
    (--run-dir, or the run --resume finds) must hold a run of the same task that no other
    training writes now; it is continued from its newest valid checkpoint, restarted when
    every checkpoint is damaged and --restart-from-scratch says so, else trained from
    iteration 0 (it holds none). A continuation must keep what its saved environments fit.
    `world` is the number of ranks (None: the launcher does not know it) and the flag that
    sets it. `launcher` is False in a rank, whose rank 0 may hold the run already. The
    settings this start changes are said through `say`.
    """
    train = resolved.train
    if train.resume and not train.run_dir:  # not continued (`continued`) before
        found = _found_run(train, resolved.experiment_name)
        resolved = resolved.replace_train(run_dir=str(found))
        train = resolved.train
    if not train.run_dir:
        return resolved.aimed(RunTarget())
    given = Path(train.run_dir)
    if train.resume and not is_run_dir(given):
        what = "does not exist" if not given.exists() else "holds no run"
        raise SpecError(
            "--resume",
            f"{given} {what}: nothing to continue. Drop --resume to start a new run there, "
            "or name the run to continue",
        )
    # The ranks check again (and load); refusing here starts no process at all.
    flag = "--resume" if train.resume else "--run-dir"
    if launcher:
        check_run_dir(flag, str(given))
    run_dir = given.resolve()
    if launcher and (busy := busy_problem(RunDir(run_dir))) is not None:
        raise SpecError(flag, busy)
    checkpoints = Checkpoints(run_dir, resolved.task)
    refusal = cannot_continue(
        checkpoints, resolved.task, train.restart_from_scratch, flag, train.fresh_envs
    )
    if refusal is not None:
        raise refusal
    try:
        read_record(run_dir, strict=True)
    except NewerRecord as exc:  # never read as ours, nor rewritten
        raise SpecError(flag, str(exc)) from None
    except DamagedRecord as exc:
        if launcher:
            say(
                f"{exc.path} is damaged ({exc.problem}): this start keeps it as "
                f"{RUN_RECORD}.damaged-<time> and begins a new record"
            )
    valid, damaged = checkpoints.newest_valid()  # verified above: no second read
    if launcher and valid is not None:
        for d in damaged:  # a rank sets them aside when it starts
            say(f"skipping damaged checkpoint {d.name}: {d.why}")
    kind: RunKind = "continue" if valid is not None else "restart" if damaged else "new"
    if valid is not None:
        done = checkpoint_iteration(valid) or 0
        if resolved.max_iterations < done:
            raise SpecError(
                "--max-iterations",
                f"{resolved.max_iterations}, but {run_dir} has done {done} iterations: give "
                f"at least {done} (or drop it to keep the run's own)",
            )
    if list_checkpoints(run_dir):
        _check_continuation(run_dir, resolved, world, say)
    return resolved.aimed(RunTarget(kind=kind, path=str(run_dir)))


def _check_continuation(
    run_dir: Path, resolved: ResolvedSpec, world: tuple[int | None, str], say: Callable[[str], None]
) -> None:
    """Refuse a change that the run's saved environments do not fit; say every other change.

    --fresh-envs lets such a change through (docs/preemption.md, "What a continuation may
    change").
    """
    record = read_record(run_dir)
    before = record.spec
    if before is None:
        return
    train = resolved.train
    kept = []  # (flag, the run's, this start's)
    num_envs = record.effective.num_envs
    if num_envs not in (None, resolved.num_envs):
        kept.append(("--num-envs", num_envs, resolved.num_envs))
    for key in KEPT_ON_CONTINUATION:
        if key != "num_envs" and getattr(before, key) != getattr(train, key):
            kept.append((f"--{key.replace('_', '-')}", getattr(before, key), getattr(train, key)))
    size, size_flag = world
    # A size the healer changed to or from (--min-nodes) goes on with what the ranks saved.
    resized = size is not None and record.resized_by_healer(size)
    if size is not None and record.world_size not in (None, size) and not resized:
        kept.append((size_flag, f"{record.world_size} rank(s)", f"{size} rank(s)"))
    installed = versions()
    for name in SIMULATOR_PACKAGES[resolved.source]:
        recorded = record.versions.get(name)
        if recorded is not None and recorded != installed.get(name):
            kept.append(("--fresh-envs", f"{name} {recorded}", f"{name} {installed.get(name)}"))
    motion = record.effective.motion_file
    if motion != resolved.motion_file:
        kept.append(("--registry-name", f"motion {motion}", f"motion {resolved.motion_file}"))
    if resolved.source == "mjlab":
        change = _env_config_change(resolved.task, before.overrides, train.overrides)
        if change is not None:
            kept.append(change)
    if kept and not train.fresh_envs:
        flag, theirs, ours = kept[0]
        raise SpecError(
            flag,
            f"{run_dir} was trained with {theirs}; this command asks for {ours}. A "
            "continuation restores the run's saved environments, which fit only the run's "
            "value: give it, or pass --fresh-envs to continue with new environments (models, "
            "optimizer and iteration kept; not exact). Nothing was changed or started",
        )
    changes = {flag: f"{flag} {a} -> {b}" for flag, a, b in kept}
    for key, (a, b) in changed_settings(before, train).items():
        if key == "overrides":  # each --env.* / --agent.* setting that changed
            old, new = override_values(a), override_values(b)
            for flag in dict.fromkeys([*old, *new]):
                if old.get(flag) != new.get(flag):
                    changes.setdefault(
                        flag, f"{flag} {old.get(flag, '(unset)')} -> {new.get(flag, '(unset)')}"
                    )
            continue
        flag = f"--{key.replace('_', '-')}"
        changes.setdefault(flag, f"{flag} {a} -> {b}")
    if changes:
        fresh = " with new environments (--fresh-envs)" if kept else ""
        say(f"continuing {run_dir}{fresh}: {'; '.join(changes.values())}")


def _env_config_change(
    task: str, before: Sequence[str], now: Sequence[str]
) -> tuple[str, str, str] | None:
    """Return the first env config field that two lists of overrides set differently.

    The number of environments is left aside. The answer is (--env flag, value with `before`,
    value with `now`), or None when they agree.
    """
    cfgs = [
        configured_cfgs(task, num_envs=1, max_iterations=None, overrides=overrides)[0]
        for overrides in (before, now)
    ]
    for cfg in cfgs:
        cfg.scene.num_envs = 1
    return _first_difference(*(dataclasses.asdict(c) for c in cfgs), "--env")


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, str, str] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}".replace("_", "-"))
            if found:
                return found
        return None
    return None if a == b else (path, repr(a), repr(b))

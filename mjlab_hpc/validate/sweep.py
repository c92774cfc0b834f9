"""Sweeps: `--sweep KEY=V1,V2,...` flags become one training spec per point of their product.

The elements are submitted as one Slurm job array, or as one local job each. Keys are
TrainSpec fields (`seed`, `num_envs` or `num-envs`, ...) and `agent.<key>` settings of the
rsl-rl agent config, which become `--agent.<key>=<value>` overrides. Every element gets its
own run directory, named after its values.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mjlab_hpc.convert import Mismatch, load
from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import ResolvedSpec, TrainSpec
from mjlab_hpc.validate.places import no_control
from mjlab_hpc.validate.rules import check_train, resolve

__all__ = [
    "SweepAxis",
    "SweepElement",
    "expand",
    "name_suffix",
    "parse_axes",
    "sweep_elements",
    "sweepable_keys",
]

FLAG = "--sweep"
AGENT_PREFIX = "agent."
# Fields that decide where a run lives or how it is launched: one value per sweep.
_FIXED = frozenset(
    {
        "task",
        "log_root",
        "experiment_name",
        "run_name",
        "run_dir",
        "num_procs",
        "gpu_ids",
        "resume",
        "restart_from_scratch",
        "overrides",
        # One job script per sweep: its #SBATCH --signal is the one signal every element's
        # ranks must handle.
        "preempt_signal",
        "oversubscribe",
        # The job script asks for the GPUs (--gpus-per-node) of every element alike.
        "device",
    }
)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class SweepAxis:
    """One `--sweep` flag: a key and the values it takes (as typed)."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class SweepElement:
    """One point of the sweep: its index in the job array, its values, and its spec."""

    index: int
    overrides: tuple[tuple[str, str], ...]
    """(key, value) of every swept key, as typed."""
    resolved: ResolvedSpec
    """The element's training spec, its task resolved."""

    @property
    def train(self) -> TrainSpec:
        """The element's training spec."""
        return self.resolved.train

    @property
    def label(self) -> str:
        """The values, as typed: `seed=0 learning_rate=3e-4`."""
        return " ".join(f"{short_key(k)}={v}" for k, v in self.overrides)

    def as_dict(self) -> dict[str, str]:
        """The swept values by key."""
        return dict(self.overrides)


def short_key(key: str) -> str:
    """Return the key as it appears in run names (`agent.learning_rate` -> `learning_rate`)."""
    return key.removeprefix(AGENT_PREFIX)


def name_suffix(overrides: Sequence[tuple[str, str]]) -> str:
    """Return the run-name suffix of an element: `seed=0_learning_rate=3e-4`."""
    parts = []
    for key, value in overrides:
        safe = re.sub(r"[^A-Za-z0-9.+=-]", "-", value)  # no '/', spaces or quotes in paths
        parts.append(f"{short_key(key)}={safe}")
    return "_".join(parts)


def sweepable_keys() -> list[str]:
    """List the TrainSpec fields a sweep may vary, and `agent.<key>`."""
    keys = [f.name for f in dataclasses.fields(TrainSpec) if f.name not in _FIXED]
    return [*keys, AGENT_PREFIX + "<key>"]


def parse_axes(flags: Sequence[str]) -> tuple[SweepAxis, ...]:
    """Parse `--sweep` flags; SpecError naming --sweep for anything malformed."""
    field_names = {f.name for f in dataclasses.fields(TrainSpec)}
    axes: list[SweepAxis] = []
    seen: set[str] = set()
    for flag in flags:
        key, sep, raw = flag.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(FLAG, f"{flag!r} is not KEY=V1,V2,... (e.g. --sweep seed=0,1,2)")
        if not _KEY.match(key):
            raise SpecError(FLAG, f"{key!r} is not a key name")
        no_control(FLAG, flag)
        values = tuple(v.strip() for v in raw.split(","))
        if any(not v for v in values):
            raise SpecError(FLAG, f"{flag!r} has an empty value; separate values with commas")
        if len(set(values)) != len(values):
            raise SpecError(FLAG, f"{flag!r} repeats a value")
        if key.startswith(AGENT_PREFIX):
            if key == AGENT_PREFIX or key.endswith("."):
                raise SpecError(FLAG, f"{key!r} names no agent setting (e.g. agent.learning_rate)")
        else:
            key = key.replace("-", "_")
            if key not in field_names or key in _FIXED:
                why = "cannot be swept" if key in field_names else "is not a training option"
                raise SpecError(
                    FLAG, f"{key!r} {why}; sweepable keys: {', '.join(sweepable_keys())}"
                )
        if key in seen:
            raise SpecError(FLAG, f"{key} is swept twice; give all its values in one --sweep")
        seen.add(key)
        axes.append(SweepAxis(key, values))
    return tuple(axes)


def _convert(key: str, text: str, hint: Any) -> Any:
    """Convert `text` to a value of the field type `hint` (SpecError naming --sweep if not).

    The one converter's text mode (`mjlab_hpc.convert`): words as the command line spells
    them (`true`, `none`), plain ASCII numbers.
    """
    try:
        return load(hint, text, key, mode="text")
    except Mismatch as exc:
        verb = "use" if exc.want.startswith("one of") else "not"
        raise SpecError(FLAG, f"{key}={text}: {verb} {exc.want}") from None


def expand(
    train: TrainSpec, axes: Sequence[SweepAxis]
) -> list[tuple[tuple[tuple[str, str], ...], TrainSpec]]:
    """Return one checked (values, spec) per point of the cartesian product of `axes`.

    The first flag varies slowest. Each element's run name is the base run name plus a
    suffix naming its values.
    """
    hints = typing.get_type_hints(TrainSpec, include_extras=True)
    for axis in axes:  # `4` and `04`, `true` and `yes`: one value written twice
        if axis.key.startswith(AGENT_PREFIX):
            continue
        seen: dict[Any, str] = {}
        for text in axis.values:
            value = _convert(axis.key, text, hints[axis.key])
            if value in seen:
                raise SpecError(FLAG, f"{axis.key}: {seen[value]} and {text} are the same value")
            seen[value] = text
    out = []
    for combo in itertools.product(*(a.values for a in axes)):
        overrides = tuple((a.key, v) for a, v in zip(axes, combo, strict=True))
        changes: dict[str, Any] = {}
        agent = list(train.overrides)
        for key, value in overrides:
            if key.startswith(AGENT_PREFIX):
                # mjlab's own flag syntax, as `mjlab-train TASK --agent.KEY VALUE` takes it.
                agent.append(f"--{key}={value}")
            else:
                changes[key] = _convert(key, value, hints[key])
        changes["overrides"] = tuple(agent)
        suffix = name_suffix(overrides)
        changes["run_name"] = f"{train.run_name}_{suffix}" if train.run_name else suffix
        spec = dataclasses.replace(train, **changes)
        try:
            check_train(spec)
        except SpecError as exc:
            label = " ".join(f"{k}={v}" for k, v in overrides)
            raise SpecError(FLAG, f"{label}: {exc}") from None
        out.append((overrides, spec))
    return out


def sweep_elements(train: TrainSpec, flags: Sequence[str]) -> list[SweepElement]:
    """Parse and expand `--sweep` flags for `train`, and resolve every element's task.

    Any problem raises SpecError naming --sweep. Elements that differ only in what the task
    does not look at (seed, save interval, ...) share one resolution.
    """
    if not flags:
        return []
    cache: dict[tuple[Any, ...], ResolvedSpec] = {}
    elements = []
    for index, (overrides, spec) in enumerate(expand(train, parse_axes(flags))):
        key = (spec.task, spec.num_envs, spec.max_iterations, spec.experiment_name, spec.overrides)
        if key not in cache:
            try:
                cache[key] = resolve(spec)
            except SpecError as exc:
                label = " ".join(f"{short_key(k)}={v}" for k, v in overrides)
                raise SpecError(FLAG, f"{label}: {exc}") from None
        resolved = dataclasses.replace(cache[key], train=spec)
        elements.append(SweepElement(index, overrides, resolved))
    return elements

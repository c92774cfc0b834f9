"""Sweeps: `--sweep KEY=V1,V2,...` flags become one training spec per point of their cartesian
product, submitted as one Slurm job array (`mjlab-submit ... --sweep seed=0,1,2`).

Keys are TrainSpec fields (`seed`, `num_envs`, `max_iterations`, ...; `num-envs` works too).
`agent.<key>` keys change the rsl-rl agent config: they become `agent_overrides` entries
`<key>=<value>` where TrainSpec has that field, else mjlab-style `--agent.<key>=<value>`
entries of `overrides` (which only mjlab tasks accept). Every element gets its own run
directory, named after its values, and the sweep is recorded in
`<log-root>/<experiment>/.sweeps/<stamp>/sweep.json`; each run directory holds a
`sweep_element.json` naming its sweep, index and job.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import TrainSpec

FLAG = "--sweep"
AGENT_PREFIX = "agent."
AGENT_FIELD = "agent_overrides"
MJLAB_FIELD = "overrides"
SWEEPS_DIR = ".sweeps"
SWEEP_RECORD = "sweep.json"
ELEMENT_RECORD = "sweep_element.json"
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
        AGENT_FIELD,
        MJLAB_FIELD,
    }
)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


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
    train: TrainSpec

    @property
    def label(self) -> str:
        """`seed=0 learning_rate=3e-4`: the values, as typed."""
        return " ".join(f"{short_key(k)}={v}" for k, v in self.overrides)

    def as_dict(self) -> dict[str, str]:
        return dict(self.overrides)


def short_key(key: str) -> str:
    """The key as it appears in run names (`agent.learning_rate` -> `learning_rate`)."""
    return key.removeprefix(AGENT_PREFIX)


def name_suffix(overrides: Sequence[tuple[str, str]]) -> str:
    """The run-name suffix of an element: `seed=0_learning_rate=3e-4`."""
    parts = []
    for key, value in overrides:
        safe = re.sub(r"[^A-Za-z0-9.+=-]", "-", value)  # no '/', spaces or quotes in paths
        parts.append(f"{short_key(key)}={safe}")
    return "_".join(parts)


def agent_field(spec_type: type = TrainSpec) -> str | None:
    """The TrainSpec field that carries agent overrides, None if it has none."""
    names = {f.name for f in dataclasses.fields(spec_type)}
    for name in (AGENT_FIELD, MJLAB_FIELD):
        if name in names:
            return name
    return None


def sweepable_keys(spec_type: type = TrainSpec) -> list[str]:
    """The TrainSpec fields a sweep may vary (plus `agent.<key>` where supported)."""
    keys = [f.name for f in dataclasses.fields(spec_type) if f.name not in _FIXED]
    if agent_field(spec_type):
        keys.append(AGENT_PREFIX + "<key>")
    return keys


def parse_axes(flags: Sequence[str], spec_type: type = TrainSpec) -> tuple[SweepAxis, ...]:
    """Parse `--sweep` flags; SpecError naming --sweep for anything malformed."""
    field_names = {f.name for f in dataclasses.fields(spec_type)}
    axes: list[SweepAxis] = []
    seen: set[str] = set()
    for flag in flags:
        key, sep, raw = flag.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(FLAG, f"{flag!r} is not KEY=V1,V2,... (e.g. --sweep seed=0,1,2)")
        if not _KEY.match(key):
            raise SpecError(FLAG, f"{key!r} is not a key name")
        values = tuple(v.strip() for v in raw.split(","))
        if any(not v for v in values):
            raise SpecError(FLAG, f"{flag!r} has an empty value; separate values with commas")
        if len(set(values)) != len(values):
            raise SpecError(FLAG, f"{flag!r} repeats a value")
        if key.startswith(AGENT_PREFIX):
            if agent_field(spec_type) is None:
                raise SpecError(
                    FLAG,
                    f"{key}: agent.* keys need agent overrides, which this version's training "
                    f"options lack; sweepable keys: {', '.join(sweepable_keys(spec_type))}",
                )
            if key == AGENT_PREFIX or key.endswith("."):
                raise SpecError(FLAG, f"{key!r} names no agent setting (e.g. agent.learning_rate)")
        else:
            key = key.replace("-", "_")
            if key not in field_names or key in _FIXED:
                why = "cannot be swept" if key in field_names else "is not a training option"
                raise SpecError(
                    FLAG,
                    f"{key!r} {why}; sweepable keys: {', '.join(sweepable_keys(spec_type))}",
                )
        if key in seen:
            raise SpecError(FLAG, f"{key} is swept twice; give all its values in one --sweep")
        seen.add(key)
        axes.append(SweepAxis(key, values))
    return tuple(axes)


def _convert(key: str, text: str, hint: Any) -> Any:
    """`text` as a value of the field type `hint` (SpecError naming --sweep if it is not)."""
    origin = get_origin(hint)
    if origin is typing.Annotated:
        return _convert(key, text, get_args(hint)[0])
    if hint is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise SpecError(FLAG, f"{key}={text}: not true or false")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise SpecError(FLAG, f"{key}={text}: not an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise SpecError(FLAG, f"{key}={text}: not a number") from None
    if hint is str:
        return text
    if origin is Literal:
        if text in get_args(hint):
            return text
        choices = ", ".join(str(a) for a in get_args(hint))
        raise SpecError(FLAG, f"{key}={text}: use one of {choices}")
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if type(None) in get_args(hint) and text.lower() == "none":
            return None
        errors = []
        for option in options:
            try:
                return _convert(key, text, option)
            except SpecError as exc:
                errors.append(exc.problem)
        raise SpecError(FLAG, errors[0] if errors else f"{key}={text}: not a valid value")
    raise SpecError(FLAG, f"{key} cannot be swept (its type is {hint})")


def expand(train: TrainSpec, axes: Sequence[SweepAxis]) -> list[SweepElement]:
    """One validated spec per point of the cartesian product (the first flag varies slowest).

    Each element's run name is the base run name plus a suffix naming its values.
    """
    hints = typing.get_type_hints(type(train), include_extras=True)
    target = agent_field(type(train))
    elements = []
    for index, combo in enumerate(itertools.product(*(a.values for a in axes))):
        overrides = tuple((a.key, v) for a, v in zip(axes, combo, strict=True))
        changes: dict[str, Any] = {}
        agent: list[str] = list(getattr(train, target, ())) if target else []
        for key, value in overrides:
            if not key.startswith(AGENT_PREFIX):
                changes[key] = _convert(key, value, hints[key])
            elif target == AGENT_FIELD:
                agent.append(f"{key.removeprefix(AGENT_PREFIX)}={value}")
            else:  # mjlab's own flag syntax, as `mjlab-train TASK --agent.KEY VALUE` takes it
                agent.append(f"--{key}={value}")
        if target and any(k.startswith(AGENT_PREFIX) for k, _ in overrides):
            changes[target] = tuple(agent)
        suffix = name_suffix(overrides)
        changes["run_name"] = f"{train.run_name}_{suffix}" if train.run_name else suffix
        spec = dataclasses.replace(train, **changes)
        try:
            spec.validate()
        except SpecError as exc:
            label = " ".join(f"{k}={v}" for k, v in overrides)
            raise SpecError(FLAG, f"{label}: {exc}") from None
        elements.append(SweepElement(index, overrides, spec))
    return elements


def sweep_elements(train: TrainSpec, flags: Sequence[str]) -> list[SweepElement]:
    """Parse and expand `--sweep` flags for `train` and check that every element's task
    accepts its values (SpecError naming --sweep on any problem)."""
    from mjlab_hpc.tasks import resolve_task

    elements = expand(train, parse_axes(flags, type(train)))
    for element in elements:
        if not any(k.startswith(AGENT_PREFIX) for k, _ in element.overrides):
            continue  # field values were checked by validate(); only overrides reach the task
        try:
            resolve_task(element.train)
        except (KeyError, SpecError) as exc:
            why = exc.args[0] if isinstance(exc, KeyError) else str(exc)
            raise SpecError(FLAG, f"{element.label}: {why}") from None
    return elements


@dataclass(frozen=True)
class ElementRecord:
    """What `sweep_element.json` in a run directory says about the run's place in a sweep."""

    sweep_dir: Path
    index: int
    job_id: str
    executor: str
    overrides: dict[str, str]

    @property
    def label(self) -> str:
        return " ".join(f"{short_key(k)}={v}" for k, v in self.overrides.items())


def read_element(run_dir: Path) -> ElementRecord | None:
    """The run's sweep element record, None if the run is not part of a sweep."""
    path = run_dir / ELEMENT_RECORD
    try:
        data = json.loads(path.read_text())
        return ElementRecord(
            sweep_dir=Path(data["sweep_dir"]),
            index=int(data["index"]),
            job_id=str(data["job_id"]),
            executor=str(data["executor"]),
            overrides={str(k): str(v) for k, v in data["overrides"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_sweep(sweep_dir: Path) -> dict[str, Any]:
    """The sweep record (`sweep.json`) of a sweep directory, {} if there is none."""
    try:
        return dict(json.loads((sweep_dir / SWEEP_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return {}

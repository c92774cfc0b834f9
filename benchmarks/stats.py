"""Statistics of the benchmark: spreads of paired samples, reported figures, and throughput.

Throughput is read from progress records or from rsl-rl's console log.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Figure",
    "collective_share",
    "median_iteration_s",
    "parse_rsl_rl_log",
    "read_jsonl",
    "reward_text",
    "share_of",
    "spread",
    "throughput",
]


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, quartiles and min-max of some samples (None when there are none)."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return {"median": None, "q1": None, "q3": None, "min": None, "max": None, "n": 0}
    q1, q3 = (
        (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2))
        if len(xs) > 1
        else (xs[0], xs[0])
    )
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


@dataclass(frozen=True)
class Figure:
    """One reported ratio: its samples (one per A/B pair) and its target.

    A figure without a target is reported only, as the CPU scaling figures are (CPU ranks on
    one machine are for testing).
    """

    key: str
    label: str
    samples: tuple[float, ...]
    target: float | None
    direction: Literal[">=", "<="]
    definition: str
    section: str

    def summary(self) -> dict[str, Any]:
        s = spread(self.samples)
        med = s["median"]
        met = None
        if med is not None and self.target is not None:
            met = med >= self.target if self.direction == ">=" else med <= self.target
        return {
            "label": self.label,
            "section": self.section,
            "definition": self.definition,
            **s,
            "samples": [round(x, 5) for x in self.samples],
            "target": self.target,
            "direction": self.direction,
            "met": met,
        }


def throughput(records: Sequence[dict[str, Any]]) -> float:
    """Env-steps/s over some iterations (all ranks): steps / (collection + update) time."""
    steps = sum(r["env_steps"] for r in records)
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return steps / secs if secs > 0 else math.nan


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RSL_ITERATION = re.compile(r"Learning iteration\s+(\d+)/\d+")
_RSL_FIELDS = {
    "Total steps": "total_steps",
    "Collection time": "collect_s",
    "Learning time": "learn_s",
    "Mean reward": "reward",
}
_RSL_FIELD = re.compile(r"^\s*(?P<key>[A-Za-z ]+):\s*(?P<value>-?[\d.]+(?:e[-+]?\d+)?)s?\s*$")


def parse_rsl_rl_log(text: str) -> list[dict[str, Any]]:
    """Read progress records from the console log of rsl-rl's OnPolicyRunner.

    The log is as mjlab's own `train` prints it. Each record holds the iteration (from 1),
    env_steps, collect_s, learn_s and reward.
    """
    records: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in _ANSI.sub("", text).splitlines():
        if m := _RSL_ITERATION.search(line):
            current = {"iteration": int(m.group(1)) + 1}
            records.append(current)
        elif current is not None and (m := _RSL_FIELD.match(line)):
            key = _RSL_FIELDS.get(m.group("key").strip())
            if key is not None:
                current[key] = float(m.group("value"))
    # No "Mean reward" until an episode has ended.
    needed = ("total_steps", "collect_s", "learn_s")
    complete = [r for r in records if all(k in r for k in needed)]
    previous = 0.0
    for r in complete:  # "Total steps" counts from the start
        r["env_steps"] = r["total_steps"] - previous
        previous = r["total_steps"]
    return complete


def collective_share(records: Sequence[dict[str, Any]]) -> float:
    """Time inside collectives / iteration time, over some iterations (rank 0's view)."""
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return sum(r["collective_s"] for r in records) / secs if secs > 0 else math.nan


def reward_text(value: float | None) -> str | None:
    """A mean reward as mjlab's train prints it (none before the first episode ends)."""
    if value is None or not math.isfinite(value):
        return None
    return f"{value:.2f}"


def median_iteration_s(records: Sequence[dict[str, Any]]) -> float:
    xs = [r["collect_s"] + r["learn_s"] for r in records]
    return statistics.median(xs) if xs else math.nan


def share_of(records: Sequence[dict[str, Any]], key: str) -> float:
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return sum(r[key] for r in records) / secs if secs > 0 else math.nan


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a run's file as plain dicts (a torn or missing line is
    skipped): what the benchmarks measure, as the ranks wrote it."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records

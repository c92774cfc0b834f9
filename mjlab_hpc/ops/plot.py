"""`mjlab-hpc plot`: one PNG of runs' mean reward and env-steps/s over iterations and time.

The series come from the runs' tensorboard event files, read with tensorboard's
EventAccumulator (tags `Train/mean_reward` and `Perf/total_fps`, which rsl-rl logs every
iteration). A resumed run's events after its last checkpoint were purged by the trainer, so
every curve is continuous. Several runs are overlaid. What was drawn (runs, tags, points) is
stored in the PNG's text metadata under `mjlab-hpc`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.console import inert
from mjlab_hpc.rundir.durable import open_regular

__all__ = ["RunSeries", "Series", "load_run", "plot_runs"]

REWARD_TAG = "Train/mean_reward"
FPS_TAG = "Perf/total_fps"
TAGS = (REWARD_TAG, FPS_TAG)
METADATA_KEY = "mjlab-hpc"
_LABELS = {REWARD_TAG: "mean reward", FPS_TAG: "env-steps/s"}


@dataclass(frozen=True)
class Series:
    """One scalar of one run: iteration (1-based, as in progress.jsonl), wall time, value."""

    tag: str
    iterations: tuple[int, ...]
    wall_times: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class RunSeries:
    """The plotted scalars of one run."""

    run_dir: Path
    label: str
    series: dict[str, Series]
    unread: str | None = None
    """Why the run's events were not read (an event file that is a FIFO, a device, a link
    out of the run)."""


def _unreadable_events(run_dir: Path) -> str | None:
    """Why tensorboard must not read the run's event files (None: it may).

    tensorboard opens every `*tfevents*` file as it is: a FIFO would never end, so each must
    be a regular file of the run first.
    """
    for path in run_dir.iterdir():
        if "tfevents" not in path.name:
            continue
        try:
            with open_regular(path, None, run_dir):
                pass
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            return str(exc)
    return None


def load_run(run_dir: Path, label: str | None = None) -> RunSeries:
    """Read the reward and throughput scalars of a run's tensorboard events.

    Every event file in the run directory is read, in order; none when one of them is no
    regular file of the run (`unread` says why).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if (unread := _unreadable_events(run_dir)) is not None:
        return RunSeries(run_dir, label or run_dir.name, {}, unread)
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    available = set(acc.Tags().get("scalars", []))
    series = {}
    for tag in TAGS:
        if tag not in available:
            continue
        events = acc.Scalars(tag)
        # rsl-rl logs iteration i (0-based) at step i.
        series[tag] = Series(
            tag=tag,
            iterations=tuple(e.step + 1 for e in events),
            wall_times=tuple(e.wall_time for e in events),
            values=tuple(float(e.value) for e in events),
        )
    return RunSeries(run_dir, label or run_dir.name, series)


def plot_runs(runs: Sequence[RunSeries], out: Path, title: str | None = None) -> dict[str, Any]:
    """Draw every run's series into the PNG `out`; return what was drawn.

    Rows are mean reward and env-steps/s; columns are against iteration and against wall time
    since the run's first event. What was drawn is also stored in the PNG's metadata.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (login nodes, CI)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TAGS), 2, figsize=(12, 7), squeeze=False)
    unit, seconds = _wall_unit(runs)
    drawn: dict[str, Any] = {"runs": [], "wall_time_unit": unit}
    for run in runs:
        entry: dict[str, Any] = {"run_dir": str(run.run_dir), "label": run.label, "series": {}}
        for row, tag in enumerate(TAGS):
            s = run.series.get(tag)
            if s is None or not s.values:
                continue
            start = min(s.wall_times)
            wall = [(t - start) / seconds for t in s.wall_times]
            axes[row][0].plot(s.iterations, s.values, label=_literal(run.label))
            axes[row][1].plot(wall, s.values, label=_literal(run.label))
            entry["series"][tag] = {
                "points": len(s.values),
                "first_iteration": s.iterations[0],
                "last_iteration": s.iterations[-1],
                "last_value": s.values[-1],
            }
        drawn["runs"].append(entry)
    for row, tag in enumerate(TAGS):
        for col, xlabel in enumerate(("iteration", f"wall time ({unit})")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(_LABELS[tag])
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.suptitle(_literal(title or ", ".join(r.label for r in runs)[:120]))
    fig.tight_layout(rect=(0, 0.06 if handles else 0, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, metadata={METADATA_KEY: json.dumps(drawn)})
    plt.close(fig)
    return drawn


def _literal(text: str) -> str:
    """`text` (a run's name, a title) drawn as typed: inert, and a `$` is a dollar sign, not
    the start of matplotlib's math notation (which a name like `a$_$` would crash)."""
    return inert(text).replace("$", r"\$")


def _wall_unit(runs: Sequence[RunSeries]) -> tuple[str, float]:
    """Seconds, minutes or hours, whichever suits the longest run."""
    spans = [
        max(s.wall_times) - min(s.wall_times)
        for r in runs
        for s in r.series.values()
        if s.wall_times
    ]
    longest = max(spans, default=0.0)
    if longest < 120:
        return "s", 1.0
    if longest < 3 * 3600:
        return "min", 60.0
    return "h", 3600.0

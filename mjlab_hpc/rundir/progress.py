"""Progress of a run: the record of one iteration, and its live display.

An iteration's record is a line of progress.jsonl. The display is a rich bar on a terminal,
plain lines otherwise; rank 0 of an in-process run shows it, and so do the launchers that
follow a run from its progress file.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["IterationStats", "ProgressDisplay"]


@dataclass(frozen=True)
class IterationStats:
    """What one finished PPO iteration reports."""

    iteration: int
    """Iterations completed so far (1-based)."""
    total: int
    env_steps: int
    """Env steps of this iteration over all ranks."""
    collect_s: float
    learn_s: float
    collective_s: float
    """Time inside collectives (all ranks' waiting included) during this iteration."""
    collectives: int
    """Collective calls during this iteration (0 on one rank)."""
    mean_reward: float | None
    mean_episode_length: float | None
    elapsed_s: float

    @property
    def iteration_s(self) -> float:
        return self.collect_s + self.learn_s

    @property
    def steps_per_s(self) -> float:
        return self.env_steps / self.iteration_s if self.iteration_s > 0 else 0.0

    @classmethod
    def from_record(cls, record: dict[str, object]) -> IterationStats:
        """The stats a progress.jsonl line holds (see `as_record`)."""

        def num(key: str, default: float = 0.0) -> float:
            value = record.get(key)
            return float(value) if isinstance(value, int | float) else default

        reward = record.get("mean_reward")
        length = record.get("mean_episode_length")
        return cls(
            iteration=int(num("iteration")),
            total=int(num("total")),
            env_steps=int(num("env_steps")),
            collect_s=num("collect_s"),
            learn_s=num("learn_s"),
            collective_s=num("collective_s"),
            collectives=int(num("collectives")),
            mean_reward=float(reward) if isinstance(reward, int | float) else None,
            mean_episode_length=float(length) if isinstance(length, int | float) else None,
            elapsed_s=num("elapsed_s"),
        )

    def as_record(self) -> dict[str, float | int | None]:
        """A JSON-able record for progress.jsonl."""
        return {
            "iteration": self.iteration,
            "total": self.total,
            "env_steps": self.env_steps,
            "env_steps_per_s": round(self.steps_per_s, 1),
            "collect_s": round(self.collect_s, 4),
            "learn_s": round(self.learn_s, 4),
            "collective_s": round(self.collective_s, 5),
            "collectives": self.collectives,
            "mean_reward": self.mean_reward,
            "mean_episode_length": self.mean_episode_length,
            "elapsed_s": round(self.elapsed_s, 2),
            "time": round(time.time(), 3),
        }


class ProgressDisplay:
    """Shows iterations, env steps/s, mean reward and ETA; silent when disabled (other ranks)."""

    def __init__(
        self, total: int, start: int, *, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.start = start
        self.tty = self.stream.isatty()
        self._progress: Progress | None = None
        if enabled and self.tty:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self._task = self._progress.add_task("train", total=total, completed=start, info="")
            self._progress.start()

    def update(self, s: IterationStats) -> None:
        """Show one finished iteration."""
        if not self.enabled:
            return
        reward = "n/a" if s.mean_reward is None else f"{s.mean_reward:.2f}"
        info = f"{s.steps_per_s:,.0f} steps/s  reward {reward}"
        if self._progress is not None:
            self._progress.update(self._task, completed=s.iteration, info=info)
            return
        done = s.iteration - self.start
        eta = s.elapsed_s / done * (s.total - s.iteration) if done > 0 else 0.0
        print(
            f"[train] it {s.iteration}/{s.total}  {info}  "
            f"iter {s.iteration_s:.2f}s  ETA {dt.timedelta(seconds=round(eta))}",
            file=self.stream,
            flush=True,
        )

    def note(self, text: str) -> None:
        """A line of news (a resume, a skipped checkpoint), above the live bar."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()

"""Progress of a run: the record of one iteration and of one checkpoint write, and the display.

An iteration's record is a line of progress.jsonl (`ProgressLine`), a checkpoint write's a
line of logs/checkpoints.jsonl (`CheckpointTime`); each is written and read here only, as a
typed value (`rundir.typed`: a line that does not fit is named and left out). The display is
a rich bar on a terminal, plain lines otherwise; rank 0 of an in-process run shows it, and so
do the launchers that follow a run from its progress file.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mjlab_hpc.convert import Count, EpochS, NonNegative, Seconds
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.typed import Lines, Unread, parse_line, plain, read_lines

__all__ = [
    "CheckpointTime",
    "IterationStats",
    "ProgressDisplay",
    "ProgressLine",
    "ProgressSummary",
    "checkpoint_line",
    "parse_progress",
    "progress_line",
    "progress_summary",
    "progress_tail",
    "read_checkpoint_times",
    "read_progress",
]


@dataclass(frozen=True)
class ProgressLine:
    """One line of progress.jsonl: one finished iteration (written by the run's writer)."""

    iteration: Count
    """Iterations completed so far (1-based)."""
    total: Count | None = None
    """The iterations the run trains in all."""
    env_steps: Count = 0
    """Env steps of this iteration over all ranks."""
    env_steps_per_s: NonNegative | None = None
    """Env steps per second of this iteration (a rate, never below 0)."""
    collect_s: Seconds = 0.0
    learn_s: Seconds = 0.0
    collective_s: Seconds = 0.0
    """Time inside collectives (all ranks' waiting included)."""
    collectives: Count = 0
    """Collective calls during this iteration."""
    mean_reward: float | None = None
    mean_episode_length: NonNegative | None = None
    elapsed_s: Seconds = 0.0
    """Seconds since this start's first iteration began."""
    time: EpochS | None = None
    """When it was written (epoch s; None: records from before it was)."""


@dataclass(frozen=True)
class CheckpointTime:
    """One line of logs/checkpoints.jsonl: a checkpoint written (for `mjlab-hpc report`)."""

    iteration: Count
    """The checkpoint's iteration."""
    at: EpochS
    """When its write began (epoch s)."""
    s: Seconds
    """How long the write took."""
    stop: str | None = None
    """The stop it was written for (time-limit, preemption, ...; None: a periodic save)."""


def progress_line(line: ProgressLine) -> str:
    """The text of a progress.jsonl line (without its newline)."""
    return json.dumps(plain(line))


def checkpoint_line(line: CheckpointTime) -> str:
    """The text of a checkpoints.jsonl line (without its newline); a periodic save has no
    `stop`."""
    data = plain(line)
    if line.stop is None:
        del data["stop"]
    return json.dumps(data)


def parse_progress(line: bytes | str) -> ProgressLine | None:
    """A progress.jsonl line read on its own (a follower's), None when it is no record."""
    try:
        return parse_line(ProgressLine, line.encode() if isinstance(line, str) else line, "line")
    except Unread:
        return None


def read_progress(run: RunDir, last: int | None = None) -> Lines[ProgressLine]:
    """The progress records so far (`last`: about the last so many, read from the end)."""
    return read_lines(ProgressLine, run.progress, run.path, last=last)


def progress_tail(run: RunDir, lines: int = 10) -> list[ProgressLine]:
    """The last `lines` records of progress.jsonl, read from the end of the file."""
    return list(read_progress(run, last=lines).values)


def read_checkpoint_times(run: RunDir) -> Lines[CheckpointTime]:
    """The checkpoint writes so far, oldest first."""
    return read_lines(CheckpointTime, run.checkpoint_times, run.path)


@dataclass(frozen=True)
class ProgressSummary:
    """Where a run is, from the end of its progress.jsonl."""

    iteration: int | None
    """The last iteration written."""
    total: int | None
    """The iterations the run trains in all."""
    env_steps_per_s: float | None
    """Mean over the last few iterations (one is noisy)."""
    mean_reward: float | None
    """The last mean episode reward."""
    recent_rewards: tuple[float, ...] = ()
    """The mean episode rewards of the last few iterations (whether the reward stayed where
    it ended)."""
    unread: str | None = None
    """Why progress.jsonl (or a line of it) was not read (a FIFO, a device, a link out of the
    run, a damaged line)."""


def progress_summary(run: RunDir, window: int = 10) -> ProgressSummary:
    """Summarize where a run is from the last `window` iterations of its progress.jsonl."""
    read = read_progress(run, last=window)
    tail = read.values
    last = tail[-1] if tail else None
    rates = [r.env_steps_per_s for r in tail if r.env_steps_per_s]
    rewards = [r.mean_reward for r in tail if r.mean_reward is not None]
    return ProgressSummary(
        iteration=last.iteration if last else None,
        total=last.total if last else None,
        env_steps_per_s=round(sum(rates) / len(rates), 1) if rates else None,
        mean_reward=rewards[-1] if rewards else None,
        recent_rewards=tuple(rewards),
        unread="; ".join(read.unread) or None,
    )


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
    def from_line(cls, line: ProgressLine) -> IterationStats:
        """The stats a progress.jsonl line holds (see `as_line`)."""
        return cls(
            iteration=line.iteration,
            total=line.total or line.iteration,
            env_steps=line.env_steps,
            collect_s=line.collect_s,
            learn_s=line.learn_s,
            collective_s=line.collective_s,
            collectives=line.collectives,
            mean_reward=line.mean_reward,
            mean_episode_length=line.mean_episode_length,
            elapsed_s=line.elapsed_s,
        )

    def as_line(self) -> ProgressLine:
        """The line of progress.jsonl for this iteration, written now."""
        return ProgressLine(
            iteration=self.iteration,
            total=self.total,
            env_steps=self.env_steps,
            env_steps_per_s=round(self.steps_per_s, 1),
            collect_s=round(self.collect_s, 4),
            learn_s=round(self.learn_s, 4),
            collective_s=round(self.collective_s, 5),
            collectives=self.collectives,
            mean_reward=self.mean_reward,
            mean_episode_length=self.mean_episode_length,
            elapsed_s=round(self.elapsed_s, 2),
            time=round(time.time(), 3),
        )


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

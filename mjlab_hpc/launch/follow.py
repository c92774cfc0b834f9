"""Following a run in the foreground, the same way on every launch path.

The follower shows rank 0's progress from progress.jsonl (a live bar in a terminal, plain
`[train] it ...` lines otherwise), forwards this launcher's stop signals to the job, and ends
with one line that says how the run ended and how to resume it. Of the stop signals (Ctrl-C,
SIGTERM, SIGHUP) the first asks the job to stop at its next iteration boundary with a
checkpoint; the second stops it at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from mjlab_hpc.console import inert
from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED
from mjlab_hpc.rundir.durable import LOG_LIMIT, open_regular
from mjlab_hpc.rundir.ends import memory_advice, run_outcome
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.progress import IterationStats, ProgressDisplay, parse_progress, progress_tail
from mjlab_hpc.rundir.record import Interruption, RunState, Start, read_record

# After a stop we asked for, how long the ranks may take to record their end once the job
# counts as ended: Slurm calls a cancelled job CANCELLED at once, while its ranks still write
# their checkpoint (within KillWait, 30 s by default).
STOP_RECORD_WAIT_S = 30.0

__all__ = [
    "Closing",
    "Foreground",
    "closing",
    "failed_before_start",
    "follow_progress",
    "follow_to_end",
]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Foreground:
    """While active, this forwards the process's stop signals to the job it follows.

    The first calls `stop` (the job stops at its next iteration boundary), the second `kill`
    (at once).
    """

    def __init__(self, stop: Callable[[], None], kill: Callable[[], None], err: TextIO) -> None:
        self.stop = stop
        self.kill = kill
        self.err = err
        self.signals = 0
        self.killed = False
        self._saved: dict[int, Any] = {}

    def say(self, text: str) -> None:
        """Write `text` to the error stream, if it is still there."""
        # The terminal or a `| tee` may be gone (SIGHUP, Ctrl-C to a pipeline): the stop
        # matters more than the message.
        try:
            self.err.write(text)
            self.err.flush()
        except (OSError, ValueError):
            pass

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            self.stop()
            self.say(
                f"\n{name}: stopping every rank at the next iteration boundary, with a "
                "checkpoint (again to stop at once)\n"
            )
        elif not self.killed:
            self.killed = True
            self.say(f"\n{name} again: stopping at once\n")
            self.kill()

    def __enter__(self) -> Foreground:
        for sig in _STOP_SIGNALS:
            self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            # Once stopping, more key presses must not cut the closing line short with a
            # traceback: the command ends in a moment anyway.
            signal.signal(sig, signal.SIG_IGN if self.signals else handler)


def _read_lines(path: Path, pos: int) -> tuple[list[str], int]:
    """Return the complete lines appended to `path` after byte `pos`, and the new position.

    A file that became shorter was rewritten (a restart cuts it back to its checkpoint, before
    its first iteration): what it holds was shown already, so reading goes on from its end.
    """
    try:
        with open_regular(path, None) as f:  # a FIFO, a link out: nothing to show
            size = os.fstat(f.fileno()).st_size
            if size < pos:
                return [], size
            f.seek(pos)
            chunk = f.read(LOG_LIMIT)
    except (OSError, ValueError):
        return [], pos
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode(errors="replace").splitlines(), pos + end


def follow_progress(
    run_dir: Path,
    total: int,
    done: Callable[[], bool],
    out: TextIO | None = None,
    poll_s: float = 0.25,
) -> None:
    """Show the run's progress from its progress.jsonl until `done()` and the file is read."""
    progress = RunDir(run_dir).progress
    tail = progress_tail(RunDir(run_dir), 1)
    start = tail[-1].iteration if tail else 0
    pos = progress.stat().st_size if progress.exists() else 0
    display = ProgressDisplay(total, start, enabled=True, stream=out or sys.stdout)
    starts_seen = len(read_record(run_dir).starts)
    try:
        while True:
            finished = done()
            starts = read_record(run_dir).starts
            for started in starts[starts_seen:]:
                for line in _start_news(started):
                    display.note(inert(line))
            starts_seen = max(starts_seen, len(starts))
            lines, pos = _read_lines(progress, pos)
            for line in lines:
                if (record := parse_progress(line)) is not None:
                    display.update(IterationStats.from_line(record))
            if finished:
                return
            time.sleep(poll_s)
    finally:
        display.close()


def _start_news(started: Start) -> list[str]:
    """What a (re)start of the run that a follower sees should say."""
    news = [f"skipped damaged checkpoint {d.name}: {d.why}" for d in started.skipped_checkpoints]
    if started.resumed_from_iteration:
        news.append(
            f"resumed from {started.checkpoint} at iteration {started.resumed_from_iteration}"
        )
    return news


@dataclass(frozen=True)
class Closing:
    """How a run ended, for the last line of a command and its exit code."""

    code: int
    line: str

    def say(self) -> None:
        """Print the line: on stdout when the run completed, else on stderr."""
        out = sys.stdout if self.code == EXIT_OK else sys.stderr
        print(inert(self.line), file=out, flush=True)  # it names the run, its logs' errors


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def closing(
    run_dir: Path, resume: str, cancelled: bool = False, num_envs: int | None = None
) -> Closing | None:
    """Return the closing line of a run whose job has ended.

    None when the run record says nothing (the ranks failed before training started, say).
    `resume`: the command that continues the run.
    """
    o = run_outcome(run_dir)
    it = "-" if o.iteration is None else str(o.iteration)
    reward = "-" if o.mean_reward is None else f"{o.mean_reward:.2f}"
    where = f"run directory {run_dir}"
    if o.state == "completed":
        recent = o.recent_rewards
        # What was reached, and whether it held: a last value alone can be a lucky one.
        held = (
            f" ({min(recent):.2f}-{max(recent):.2f} over the last {len(recent)} iterations)"
            if len(recent) > 1
            else ""
        )
        return Closing(
            EXIT_OK,
            f"done: {it} iterations, {_rate(o.env_steps_per_s)} env-steps/s, reward "
            f"{reward}{held}; {where}",
        )
    if o.state == "stopped":
        stop = o.stop or Interruption()
        at = it if stop.iteration is None else stop.iteration
        why = "cancelled" if cancelled else stop.reason or "stopped"
        signal_name = stop.signal
        requeuing = o.launch_mode in ("slurm", "submitit-local")
        if stop.kind == "requeue" and requeuing and not cancelled:
            return Closing(
                EXIT_FAILED,
                f"stopped at iteration {at} ({why}) and not restarted (--max-restarts "
                f"reached); checkpoint saved; {where}; resume with: {resume}",
            )
        by = f", {signal_name}" if signal_name else ""
        by += f": {stop.why}" if stop.why else ""
        return Closing(
            EXIT_STOPPED,
            f"stopped at iteration {at} ({why}{by}); checkpoint model_{at}.pt saved; "
            f"resume with: {resume}",
        )
    if o.state == "refused":
        return Closing(EXIT_BAD_INPUT, f"error: {o.refusal}")
    if o.state == "interrupted":
        return Closing(
            EXIT_INTERRUPTED,
            f"interrupted at once at iteration {it}: nothing saved since the last checkpoint; "
            f"resume with: {resume}",
        )
    if o.state == "failed":
        cause = o.cause.describe() if o.cause is not None else "see the rank logs"
        if o.cause is not None and o.cause.oom:
            cause += f"; {memory_advice(read_record(run_dir), num_envs)}"
        when = "before the first iteration" if o.iteration is None else f"at iteration {it}"
        return Closing(
            EXIT_FAILED,
            f"failed {when}: {cause}; details: mjlab-hpc logs {run_dir}; resume with: {resume}",
        )
    return None


def follow_to_end(
    run_dir: Path,
    total: int,
    stop: Callable[[], None],
    kill: Callable[[], None],
    done: Callable[[], bool],
    resume: str,
    failures: Callable[[], list[str]],
    out: TextIO | None = None,
    cancels: bool = False,
    num_envs: int | None = None,
) -> tuple[Closing, Foreground]:
    """Follow a job to its end in the foreground and say how it ended.

    Stop signals go to the job: the first to `stop`, the second to `kill`. The answer is the
    run's closing line, or, when the ranks left no record of this start, `failures()` (what
    the launcher knows of them). `cancels`: a stop signal cancels the job (a Slurm job). The
    Foreground tells whether it was killed.
    """
    said: list[bool] = []

    def checkpointed(waiting: bool) -> None:  # the ranks are done; the job may take a moment
        record = read_record(run_dir) if fg.signals and not said else None
        if record is not None and record.state == RunState.STOPPED:
            said.append(True)
            at = record.restarts[-1].iteration if record.restarts else None
            fg.say(
                f"checkpoint saved at iteration {at}{'; waiting for the job to end' * waiting}\n"
            )

    def ended() -> bool:
        over = fg.killed or done()
        checkpointed(not over)
        return over

    with Foreground(stop, kill, sys.stderr) as fg:
        follow_progress(run_dir, total, done=ended, out=out)
        deadline = time.monotonic() + STOP_RECORD_WAIT_S
        while (
            fg.signals
            and not fg.killed
            and time.monotonic() < deadline
            and read_record(run_dir).state == RunState.RUNNING
        ):
            time.sleep(0.2)
        checkpointed(False)  # the job ended as the ranks recorded their stop
    if fg.killed:
        return Closing(EXIT_INTERRUPTED, f"stopped at once; resume with: {resume}"), fg
    closed = closing(run_dir, resume, cancelled=cancels and fg.signals > 0, num_envs=num_envs)
    failed = failures() if closed is None or closed.code == EXIT_OK else []
    if closed is None or failed:
        # No record of this start (or only an earlier start's "done"): the ranks failed early.
        return failed_before_start(failed or ["the job ended without a run record"]), fg
    return closed, fg


def failed_before_start(failures: list[str]) -> Closing:
    """Return the closing line when the ranks failed before training, leaving no run record.

    A refused resume is bad input (exit 2).
    """
    refused = [f for f in failures if "ResumeRefused" in f or "refused" in f]
    code = EXIT_BAD_INPUT if refused and len(refused) == len(failures) else EXIT_FAILED
    return Closing(code, "failed before training started:\n  " + "\n  ".join(failures))

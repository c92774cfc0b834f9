"""What each signal a user, an admin or the scheduler can send means to a rank.

Handlers only record a signal, since acting inside one could interrupt a collective half way;
the rank acts on it at the next iteration boundary (`rank.stop`). The time-limit warning
(--preempt-signal) and TERM stop for a requeue, FOR_GOOD signals for good, SAVE signals ask
for a checkpoint, IGNORED ones are said and ignored; docs/preemption.md ("Signals") has the
table. The module is light: the rank's entry point records signals with it while torch loads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

from mjlab_hpc.slurm.units import slurm_seconds

__all__ = [
    "FORWARDED",
    "FOR_GOOD",
    "IGNORED",
    "NO_SIGNAL",
    "SAVE",
    "Meaning",
    "Stop",
    "StopKind",
    "StopReason",
    "StopRequest",
    "classify",
    "handled",
    "meaning",
    "watch_signals",
    "why_signalled",
]

#: Stop at the next iteration boundary with a checkpoint, for good: what the stop is called.
FOR_GOOD = {
    "INT": "interrupt",
    "HUP": "hangup",
    "QUIT": "terminated",
    "XCPU": "terminated",
    "PWR": "terminated",
}
#: Save a checkpoint at the next iteration boundary and go on (unless the time-limit signal).
SAVE = ("USR1", "USR2", "URG")
#: Ignored, and said in the rank log: by default each would end the rank without a word (and
#: the healer would take it for a crash).
IGNORED = ("ALRM", "VTALRM", "PROF", "IO", "XFSZ", "STKFLT")

#: What the batch script passes on to the ranks when it gets one (scancel --batch or --full).
FORWARDED = ("TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "URG", "XCPU", "PWR", *IGNORED)

Meaning = Literal["stop", "save", "ignore"]


def _name(signum: int) -> str:
    return signal.Signals(signum).name.removeprefix("SIG")


def meaning(signum: int, time_limit_signal: str) -> Meaning:
    """What `signum` asks of a rank whose time-limit signal is `time_limit_signal`."""
    name = _name(signum)
    if name == time_limit_signal.upper().removeprefix("SIG") or name == "TERM":
        return "stop"
    if name in SAVE:
        return "save"
    return "ignore" if name in IGNORED else "stop"


def handled(time_limit_signal: str, detached: bool = False) -> list[int]:
    """Return the signals a rank handles.

    `detached` (a job in the background) leaves INT and HUP as they are: the background job
    ignores them.
    """
    names = ["TERM", time_limit_signal.upper().removeprefix("SIG"), *FOR_GOOD, *SAVE, *IGNORED]
    if detached:
        names = [n for n in names if n not in ("INT", "HUP")]
    nums = [getattr(signal, "SIG" + n, None) for n in dict.fromkeys(names)]
    return [int(n) for n in nums if n is not None]


StopReason = Literal[
    "time-limit",
    "preemption",
    "interrupt",
    "hangup",
    "terminated",
    "supervisor-lost",
    "requeue",
    "cancelled",
    "node-lost",
]
# A stop with no signal behind it (the supervisor disappeared).
NO_SIGNAL = 255
# Within one kind of stop, the reason people recognise wins: Ctrl-C reaches the ranks and,
# through the launcher and submitit's controller, SIGTERM too; the stop says "interrupt".
_PRIORITY = {
    "interrupt": 4,
    "hangup": 3,
    "terminated": 2,
    "supervisor-lost": 1,
    "time-limit": 2,
    "preemption": 1,
}


class StopKind(IntEnum):
    """What a stop leads to; when ranks disagree, the larger wins."""

    NONE = 0
    REQUEUE = 1
    """Time limit or preemption: the scheduler runs the job again, or the user resumes."""
    FOR_GOOD = 2
    """Interrupted, terminated, or the supervisor is gone: checkpoint and exit."""


@dataclass(frozen=True)
class Stop:
    """A stop all ranks agreed on."""

    kind: StopKind
    reason: StopReason
    signum: int
    """The signal behind it (0: none)."""
    why: str = ""
    """What Slurm said of it (a requeue refused: why), for people."""

    @property
    def signal_name(self) -> str | None:
        """The signal's name, such as SIGUSR2 (None for a stop with no signal)."""
        return signal.Signals(self.signum).name if self.signum else None


def classify(signum: int, mode: str, time_limit_signal: str) -> tuple[StopKind, StopReason]:
    """What a signal means for a rank launched by `mode`."""
    if signum == NO_SIGNAL:
        return StopKind.FOR_GOOD, "supervisor-lost"
    name = signal.Signals(signum).name.removeprefix("SIG")
    if name == time_limit_signal.upper().removeprefix("SIG"):
        return StopKind.REQUEUE, "time-limit"
    if name == "TERM":
        # Slurm sends SIGTERM to preempt a job (and for scancel, where no requeue follows).
        return (
            (StopKind.REQUEUE, "preemption")
            if mode == "slurm"
            else (StopKind.FOR_GOOD, "terminated")
        )
    return StopKind.FOR_GOOD, FOR_GOOD.get(name, "terminated")  # type: ignore[return-value]


class StopRequest:
    """The stop this rank was asked for, if any.

    Signal handlers and the supervisor watch write it; the iteration boundary reads it.
    """

    def __init__(self, mode: str = "single", time_limit_signal: str = "USR2") -> None:
        self.mode = mode
        self.time_limit_signal = time_limit_signal
        self.code = 0
        self.signaled_at: float | None = None
        self.interrupts = 0
        self.save: int = 0
        """A signal that asked for a checkpoint at the next boundary (0: none)."""
        self.ignored: list[int] = []
        """Signals ignored since the last boundary (said there)."""

    def record(self, signum: int) -> None:
        """Record a stop request (the strongest one wins)."""
        kind, reason = classify(signum, self.mode, self.time_limit_signal)
        self.code = max(self.code, (int(kind) << 16) | (_PRIORITY[reason] << 8) | signum)
        if self.signaled_at is None:
            self.signaled_at = time.time()

    def handler(self, signum: int, frame: object) -> None:
        # Only record: the training loop acts at the next iteration boundary. A second
        # Ctrl-C means "now": Python's own KeyboardInterrupt (not under Slurm: a signal may
        # come twice there, to the step and through the batch shell).
        if self._not_a_stop(signum):
            return
        if signum == signal.SIGINT and self.mode != "slurm":
            self.interrupts += 1
            if self.interrupts > 1:
                # Once: a third Ctrl-C must not interrupt the "interrupted" record.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                raise KeyboardInterrupt
        if self.mode == "single" and not self.code:
            # In the foreground, nobody else says it while the iteration ends (it can take a
            # minute); os.write: a handler must not re-enter a buffered stream.
            again = " (again to stop at once)" if signum == signal.SIGINT else ""
            with contextlib.suppress(OSError):
                os.write(
                    2,
                    f"\n{signal.Signals(signum).name}: stopping at the next iteration "
                    f"boundary, with a checkpoint{again}\n".encode(),
                )
        self.record(signum)

    def _not_a_stop(self, signum: int) -> bool:
        what = meaning(signum, self.time_limit_signal)
        if what == "save":
            self.save = signum
        elif what == "ignore":
            self.ignored.append(signum)
        return what != "stop"

    def early(self, signum: int) -> None:
        """Record a signal that arrived before the handlers were installed.

        It counts as the handlers count it, without acting at once.
        """
        if self._not_a_stop(signum):
            return
        if signum == signal.SIGINT:
            self.interrupts += 1
        self.record(signum)

    def supervisor_lost(self) -> None:
        """The process supervising this rank is gone."""
        self.record(NO_SIGNAL)

    @property
    def signum(self) -> int:
        """The recorded signal (0: none or no signal behind the stop)."""
        signum = self.code & 0xFF
        return 0 if signum == NO_SIGNAL else signum


@contextlib.contextmanager
def watch_signals(request: StopRequest, detached: bool = False) -> Iterator[StopRequest]:
    """Record in `request` every signal that means something to a rank, during the block.

    The old handlers are restored afterwards. `detached` leaves INT and HUP as they are (a
    background job ignores them). Outside the main thread, where Python allows no handlers,
    nothing is installed.
    """
    old: dict[int, object] = {}
    try:
        for num in handled(request.time_limit_signal, detached):
            old[num] = signal.signal(num, request.handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield request
    finally:
        for num, handler in old.items():
            signal.signal(num, handler)  # type: ignore[arg-type]


def why_signalled(
    stop: Stop,
    job: dict[str, str] | None,
    restart_count: int,
    lost: Sequence[str] = (),
    before_first_iteration: bool = False,
    delay_s: float | None = None,
) -> Stop:
    """Tell what a TERM or time-limit stop of a Slurm job is, from Slurm's view of the job.

    `job` holds `scontrol show job`'s fields (None: no answer, and the stop stays as the
    signal says). A TERM is then the loss of the nodes `lost`, a cancel, a preemption
    (PreemptTime set, also during GraceTime), a requeue by Slurm (scontrol requeue: its
    restart count went up), the time limit, or a job that ends otherwise (scancel, also with
    --signal=KILL: a stop for good). While the job simply runs, it is a person's TERM
    (scancel --signal=TERM, to the steps or the batch shell): a stop for good.

    A time-limit stop is not requeued when no start could train: it becomes a stop for good
    whose `why` says so. That is when the time limit is no longer than the signal's
    `delay_s`, or when the signal came before this start's first iteration (a time limit
    below the delay plus start-up).
    """
    if stop.reason == "time-limit":
        shown = (job or {}).get("TimeLimit", "?")
        limit = slurm_seconds(shown)
        no_room = limit is not None and delay_s is not None and limit <= delay_s
        if not (no_room or before_first_iteration):
            return stop
        delay = f"--signal-delay-s {delay_s:g}" if delay_s is not None else "--signal-delay-s"
        if no_room:
            what = f"the job's time limit ({shown}) is no longer than {delay}"
        else:
            what = (
                "the time-limit signal came before this start's first iteration "
                f"(time limit {shown}, {delay})"
            )
        job_id = (job or {}).get("JobId", "<job>")
        why = (
            f"not requeued: {what}, so every start would be signalled before it trains; "
            f"raise the time limit (scontrol update JobId={job_id} TimeLimit=...) or lower "
            "--signal-delay-s, then resume"
        )
        return Stop(StopKind.FOR_GOOD, "time-limit", stop.signum, why=why)
    if stop.reason != "preemption" or job is None:
        return stop
    state = job.get("JobState", "")
    if lost:
        return Stop(StopKind.REQUEUE, "node-lost", stop.signum, why=f"node(s) {', '.join(lost)}")
    if job.get("PreemptTime", "None") not in ("None", "", "Unknown"):
        return stop
    if int(job.get("Restarts", "0") or 0) > restart_count:
        return Stop(StopKind.REQUEUE, "requeue", stop.signum, why="requeued by Slurm")
    limit, ran = slurm_seconds(job.get("TimeLimit", "")), slurm_seconds(job.get("RunTime", ""))
    if state == "TIMEOUT" or (limit is not None and ran is not None and ran >= limit):
        return Stop(StopKind.REQUEUE, "time-limit", stop.signum)
    if state in ("CANCELLED", "COMPLETING"):  # ending, and not requeued: scancel
        return Stop(StopKind.FOR_GOOD, "cancelled", stop.signum)
    if state == "RUNNING":
        why = "SIGTERM while the job runs (scancel --signal=TERM)"
        return Stop(StopKind.FOR_GOOD, "terminated", stop.signum, why=why)
    return stop

"""A rank that stops making progress: heartbeats, the hang watchdog, and injected faults.

Every rank runs a daemon thread that writes its heartbeat (`logs/heartbeat/rank<k>.json`) and,
once the first iteration of a start has completed, watches its own progress. A rank whose
iteration does not advance for the hang limit (`hang_limit_s`) writes its Python stacks to its
log. A checkpoint write, however long, is no hang of the writing rank; but every rank watches
the others' heartbeats through it, so a rank frozen in the write (its heartbeat stops while
the others wait for it in a collective) is named as hung within the limit. The log names the
ranks that stopped heartbeating (their heartbeat files seen unchanged by this rank's own
clock, never compared with another node's clock) or lag behind. The rank records the hang
(`hang-rank<k>.json`), waits a moment for the other live ranks to do the same, and exits with
EXIT_HUNG; the launcher ends the others and the healer decides (docs/preemption.md).
`MJLAB_HPC_FAULT` injects faults for fire drills and tests (`FaultInjection`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from mjlab_hpc.errors import EXIT_HUNG
from mjlab_hpc.procs import ProcessId
from mjlab_hpc.rundir.durable import read_regular, write_atomic
from mjlab_hpc.rundir.layout import RunDir, read_heartbeats

__all__ = [
    "FAULT_ENV",
    "SAY_ENV",
    "FaultInjection",
    "Hang",
    "Watchdog",
    "hang_limit_s",
    "parse_faults",
]

log = logging.getLogger("mjlab_hpc")

FAULT_ENV = "MJLAB_HPC_FAULT"
#: What a `say` fault prints: each paragraph (lines up to an empty line) one log record.
SAY_ENV = "MJLAB_HPC_FAULT_SAY"
_FAULT = re.compile(
    r"^(raise|kill|stop|slow|say|preflight-device|preflight-slow)@(\d+)"
    r"((?::rank\d+)?)((?::checkpoint)?)((?::once)?)$"
)
# A heartbeat seen unchanged for this many beats is a process that no longer runs.
_STALE_BEATS = 3
# The phase a hang found in a checkpoint write names.
_WRITE = "in the checkpoint write"


# A watchdog pass this much later than due: the process did not run (stopped, frozen).
_SUSPENDED_S = 2.0


def parse_faults(env: Mapping[str, str] | None = None) -> tuple[FaultInjection, ...]:
    """Return the faults that MJLAB_HPC_FAULT asks for, comma-separated (none: empty).

    A malformed one raises ValueError.
    """
    text = (os.environ if env is None else env).get(FAULT_ENV, "")
    return tuple(FaultInjection.parse(part) for part in text.split(",") if part.strip())


def hang_limit_s(timeout_s: float, slowest_iteration_s: float) -> float:
    """Return how long without progress is a hang.

    It is the timeout, or five times the slowest iteration so far when that is longer.
    """
    return max(timeout_s, 5.0 * slowest_iteration_s)


@dataclass(frozen=True)
class Hang:
    """What the watchdog found when it fired."""

    rank: int
    iteration: int
    waited_s: float
    limit_s: float
    stalled: tuple[int, ...]
    """Ranks that stopped heartbeating or lag behind (empty: every rank is stuck alike)."""
    hosts: tuple[str, ...]
    """Their hosts."""
    detail: str
    frozen: tuple[int, ...] = ()
    """Of the stalled ranks, those whose heartbeat stopped (a frozen process, a lost node)."""
    frozen_hosts: tuple[str, ...] = ()
    during: str = ""
    """The phase this rank was in, for people (empty: an iteration)."""

    def as_dict(self) -> dict[str, Any]:
        """For the hang file the healer reads."""
        return {
            "rank": self.rank,
            "iteration": self.iteration,
            "waited_s": round(self.waited_s, 1),
            "limit_s": round(self.limit_s, 1),
            "stalled_ranks": list(self.stalled),
            "stalled_hosts": list(self.hosts),
            "frozen_ranks": list(self.frozen),
            "frozen_hosts": list(self.frozen_hosts),
            "detail": self.detail,
            "during": self.during,
            "at": time.time(),
        }


class Watchdog:
    """This rank's heartbeat and hang watchdog (a daemon thread; a context manager)."""

    def __init__(
        self,
        run: RunDir,
        rank: int,
        world_size: int,
        timeout_s: float | None,
        rank_log: TextIO,
        beat_s: float = 2.0,
        host: str | None = None,
        on_fire: Callable[[str], None] | None = None,
        on_watch: Callable[[bool], None] | None = None,
    ) -> None:
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.rank_log = rank_log
        self.beat_s = beat_s if timeout_s is None else min(beat_s, max(timeout_s / 4, 0.25))
        self.host = host or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.on_fire = on_fire
        """Called with how the start ended before the exit: the rank's end record, and the
        writer gives up its lease (the healer needs it)."""
        self.on_watch = on_watch
        """Called with True when the watchdog (with a timeout) starts watching the iterations,
        False when it stops: from then on it, not the collectives' own clock, bounds a stall."""
        self.iteration = 0
        self._armed_at: float | None = None
        self._paused = 0
        self._paused_at = 0.0
        self._last = time.monotonic()
        self._slowest = 0.0
        self._first = False
        self._peers: dict[int, tuple[str, float]] = {}
        """Each other rank's heartbeat file as last read, and since when (monotonic) it
        reads so: watched once this rank's own progress stalls."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self.run.heartbeats.mkdir(parents=True, exist_ok=True)
        # An earlier start's hang (the healer read it before this start).
        with contextlib.suppress(OSError):
            self.run.hang(self.rank).unlink(missing_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def progress(self, iteration: int) -> None:
        """An iteration completed: arm the watchdog (after the first one) and reset it."""
        now = time.monotonic()
        if self._armed_at is not None:
            self._slowest = max(self._slowest, now - self._last)
        else:
            # Until an iteration has been timed, the first one (compilation included) stands
            # in for it: a slow regime (a big CPU run) is not a hang at its second iteration.
            self._armed_at = now
            self._slowest = now - self._last
            self._first = True
            if self.on_watch is not None and self.timeout_s is not None:
                self.on_watch(True)
        if self._first and self._armed_at != now:
            self._slowest = now - self._last  # the first timed iteration replaces it
            self._first = False
        self._last = now
        self.iteration = iteration

    def paused(self) -> _Paused:
        """A block whose length is no hang of this rank (a checkpoint write).

        The others' heartbeats are still watched through it: one unchanged for half the
        limit (three beats at least: a rank frozen in the write) is a hang, named within it.
        """
        return _Paused(self)

    def disarm(self) -> None:
        """Training is over (the last records are written): no longer watched."""
        if self._armed_at is not None and self.on_watch is not None and self.timeout_s is not None:
            self.on_watch(False)
        self._armed_at = None

    def _beat(self) -> None:
        # pid, start time and machine: what `mjlab-hpc cancel` knows this rank by.
        me = ProcessId.of()
        beat = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            **(me.as_dict() if me is not None else {}),
            "iteration": self.iteration,
            "t": time.time(),
        }
        # Liveness only: no fsync; a failed beat is retried at the next one.
        with contextlib.suppress(OSError):
            write_atomic(self.run.heartbeat(self.rank), json.dumps(beat).encode(), sync=False)

    def _loop(self) -> None:
        tick = min(self.beat_s, 0.5)
        next_beat = next_look = time.monotonic() + self.beat_s
        before = time.monotonic()
        pause = 0.0
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now - before > tick + _SUSPENDED_S:
                # This process was suspended (scontrol suspend, gang scheduling, Ctrl-Z): the
                # time it did not run is no hang, nor what it saw of the others before. (A
                # thread starved that long by load is forgiven alike: a later hang, not a
                # false one.)
                self._last += now - before - tick
                self._peers.clear()
            before = now
            if now >= next_beat:
                self._beat()
                next_beat = now + self.beat_s
            if self.timeout_s is None:
                continue
            limit = hang_limit_s(self.timeout_s, self._slowest)
            if self._paused:
                if pause != self._paused_at:  # a new write: the others watched afresh
                    pause = self._paused_at
                    self._peers.clear()
                # Watched from a quarter of the limit into the write (most writes end
                # sooner: no reads), or from its start where the limit is a few beats.
                quiet = max(_STALE_BEATS * self.beat_s, limit / 2)
                look_from = min(limit / 4, max(0.0, limit - quiet - 2 * self.beat_s))
                if now - self._paused_at >= look_from and now >= next_look:
                    next_look = now + self.beat_s
                    if self._frozen_peer(quiet):
                        self._fire(self._diagnose(now - self._last, limit, during=_WRITE))
                        return
                continue
            if self._armed_at is None:
                continue
            if now - self._last > limit / 2 and now >= next_look:
                self._look()  # stalled: whose heartbeat goes on changing?
                next_look = now + self.beat_s
            peer = self._peer_fired()
            if now - self._last > limit or peer:
                self._fire(self._diagnose(now - self._last, limit, peer))
                return

    def _peer_fired(self) -> bool:
        """Another rank's watchdog has fired in this start: write this rank's stacks too."""
        try:
            return any(p != self.run.hang(self.rank) for p in self.run.hangs())
        except OSError:
            return False

    def _frozen_peer(self, quiet: float) -> bool:
        """Look at the others' heartbeats: has one been unchanged for `quiet` s?"""
        self._look()
        return any(self._unchanged_s(r) >= quiet for r in self._peers)

    def _look(self) -> None:
        """Read the other ranks' heartbeat files, noting since when each reads the same."""
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                text = read_regular(self.run.heartbeat(r), within=self.run.path).decode("latin-1")
            except (OSError, ValueError):  # missing, or no file of the run (a FIFO, a link)
                text = ""
            if self._peers.get(r, (None,))[0] != text:
                self._peers[r] = (text, now)

    def _unchanged_s(self, rank: int) -> float:
        """How long this rank has seen `rank`'s heartbeat file unchanged."""
        return time.monotonic() - self._peers.get(rank, ("", time.monotonic()))[1]

    def _diagnose(self, waited: float, limit: float, peer: bool = False, during: str = "") -> Hang:
        stale_s = _STALE_BEATS * self.beat_s
        self._look()
        watched = min((seen for _, seen in self._peers.values()), default=time.monotonic())
        if time.monotonic() - watched < stale_s:  # not watched long enough (a peer fired)
            time.sleep(stale_s - (time.monotonic() - watched) + 0.1)
            self._look()
        beats = read_heartbeats(self.run, self.world_size)
        stalled = [
            r
            for r in range(self.world_size)
            if r != self.rank and (r not in beats or self._unchanged_s(r) >= stale_s)
        ]
        frozen = tuple(stalled)
        if not stalled and beats:
            top = max(int(b.get("iteration", 0)) for b in beats.values())
            stalled = [r for r, b in sorted(beats.items()) if int(b.get("iteration", 0)) < top]
        hosts = tuple(dict.fromkeys(str(beats.get(r, {}).get("host", "?")) for r in stalled))
        lines = []
        for r in range(self.world_size):
            b = beats.get(r)
            if b is None:
                lines.append(f"rank {r}: no heartbeat")
                continue
            seen = "" if r == self.rank else f", heartbeat unchanged {self._unchanged_s(r):.0f} s"
            mark = " <- stalled" if r in stalled else ""
            lines.append(
                f"rank {r} on {b.get('host')} (pid {b.get('pid')}): iteration "
                f"{b.get('iteration')}{seen}{mark}"
            )
        frozen_hosts = tuple(dict.fromkeys(str(beats.get(r, {}).get("host", "?")) for r in frozen))
        return Hang(
            rank=self.rank,
            iteration=self.iteration,
            waited_s=waited,
            limit_s=limit,
            stalled=tuple(stalled),
            hosts=hosts,
            detail="; ".join(lines),
            frozen=frozen,
            frozen_hosts=frozen_hosts,
            during=during,
        )

    def _fire(self, hang: Hang) -> None:
        who = (
            f"rank(s) {', '.join(map(str, hang.stalled))} on {', '.join(hang.hosts)} stopped"
            if hang.stalled
            else "every rank stopped progressing alike (a collective, the filesystem or a GPU)"
        )
        log.error(
            "hang: no progress for %.0f s after iteration %d%s (limit %.0f s): %s. %s. "
            "Python stacks of this rank follow.",
            hang.waited_s,
            hang.iteration,
            f", {hang.during}" if hang.during else "",
            hang.limit_s,
            who,
            hang.detail,
        )
        try:
            self.rank_log.flush()
            faulthandler.dump_traceback(file=self.rank_log, all_threads=True)
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            write_atomic(self.run.hang(self.rank), json.dumps(hang.as_dict()).encode())
        # The other live ranks fire within moments (they wait for the same peer): give them
        # the time to write their stacks before this exit ends the job's other ranks.
        deadline = time.monotonic() + min(10.0, max(2.0, 2 * self.beat_s))
        live = {r for r in range(self.world_size) if r not in hang.stalled}
        while time.monotonic() < deadline:
            done = {r for r in live if self.run.hang(r).exists()}
            if done >= live:
                break
            time.sleep(0.2)
        detail = f"hung after iteration {hang.iteration} ({who})"
        if self.on_fire is not None:
            with contextlib.suppress(Exception):
                self.on_fire(detail)
        log.error("exit: %s", detail)
        for handler in log.handlers:
            with contextlib.suppress(OSError):
                handler.flush()
        os._exit(EXIT_HUNG)


class _Paused:
    def __init__(self, dog: Watchdog) -> None:
        self.dog = dog

    def __enter__(self) -> None:
        if not self.dog._paused:
            self.dog._paused_at = time.monotonic()
        self.dog._paused += 1

    def __exit__(self, *exc: object) -> None:
        self.dog._paused -= 1
        self.dog._last = time.monotonic()


@dataclass(frozen=True)
class FaultInjection:
    """A fault to inject at the end of an iteration, as `MJLAB_HPC_FAULT` asks.

    `MJLAB_HPC_FAULT=KIND@ITERATION[:rankK][:checkpoint][:once],...` asks for `raise` (an
    exception), `kill` (SIGKILL of the rank itself), `stop` (SIGSTOP: a hang), `slow` (from
    that iteration on, the rank works twice as long per iteration: a straggler) or `say` (the
    rank prints `MJLAB_HPC_FAULT_SAY` into its log and output: text that looks like ours
    changes no decision). With `checkpoint`, a raise, kill or stop happens in the rank's
    checkpoint write of that iteration instead, once its own state is written. With `once`, a
    fault happens only in the first start that reaches it. `preflight-device` (the rank's
    device check computes a wrong result) and `preflight-slow` (its node's timed all-reduces
    are slow) act in the preflight check of every start once the run has reached ITERATION
    (`rank/preflight.py`, with --preflight).
    """

    kind: str
    iteration: int
    rank: int = 0
    once: bool = False
    in_checkpoint: bool = False
    """Injected in the checkpoint write of the iteration, not at its end."""

    @classmethod
    def parse(cls, text: str) -> FaultInjection:
        """One `KIND@ITERATION[:rankK][:checkpoint][:once]`; ValueError for a malformed one."""
        m = _FAULT.match(text.strip())
        if not m or (m.group(4) and m.group(1) not in ("raise", "kill", "stop")):
            raise ValueError(
                f"{FAULT_ENV}: {text!r} is not KIND@ITERATION[:rankK][:checkpoint][:once] with "
                "KIND one of raise, kill, stop, slow, say, preflight-device, preflight-slow "
                "(checkpoint: raise, kill, stop only; e.g. kill@12:rank1:once; several: "
                "comma-separated)"
            )
        rank = int(m.group(3).removeprefix(":rank")) if m.group(3) else 0
        return cls(
            kind=m.group(1),
            iteration=int(m.group(2)),
            rank=rank,
            once=bool(m.group(5)),
            in_checkpoint=bool(m.group(4)),
        )

    def fire_if_due(
        self,
        run: RunDir,
        rank: int,
        iteration: int,
        iteration_s: float = 0.0,
        in_checkpoint: bool = False,
    ) -> None:
        """Inject the fault when this is its rank, iteration and phase (`in_checkpoint`).

        With `once`, only the first time. `slow` sleeps at every iteration from then on, as
        long as the iteration took (`iteration_s`).
        """
        if (
            rank != self.rank
            or iteration < self.iteration
            or in_checkpoint != self.in_checkpoint
            or self.kind.startswith("preflight-")  # (they act before the first iteration)
        ):
            return
        where = "-checkpoint" if self.in_checkpoint else ""
        marker = run.injected(self.kind + where, self.iteration, rank)
        if self.kind == "slow":
            # once: the start that wrote the marker stays slow, later ones do not
            me = f"{socket.gethostname()} {os.getpid()} {os.environ.get('SLURM_STEP_ID', '')}"
            try:
                first = marker.read_text()
            except OSError:
                first = me
                with contextlib.suppress(OSError):
                    write_atomic(marker, me.encode())
                log.warning(
                    "injecting a fault (%s=slow@%d): every iteration from %d on takes "
                    "twice as long",
                    FAULT_ENV,
                    self.iteration,
                    iteration,
                )
            if not self.once or first == me:
                time.sleep(max(iteration_s, 0.05))
            return
        if iteration != self.iteration or (self.once and marker.exists()):
            return
        with contextlib.suppress(OSError):
            marker.touch()
        log.warning(
            "injecting a fault (%s=%s@%d%s) after iteration %d",
            FAULT_ENV,
            self.kind,
            self.iteration,
            ":checkpoint" if self.in_checkpoint else "",
            iteration,
        )
        for handler in log.handlers:
            with contextlib.suppress(OSError):
                handler.flush()
        if self.kind == "say":
            for paragraph in os.environ.get(SAY_ENV, "").split("\n\n"):
                log.info("%s", paragraph)
                print(paragraph, flush=True)
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at iteration {iteration} ({FAULT_ENV})")
        os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)

"""A rank that stops making progress: heartbeats, the hang watchdog, and injected faults.

Every rank runs a daemon thread that beats (`rank/beats.py`: into its node's board in memory;
its node's writer relays the node's beats to the rendezvous store and to one file per node in
the run directory) and, once the first iteration of a start has completed, watches its own
progress. A rank whose iteration does not advance for the hang limit (`hang_limit_s`) writes
its Python stacks to its log. A checkpoint write, however long, is no hang of the writing
rank; but every rank watches the others' beats through it, so a rank frozen in the write (its
beat stops while the others wait for it in a collective) is named as hung within the limit.
The log names the ranks that stopped beating (their beats seen unchanged by this rank's own
clock, never compared with another node's clock) or lag behind. The first rank to fire
announces the hang once (the store elects it; without an answer, the hang record's exclusive
creation) and records it (`rundir.liveness.Hang`); every live rank writes its stacks, and the
announcer waits a moment for them before it exits with EXIT_HUNG; the launcher ends the others
and the healer decides (docs/preemption.md). `MJLAB_HPC_FAULT` injects faults for fire drills
and tests (`FaultInjection`).
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from mjlab_hpc.errors import EXIT_HUNG
from mjlab_hpc.procs import ProcessId
from mjlab_hpc.rank.beats import NodeBoard, StoreAddress, StoreLink, View
from mjlab_hpc.rank.context import START_ENV
from mjlab_hpc.rundir.durable import write_atomic
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import (
    Hang,
    NodeBeat,
    RankBeat,
    claim_hang,
    clear_hang,
    read_node_beat,
    write_hang,
    write_node_beat,
)

__all__ = [
    "FAULT_ENV",
    "SAY_ENV",
    "FaultInjection",
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
# A beat seen unchanged for this many beats is a process that no longer runs.
_STALE_BEATS = 3
# A lower local rank's beat unchanged for this many beats: this rank writes the node's beat
# (two writers for a while are harmless; the other nodes judge after _STALE_BEATS).
_TAKEOVER_BEATS = 1.5
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
        hosts: Sequence[str] | None = None,
        store: StoreAddress | None = None,
        on_watch: Callable[[bool], None] | None = None,
    ) -> None:
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.rank_log = rank_log
        self.beat_s = beat_s if timeout_s is None else min(beat_s, max(timeout_s / 4, 0.25))
        self.host = host or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.hosts = tuple(hosts) if hosts is not None else (self.host,) * world_size
        """The host of every rank (gathered as the start began); None: all on this one."""
        if len(self.hosts) != world_size or self.hosts[rank] != self.host:
            raise ValueError(f"hosts {self.hosts} do not place rank {rank} on {self.host}")
        self.local = tuple(r for r, h in enumerate(self.hosts) if h == self.host)
        self.board = NodeBoard(run, self.host)
        self.link = (
            StoreLink(store, cycle_s=min(self.beat_s, 0.5), deadline_s=max(self.beat_s, 1.0))
            if store is not None and timeout_s is not None and world_size > 1
            else None
        )
        self.on_fire = on_fire
        """Called with how the start ended before the exit: the rank's end record, and the
        writer gives up its lease (the healer needs it)."""
        self.on_watch = on_watch
        """Called with True when the watchdog (with a timeout) starts watching the iterations,
        False when it stops: from then on it, not the collectives' own clock, bounds a stall."""
        self.iteration = 0
        self._process = ProcessId.of()
        self._seq = self._node_seq = self._view_seq = 0
        self._watching = False
        self._writer = False
        self._node_whole = True
        """The node's beat holds every local rank's (else the writer beats again sooner)."""
        self._armed_at: float | None = None
        self._paused = 0
        self._paused_at = 0.0
        self._last = time.monotonic()
        self._slowest = 0.0
        self._first = False
        self._locals: dict[int, tuple[bytes | None, float]] = {}
        """Each other local rank's beat on the board as last read, and since when (monotonic)
        it reads so: who writes the node's beat."""
        self._view: View | None = None
        """The view this rank made as its node's writer."""
        self._view_seen: tuple[int, float] | None = None
        self._peers: dict[int, tuple[tuple[int, int], float]] = {}
        """Each other rank's beat as last seen in a view, and since when (monotonic) it reads
        so: watched once this rank's own progress stalls."""
        self._beats: dict[int, RankBeat] = {}
        """Each other rank's last beat seen."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self.run.heartbeats.mkdir(parents=True, exist_ok=True)
        self.board.open()
        if self.rank == 0:  # an earlier start's hang (the healer read it before this start)
            clear_hang(self.run)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.link is not None:
            self.link.close()
        self.board.leave(self.rank)

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

        The others' beats are still watched through it: one unchanged for half the limit
        (three beats at least: a rank frozen in the write) is a hang, named within it.
        """
        return _Paused(self)

    def disarm(self) -> None:
        """Training is over (the last records are written): no longer watched."""
        if self._armed_at is not None and self.on_watch is not None and self.timeout_s is not None:
            self.on_watch(False)
        self._armed_at = None

    def _beat(self) -> None:
        """Beat on the board; as the node's writer, relay the node's beats."""
        self._seq += 1
        me = RankBeat(
            self.rank, self.host, self._process, self.iteration, self._seq, self._watching
        )
        with contextlib.suppress(OSError):  # liveness only: retried at the next beat
            self.board.write_beat(me)
        beats = self._read_locals(me)
        self._writer = self._writes()
        if not self._writer:
            if self.link is not None:
                self.link.idle()
            return
        self._node_seq += 1
        self._node_whole = len(beats) == len(self.local)
        node = NodeBeat(
            self.host, self.rank, self._node_seq, tuple(beats[r] for r in sorted(beats))
        )
        with contextlib.suppress(OSError):
            write_node_beat(self.run, node)
        watching = any(b.watching for b in beats.values())
        others = [h for h in dict.fromkeys(self.hosts) if h != self.host] if watching else []
        if self.link is not None:
            self.link.serve(self.host, node.to_bytes(), others, poll=self._armed_at is not None)
        if watching:
            self._make_view(node, others)
        if self._armed_at is not None and not self.board.announced():
            self._mirror_announcement()

    def _read_locals(self, me: RankBeat) -> dict[int, RankBeat]:
        """This node's ranks' beats on the board (this rank's: `me`), noting since when each
        reads the same."""
        now = time.monotonic()
        beats = {self.rank: me}
        for r in self.local:
            if r == self.rank:
                continue
            raw = self.board.read_beat(r)
            if r not in self._locals or self._locals[r][0] != raw:
                self._locals[r] = (raw, now)
            with contextlib.suppress(ValueError):
                beat = RankBeat.parse(json.loads(raw)) if raw else None
                # A beat left by an earlier start's rank (ended by os._exit) is not this one's
                # (told where the rank's process is seen: not from another pid namespace).
                process, here = beat.process if beat is not None else None, self._process
                seen = process is not None and here is not None and process.machine == here.machine
                gone = seen and not process.running()  # type: ignore[union-attr]
                if beat is not None and beat.rank == r and not gone:
                    beats[r] = beat
        return beats

    def _writes(self) -> bool:
        """This rank writes the node's beat: every lower local rank's beat stopped."""
        now = time.monotonic()
        for r in self.local:
            if r == self.rank:
                return True
            if now - self._locals.get(r, (None, now))[1] < _TAKEOVER_BEATS * self.beat_s:
                return False
        return True

    def _make_view(self, node: NodeBeat, others: list[str]) -> None:
        """Leave on the board every rank's beat as this writer reads them: the other nodes'
        from the store while it answers (as fetched within two beats), else from their
        files in the run directory."""
        beats, via = list(node.ranks), "board"
        if others:
            fetched: dict[str, NodeBeat | None] = {}
            if self.link is not None and self.link.answering():
                via = "store"
                at, values = self.link.fetched()
                if time.monotonic() - at < 2 * self.beat_s:
                    fetched = {h: NodeBeat.parse(v) for h, v in values.items()}
            else:
                via = "files"
                fetched = {h: read_node_beat(self.run, h) for h in others}
            for host, beat in fetched.items():
                if beat is not None and beat.host == host:
                    beats += [b for b in beat.ranks if self._placed(b.rank, host)]
        self._view_seq += 1
        self._view = View(self._view_seq, via, tuple(beats))
        with contextlib.suppress(OSError):
            self.board.write_view(self._view)

    def _placed(self, rank: int, host: str) -> bool:
        """Rank `rank` runs on `host` in this start (a beat of an earlier one may be left)."""
        return 0 <= rank < self.world_size and self.hosts[rank] == host

    def _mirror_announcement(self) -> None:
        """A hang announced elsewhere reaches this node's ranks through the board: from the
        store, or while it does not answer, the hang record in the run directory."""
        if self.link is not None and self.link.answering():
            seen = self.link.announced()
        else:
            seen = self.world_size > 1 and self.run.hang_record.exists()
        if seen:
            self.board.announce()

    def _loop(self) -> None:
        tick = min(self.beat_s, 0.5)
        next_look = time.monotonic() + self.beat_s
        next_beat = time.monotonic() + (self.beat_s if self._node_whole else tick)
        pause = 0.0
        while True:
            # Only the wait is timed: a slow write or read of the shared filesystem in a pass
            # is time the process ran, and stalls count through it.
            before = time.monotonic()
            if self._stop.wait(tick):
                return
            now = time.monotonic()
            if now - before > tick + _SUSPENDED_S:
                # This process was suspended (scontrol suspend, gang scheduling, Ctrl-Z): the
                # time it did not run is no hang, nor what it saw of the others before. (A
                # thread starved that long by load is forgiven alike: a later hang, not a
                # false one.)
                self._last += now - before - tick
                self._forget()
            try:
                state = self._pass(now, tick, next_beat, next_look, pause)
            except Exception:  # a dead watchdog would leave a stall unbounded (no timeout)
                log.exception("hang watchdog: this pass failed; the next one goes on")
                continue
            if state is None:
                return
            next_beat, next_look, pause = state

    def _pass(
        self, now: float, tick: float, next_beat: float, next_look: float, pause: float
    ) -> tuple[float, float, float] | None:
        """One pass of the loop: beat when due, then watch for a hang (None: it fired)."""
        if now >= next_beat:
            self._beat()
            # Until every local rank has beaten once, a beat each tick: the node's file
            # names every rank's process (cancel finds them by it) from the start.
            next_beat = now + (self.beat_s if self._node_whole else tick)
        elif self._writer and self.link is not None and self.link.announced():
            self.board.announce()
        if self.timeout_s is None:
            return next_beat, next_look, pause
        limit = hang_limit_s(self.timeout_s, self._slowest)
        if self._paused:
            if pause != self._paused_at:  # a new write: the others watched afresh
                pause = self._paused_at
                self._forget()
            # Watched from a quarter of the limit into the write (most writes end
            # sooner: no reads), or from its start where the limit is a few beats.
            quiet = max(_STALE_BEATS * self.beat_s, limit / 2)
            look_from = min(limit / 4, max(0.0, limit - quiet - 2 * self.beat_s))
            self._watching = now - self._paused_at >= look_from
            if self._watching and now >= next_look:
                next_look = now + self.beat_s
                if self._frozen_peer(quiet):
                    self._fire(self._diagnose(now - self._last, limit, during=_WRITE))
                    return None
            return next_beat, next_look, pause
        if self._armed_at is None:
            self._watching = False
            return next_beat, next_look, pause
        self._watching = now - self._last > limit / 2
        if self._watching and now >= next_look:
            self._look()  # stalled: whose beat goes on changing?
            next_look = now + self.beat_s
        peer = self.board.announced()  # another rank's watchdog fired: stacks here too
        if now - self._last > limit or peer:
            self._fire(self._diagnose(now - self._last, limit, peer))
            return None
        return next_beat, next_look, pause

    def _forget(self) -> None:
        """What this rank saw of the others is no longer news (suspended, a new write)."""
        self._peers.clear()
        self._view_seen = None
        if self.link is not None:
            self.link.forget()

    def _frozen_peer(self, quiet: float) -> bool:
        """Look at the others' beats: has one been unchanged for `quiet` s?"""
        self._look()
        return any(self._unchanged_s(r) >= quiet for r in self._peers)

    def _look(self) -> None:
        """Read the other ranks' beats from the node's view, noting since when each reads the
        same. A view that stopped changing (its writer stopped) tells nothing."""
        view = self._view if self._writer else self.board.read_view()
        now = time.monotonic()
        if view is None:
            return
        if self._view_seen is None or self._view_seen[0] != view.made:
            self._view_seen = (view.made, now)
        elif now - self._view_seen[1] > (_TAKEOVER_BEATS + 1) * self.beat_s:
            self._peers.clear()
            return
        for beat in view.beats:
            if beat.rank == self.rank or not 0 <= beat.rank < self.world_size:
                continue
            seen = (beat.seq, beat.iteration)
            if self._peers.get(beat.rank, (None,))[0] != seen:
                self._peers[beat.rank] = (seen, now)
            self._beats[beat.rank] = beat

    def _unchanged_s(self, rank: int) -> float:
        """How long this rank has seen `rank`'s beat unchanged."""
        now = time.monotonic()
        return now - self._peers.get(rank, ((0, 0), now))[1]

    def _diagnose(self, waited: float, limit: float, peer: bool = False, during: str = "") -> Hang:
        stale_s = _STALE_BEATS * self.beat_s
        self._watching = True
        self._look()
        watched = min((seen for _, seen in self._peers.values()), default=time.monotonic())
        # Not watched long enough (a peer fired): watch on, beating (the view is refreshed).
        while (left := stale_s - (time.monotonic() - watched)) > 0:
            time.sleep(min(left + 0.1, self.beat_s))
            self._beat()
            self._look()
            watched = min((seen for _, seen in self._peers.values()), default=watched)
        beats = dict(self._beats)
        stalled = [
            r
            for r in range(self.world_size)
            if r != self.rank and (r not in beats or self._unchanged_s(r) >= stale_s)
        ]
        frozen = tuple(stalled)
        if not stalled and beats:
            top = max([self.iteration, *(b.iteration for b in beats.values())])
            stalled = [
                r
                for r in range(self.world_size)
                if (self.iteration if r == self.rank else beats[r].iteration) < top
            ]
        lines = []
        for r in range(self.world_size):
            b = beats.get(r)
            if r == self.rank:
                pid, iteration, seen = os.getpid(), self.iteration, ""
            elif b is None:
                lines.append(f"rank {r}: no heartbeat")
                continue
            else:
                pid = b.process.pid if b.process is not None else "?"
                iteration = b.iteration
                seen = f", heartbeat unchanged {self._unchanged_s(r):.0f} s"
            mark = " <- stalled" if r in stalled else ""
            lines.append(
                f"rank {r} on {self.hosts[r]} (pid {pid}): iteration {iteration}{seen}{mark}"
            )
        return Hang(
            rank=self.rank,
            iteration=self.iteration,
            waited_s=waited,
            limit_s=limit,
            stalled=tuple(stalled),
            hosts=tuple(dict.fromkeys(self.hosts[r] for r in stalled)),
            detail="; ".join(lines),
            frozen=frozen,
            frozen_hosts=tuple(dict.fromkeys(self.hosts[r] for r in frozen)),
            during=during,
            at=time.time(),
            start=os.environ.get(START_ENV, ""),
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
        self._announce(hang)
        detail = f"hung after iteration {hang.iteration} ({who})"
        if self.on_fire is not None:
            with contextlib.suppress(Exception):
                self.on_fire(detail)
        log.error("exit: %s", detail)
        for handler in log.handlers:
            with contextlib.suppress(OSError):
                handler.flush()
        os._exit(EXIT_HUNG)

    def _announce(self, hang: Hang) -> None:
        """Announce the hang once, record it, and give the other live ranks the time to
        write their stacks before this exit ends them (they fire within moments)."""
        deadline = time.monotonic() + min(10.0, max(2.0, 2 * self.beat_s))
        link, wait_s = self.link, max(self.beat_s, 1.0)
        first = link.add("hang", 1, wait_s) if link is not None else None
        if first is None:  # no store, or no answer: the record's exclusive creation decides
            announcer = claim_hang(self.run, hang)
        elif announcer := first == 1:
            with contextlib.suppress(OSError):
                write_hang(self.run, hang)
        self.board.announce()
        if link is None:
            return
        if announcer:
            link.add("recorded", 1, wait_s)
        done = link.add("stacks", 1, wait_s)
        live = self.world_size - len(hang.stalled)
        while time.monotonic() < deadline:
            if announcer:  # until every live rank wrote its stacks
                stacks = link.add("stacks", 0, wait_s) if done is not None else None
                finished = stacks is not None and stacks >= live
            else:  # until the announcer's record is written
                said = link.add("recorded", 0, wait_s)
                finished = bool(said) or (said is None and self.run.hang_record.exists())
            if finished:
                return
            time.sleep(0.2)


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

"""What the ranks' hang watchdogs leave in a run directory: one heartbeat per node, one hang.

`logs/heartbeat/node-<host>.json` (`NodeBeat`) is rewritten every beat by one rank of its node
(the node's writer, `rank/beats.py`) and holds every local rank's beat (`RankBeat`: pid, start
time, iteration, and a count that changes at each beat). `mjlab-hpc cancel` and `status` find
the ranks' processes by it; the ranks read the other nodes' only while the rendezvous store
does not answer. `logs/heartbeat/hang.json` (`Hang`) is written once per start, by the rank
that announced a hang; the healer reads it after the ranks are gone and removes it. Each file
has one writer and one reader here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from mjlab_hpc.convert import Count, EpochS, Seconds
from mjlab_hpc.procs import ProcessId
from mjlab_hpc.rundir.durable import create_exclusive, open_dir, read_regular, write_atomic
from mjlab_hpc.rundir.layout import HANG_RECORD, RunDir
from mjlab_hpc.rundir.typed import Unread, parse_line, plain, read_optional

__all__ = [
    "Hang",
    "NodeBeat",
    "RankBeat",
    "claim_hang",
    "clear_hang",
    "read_hang",
    "read_node_beat",
    "write_hang",
    "write_node_beat",
]

log = logging.getLogger("mjlab_hpc")

# A node's beat holds a few hundred bytes per local rank.
_BEAT_LIMIT = 1 << 20


@dataclass(frozen=True)
class RankBeat:
    """One rank's heartbeat, rewritten every beat (node-local; relayed by its node's writer)."""

    rank: int
    host: str
    process: ProcessId | None
    """What `mjlab-hpc cancel` knows the rank by: pid, start time, machine."""
    iteration: int
    """The last iteration it completed."""
    seq: int
    """Counts its beats: the rank is alive while a reader sees it change (by the reader's
    own clock, never compared with another machine's)."""
    watching: bool = False
    """Its progress stalled, or it is in a long checkpoint write: it wants the others'
    beats (its node's writer then fetches them)."""

    def to_json(self) -> dict[str, Any]:
        """The record's fields, as JSON values."""
        return {
            "rank": self.rank,
            "host": self.host,
            **(self.process.as_dict() if self.process is not None else {}),
            "iteration": self.iteration,
            "seq": self.seq,
            "watching": self.watching,
        }

    @classmethod
    def parse(cls, data: object) -> RankBeat | None:
        """Read back `to_json` (None: not such a record)."""
        if not isinstance(data, dict):
            return None
        rank, iteration, seq = data.get("rank"), data.get("iteration"), data.get("seq")
        if not all(type(v) is int for v in (rank, iteration, seq)):
            return None
        return cls(
            rank=rank,  # type: ignore[arg-type]
            host=str(data.get("host", "?")),
            process=ProcessId.parse(data),
            iteration=iteration,  # type: ignore[arg-type]
            seq=seq,  # type: ignore[arg-type]
            watching=data.get("watching") is True,
        )


@dataclass(frozen=True)
class NodeBeat:
    """A node's heartbeat: `logs/heartbeat/node-<host>.json`, and its value in the store."""

    host: str
    writer: int
    """The rank that wrote it (the node's lowest rank whose beat goes on)."""
    seq: int
    """Counts the writer's node beats."""
    ranks: tuple[RankBeat, ...]
    """The node's ranks' beats as the writer last read them."""

    def to_bytes(self) -> bytes:
        """The record as it is stored (JSON)."""
        data = {
            "host": self.host,
            "writer": self.writer,
            "seq": self.seq,
            "ranks": [b.to_json() for b in self.ranks],
            "at": time.time(),  # for people; never compared with another clock
        }
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, raw: bytes) -> NodeBeat | None:
        """Read back `to_bytes` (None: not such a record; a rank beat that is none is left
        out)."""
        try:
            data = json.loads(raw)
            writer, seq, ranks = data["writer"], data["seq"], data["ranks"]
            if type(writer) is not int or type(seq) is not int or not isinstance(ranks, list):
                return None
            beats = tuple(b for b in map(RankBeat.parse, ranks) if b is not None)
            return cls(host=str(data["host"]), writer=writer, seq=seq, ranks=beats)
        except (ValueError, TypeError, KeyError):
            return None


def write_node_beat(run: RunDir, beat: NodeBeat) -> None:
    """Rewrite the node's heartbeat file (no fsync: liveness only; OSError as it comes)."""
    write_atomic(run.node_beat(beat.host), beat.to_bytes(), sync=False)


def read_node_beat(run: RunDir, host: str) -> NodeBeat | None:
    """The node's heartbeat file (None: none, or no record of ours)."""
    try:
        return NodeBeat.parse(read_regular(run.node_beat(host), _BEAT_LIMIT, within=run.path))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Hang:
    """What the watchdog of the rank that announced a hang found: `logs/heartbeat/hang.json`."""

    rank: Count
    iteration: Count
    waited_s: Seconds
    limit_s: Seconds
    stalled: tuple[Count, ...]
    """Ranks that stopped heartbeating or lag behind (empty: every rank is stuck alike)."""
    hosts: tuple[str, ...]
    """Their hosts."""
    detail: str
    frozen: tuple[Count, ...] = ()
    """Of the stalled ranks, those whose heartbeat stopped (a frozen process, a lost node)."""
    frozen_hosts: tuple[str, ...] = ()
    during: str = ""
    """The phase this rank was in, for people (empty: an iteration)."""
    at: EpochS = 0.0
    """When it was found (epoch s, this rank's clock)."""
    start: str = ""
    """The start it ended: the batch script's name for its srun step (empty: none)."""

    def to_bytes(self) -> bytes:
        """The record as written."""
        data = plain(self)
        data.update(waited_s=round(self.waited_s, 1), limit_s=round(self.limit_s, 1))
        return json.dumps(data).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Hang | None:
        """Read back `to_bytes` (None: not such a record)."""
        try:
            return parse_line(cls, raw, HANG_RECORD)
        except Unread:
            return None


def claim_hang(run: RunDir, hang: Hang) -> bool:
    """Write the start's hang record unless another rank did first (True: this one did).

    How ranks that cannot reach the store decide who announces a hang.
    """
    try:
        return create_exclusive(run.hang_record, hang.to_bytes())
    except OSError:
        return False


def write_hang(run: RunDir, hang: Hang) -> None:
    """Write the start's hang record (the announcer the store elected); OSError as it comes."""
    write_atomic(run.hang_record, hang.to_bytes())


def read_hang(run: RunDir) -> Hang | None:
    """The hang recorded in the latest start (None: none; one that is not ours is named in the
    log and left out)."""
    unread: list[str] = []
    hang = read_optional(Hang, run.hang_record, run.path, unread)
    for problem in unread:
        log.warning("%s: left out", problem)
    return hang


def clear_hang(run: RunDir) -> None:
    """Remove the hang record (read by the healer, or an earlier start's), in the run's own
    heartbeat folder: never through another user's link (`durable.open_dir`)."""
    with contextlib.suppress(OSError):
        folder = open_dir(run.hang_record.parent)
        try:
            os.unlink(run.hang_record.name, dir_fd=folder)
        finally:
            os.close(folder)

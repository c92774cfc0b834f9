"""How the ranks of a job know each other alive without loading the shared filesystem.

Three channels, the cheapest first (docs/architecture.md says why):

- the node board (`NodeBoard`): a folder in this host's memory (/dev/shm, else the temporary
  folder), one per run and host. Each rank rewrites its beat there every beat; the node's
  writer (its lowest rank whose beat goes on) reads them, and leaves there the view of the
  other ranks that a rank watching for a hang reads, and a hang's announcement.
- the rendezvous store (`StoreLink`): torch.distributed's TCPStore, which the process group
  has already. The node's writer publishes its node's beat there every beat, reads the other
  nodes' while a rank of its node watches, and sees a hang announced there once.
- the run directory: the node's writer rewrites `logs/heartbeat/node-<host>.json` every beat
  (`rundir.liveness`; cancel, status, report and the local launcher read it); the other
  nodes read it only while the store does not answer. The store lives in rank 0's process:
  frozen or lost with it, it never answers, and a call to it waits for ever (a TCPStore's
  timeout does not bound a call to a stopped server), so the link calls it from a thread of
  its own and is judged by how long its call has been waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.rank.context import START_ENV, DistContext
from mjlab_hpc.rundir.durable import read_regular, write_atomic
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import RankBeat

__all__ = ["NodeBoard", "StoreAddress", "StoreLink", "View", "board_root"]

# A beat or a view holds a few hundred bytes per rank.
_LIMIT = 1 << 24
_HANG = "hang"
_VIEW = "view.json"
# A board that no rank wrote for this long is a killed start's (a live rank beats every few
# seconds, a suspended one resumes within days): the next start on the host sweeps it.
_STALE_S = 7 * 86400


def board_root() -> Path | None:
    """This user's folder of node boards in node-local memory (None: none is usable).

    `/dev/shm/mjlab-hpc-<uid>`, else the same in the temporary folder: made private (0700),
    and refused when it is not a folder of this user's alone (a world-writable place).
    """
    for base in ("/dev/shm", tempfile.gettempdir()):
        root = Path(base) / f"mjlab-hpc-{os.geteuid()}"
        with contextlib.suppress(OSError):
            root.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(root)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                return root
    return None


@dataclass(frozen=True)
class View:
    """Every rank's beat as a node's writer last read them: its own node's from the board,
    the others' from the store (or their files while it does not answer)."""

    made: int
    """Counts the writer's views: one that stops changing is no news (its writer stopped)."""
    via: str
    """board (one node), store or files."""
    beats: tuple[RankBeat, ...]

    def to_bytes(self) -> bytes:
        data = {"made": self.made, "via": self.via, "beats": [b.to_json() for b in self.beats]}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, raw: bytes) -> View | None:
        try:
            data = json.loads(raw)
            beats = tuple(b for b in map(RankBeat.parse, data["beats"]) if b is not None)
            return cls(made=int(data["made"]), via=str(data["via"]), beats=beats)
        except (ValueError, TypeError, KeyError, OverflowError):  # int(inf): OverflowError
            return None


class NodeBoard:
    """The folder in this host's memory that one run's ranks on this host share."""

    def __init__(self, run: RunDir, host: str) -> None:
        key = hashlib.sha256(f"{os.path.realpath(run.path)}\0{host}".encode()).hexdigest()[:24]
        self._root = root = board_root()
        # Without node-local memory of this user's own, the board lies in the run directory:
        # correct, at the cost of one file per rank on the shared filesystem.
        self.path = (root / key) if root is not None else run.heartbeats / f".board-{key}"

    def open(self) -> None:
        """Make the board; an earlier start's view and announcement go (this start's ranks
        open it before any of them can announce: that takes everyone's first iteration)."""
        with contextlib.suppress(OSError):  # (no board: each beat fails alone, and says nothing)
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            for name in (_VIEW, _HANG):
                (self.path / name).unlink(missing_ok=True)
        if self._root is not None:
            _sweep(self._root, keep=self.path)

    def _beat(self, rank: int) -> Path:
        return self.path / f"rank{rank}.json"

    def write_beat(self, beat: RankBeat) -> None:
        """Rewrite this rank's beat (OSError as it comes)."""
        write_atomic(self._beat(beat.rank), json.dumps(beat.to_json()).encode(), sync=False)

    def read_beat(self, rank: int) -> bytes | None:
        """A local rank's beat as written (None: none yet)."""
        try:
            return read_regular(self._beat(rank), _LIMIT, within=self.path)
        except (OSError, ValueError):
            return None

    def write_view(self, view: View) -> None:
        """Leave the writer's view for the node's watching ranks (OSError as it comes)."""
        write_atomic(self.path / _VIEW, view.to_bytes(), sync=False)

    def read_view(self) -> View | None:
        """The writer's latest view (None: none)."""
        try:
            return View.parse(read_regular(self.path / _VIEW, _LIMIT, within=self.path))
        except (OSError, ValueError):
            return None

    def announce(self) -> None:
        """A hang was announced: every rank of this node writes its stacks and ends."""
        with contextlib.suppress(OSError):
            (self.path / _HANG).touch()

    def announced(self) -> bool:
        return (self.path / _HANG).exists()

    def leave(self, rank: int) -> None:
        """This rank ends: its beat goes, and the board with the last one."""
        with contextlib.suppress(OSError):
            self._beat(rank).unlink(missing_ok=True)
            if not any(self.path.glob("rank*.json")):
                for name in (_VIEW, _HANG):
                    (self.path / name).unlink(missing_ok=True)
                self.path.rmdir()


def _sweep(root: Path, keep: Path) -> None:
    """Remove the boards under `root` (this user's own) that no rank wrote for `_STALE_S`:
    a start killed outright (SIGKILL, a hang's os._exit) never leaves its board."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(root) as boards:
        for board in boards:
            if board.path == str(keep) or not board.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                files = [Path(f.path) for f in os.scandir(board.path)]
                newest = max([board.stat().st_mtime, *(f.lstat().st_mtime for f in files)])
                if now - newest > _STALE_S:
                    for f in files:
                        f.unlink()
                    os.rmdir(board.path)


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's rendezvous store answers, and the prefix of this start's keys."""

    host: str
    port: int
    prefix: str
    """Keys of one start: torchrun's agent keeps its store over its restarts."""

    @classmethod
    def of(cls, ctx: DistContext) -> StoreAddress:
        """The store a process group joined through env:// (rank 0's, or torchrun's agent's),
        with this start's keys."""
        start = os.environ.get(START_ENV) or ctx.job_id or ""
        return cls(ctx.master_addr, ctx.master_port, f"mjlab-hpc/{start}/{ctx.restart_count}")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"


class StoreLink:
    """A node writer's calls to the rendezvous store, each in a thread of its own.

    The watchdog never waits for the store: it hands over what to publish and what to fetch,
    reads what was fetched, and asks `answering()`; a call that waits longer than
    `deadline_s` (a frozen or lost store host) or failed means the store does not answer.
    """

    def __init__(self, address: StoreAddress, cycle_s: float, deadline_s: float) -> None:
        self.address = address
        self.cycle_s = cycle_s
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._publish: tuple[str, bytes] | None = None
        self._watch: tuple[str, ...] = ()
        self._poll = False
        self._fetched: tuple[float, dict[str, bytes]] = (0.0, {})
        self._announced = False
        self._busy_since: float | None = None
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._caller: Any = None
        self._caller_stuck = False

    def _connect(self) -> Any:
        from datetime import timedelta

        import torch.distributed as dist

        a = self.address
        timeout = timedelta(seconds=max(self.deadline_s, 1.0))
        return dist.TCPStore(
            a.host, a.port, is_master=False, wait_for_workers=False, timeout=timeout
        )

    def serve(self, host: str, beat: bytes, watch: Sequence[str], poll: bool) -> None:
        """Publish this node's beat, fetch the nodes `watch` (none: nothing), and look for a
        hang's announcement when `poll`, from now on in every cycle (the thread starts on
        the first call)."""
        with self._lock:
            self._publish = (host, beat)
            self._watch = tuple(watch)
            self._poll = poll
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="store-link", daemon=True)
            self._thread.start()

    def idle(self) -> None:
        """No longer this node's writer: nothing more to publish, fetch or poll."""
        with self._lock:
            self._publish, self._watch, self._poll = None, (), False

    def fetched(self) -> tuple[float, dict[str, bytes]]:
        """When the watched nodes were last fetched (monotonic) and their beats."""
        with self._lock:
            return self._fetched

    def announced(self) -> bool:
        with self._lock:
            return self._announced

    def answering(self) -> bool:
        """No call has been waiting longer than the deadline, and the last one succeeded."""
        with self._lock:
            busy, failed = self._busy_since, self._failed
        return not failed and (busy is None or time.monotonic() - busy < self.deadline_s)

    def forget(self) -> None:
        """What was fetched is old news (this process was suspended)."""
        with self._lock:
            self._fetched = (0.0, {})

    def close(self) -> None:
        self._stop.set()  # (a thread stuck in a call ends with the process: a daemon)

    def _loop(self) -> None:
        client = None
        while not self._stop.wait(self.cycle_s):
            with self._lock:
                self._busy_since = time.monotonic()
            try:
                if client is None:
                    client = self._connect()
                self._cycle(client)
                failed = False
            except Exception:  # torch's DistStoreError, a reset connection: no answer
                client, failed = None, True
            with self._lock:
                self._busy_since, self._failed = None, failed
            if failed:
                self._stop.wait(self.deadline_s)  # (a store that is gone: not hammered)

    def _cycle(self, client: Any) -> None:
        key = self.address.key
        with self._lock:
            publish, watch, poll = self._publish, self._watch, self._poll
        if publish is not None:  # once per beat
            client.set(key(f"node/{publish[0]}"), publish[1])
            with self._lock:
                if self._publish is publish:
                    self._publish = None
        if poll and client.check([key(_HANG)]):
            with self._lock:
                self._announced = True
        if watch:
            keys = [key(f"node/{h}") for h in watch]
            if client.check(keys):
                values = dict(zip(watch, client.multi_get(keys), strict=True))
            else:  # a node whose writer has not published yet
                values = {
                    h: client.get(k) for h, k in zip(watch, keys, strict=True) if client.check([k])
                }
            with self._lock:
                self._fetched = (time.monotonic(), values)

    def add(self, name: str, amount: int, timeout_s: float) -> int | None:
        """Add to the counter `name` and return it, on a connection of its own, within
        `timeout_s` (None: no answer; after one call without an answer, none is tried)."""
        if self._caller_stuck:
            return None
        key = self.address.key(name)
        got: list[int] = []

        def run() -> None:
            try:
                if self._caller is None:
                    self._caller = self._connect()
                got.append(int(self._caller.add(key, amount)))
            except Exception:  # no answer
                self._caller = None

        thread = threading.Thread(target=run, name="store-call", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self._caller_stuck = True
        return got[0] if got else None

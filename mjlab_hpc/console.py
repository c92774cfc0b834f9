"""A command's console, kept out of the way of its work.

A run never depends on its terminal or pipe: `| head -1`, a closed terminal, `>&-`, a pipe
nobody reads, a terminal stopped with Ctrl-S. `reopen()` (every command) opens closed standard
descriptors on /dev/null. `detach()` (the training commands and the local executor's
controller) also puts stdout and stderr behind one thread that writes for them, in order. A
write never waits for the reader; a console that does not keep up loses lines (said once it
takes them again), and one whose reader is gone is written to no more.

Python's own streams cannot do this: a full pipe blocks the writer, and a closed one raises
BrokenPipeError in the middle of training.

`inert()` is the one way text from a run (its logs, records, host and run names, what Slurm
says of it) reaches a terminal: a run directory may be shared, and what another user wrote
there must not clear the screen, set the title, or crash a command with rich markup.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import io
import os
import re
import sys
import threading

from rich.markup import escape

__all__ = ["detach", "inert", "reopen", "settle"]

# Lines the console may fall behind by before more are dropped.
_BACKLOG = 10_000


class _Pump:
    """The one thread that writes to the console's descriptors."""

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[int, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.busy = False
        self.gone: set[int] = set()
        self.dropped = 0
        threading.Thread(target=self._run, name="console", daemon=True).start()

    def put(self, fd: int, data: bytes) -> None:
        with self.cond:
            if fd in self.gone:
                return
            if len(self.queue) >= _BACKLOG:
                self.dropped += 1
                return
            self.queue.append((fd, data))
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.queue))
                fd, data = self.queue.popleft()
                dropped, self.dropped = self.dropped, 0
                self.busy = True
            if dropped:
                note = f"[{dropped} console line(s) dropped: the console did not keep up]\n"
                data = note.encode() + data
            try:
                view = memoryview(data)
                while view:  # os.write: no lock of Python's io held while a reader stalls
                    view = view[os.write(fd, view) :]
            except OSError:  # the reader is gone (EPIPE), the terminal hung up
                with self.cond:
                    self.gone.add(fd)
                    self.queue = collections.deque(q for q in self.queue if q[0] != fd)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def drain(self, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.queue and not self.busy, timeout_s)


class _Stream(io.TextIOBase):
    """stdout or stderr, written through the pump."""

    def __init__(self, fd: int, encoding: str, pump: _Pump) -> None:
        self._fd = fd
        self._encoding = encoding
        self._pump = pump

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "replace"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            self._pump.put(self._fd, text.encode(self._encoding, "replace"))
        return len(text)

    def flush(self) -> None:
        pass  # the pump writes at once; waiting here would make training wait

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False


# The process's one pump, once detached: like sys.stdout itself, one per process.
_pump: list[_Pump] = []


def reopen() -> None:
    """Open closed standard descriptors (`>&-`) on /dev/null.

    Then no file this process opens takes their number, and nothing written there fails.
    """
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:  # Python found it closed at start
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


def detach() -> None:
    """Detach this process's work from its console (see the module); once per process."""
    if _pump:
        return
    reopen()
    pump = _Pump()
    _pump.append(pump)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        with contextlib.suppress(OSError, ValueError):
            old.flush()
        setattr(sys, name, _Stream(fd, getattr(old, "encoding", None) or "utf-8", pump))
    atexit.register(settle)


def settle(timeout_s: float = 5.0) -> None:
    """Wait (at most `timeout_s`) until the console took what was written (before an exit)."""
    if _pump:
        _pump[0].drain(timeout_s)


# Colours (SGR sequences): styling only, dropped.
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
# C0 and C1 controls but newline and tab, DEL, and the bidirectional overrides that reorder
# what a line shows: each becomes its visible escape (`\x1b`).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def inert(text: object, *, markup: bool = False) -> str:
    """`text` as it may reach a terminal: no control character or escape sequence acts.

    Colours are dropped, any other control is shown as its escape (`ESC[2J` prints as
    `\x1b[2J`). With `markup`, rich markup is escaped too, for text put into a rich markup
    string (a host named `[/oops]`).
    """
    shown = _CONTROL.sub(_visible, _SGR.sub("", str(text).replace("\r\n", "\n")))
    return escape(shown) if markup else shown

"""This machine's processes: one process table, one way to end a process group, one way to run
an external command with a time limit.

Every caller that asks "is it alive", "what is its command line", "how much CPU has it used"
or "stop it and everything it started" goes through here, so they all agree (a zombie, or a
process in state X, is not alive).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil

__all__ = [
    "ProcessEntry",
    "alive",
    "kill_group",
    "processes",
    "run_command",
    "send_signal",
    "wait_gone",
]

_DEAD = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})


@dataclass(frozen=True)
class ProcessEntry:
    """One live process of the table."""

    pid: int
    argv: tuple[str, ...]


def alive(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() not in _DEAD
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def processes(match: Callable[[tuple[str, ...]], bool] | None = None) -> list[ProcessEntry]:
    """Live processes of this machine (but this one) whose argv satisfies `match`."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        info = proc.info
        if proc.pid == me or info.get("status") in _DEAD:
            continue
        argv = tuple(info.get("cmdline") or ())
        if argv and (match is None or match(argv)):
            found.append(ProcessEntry(proc.pid, argv))
    return found


def send_signal(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; False when it is gone (or not ours)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group (a process started with start_new_session=True and
    everything it started); nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_gone(pids: Iterable[int], timeout_s: float, poll_s: float = 0.05) -> list[int]:
    """Wait until none of `pids` is alive or `timeout_s` passed; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [p for p in left if alive(p)]
    return left


def run_command(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str] | None:
    """Run a command to its end and capture its output (text).

    `argv[0]` is looked up on the PATH the command will get (`env["PATH"]` when `env` is
    given). None when it is not found, cannot start, or runs past `timeout_s`: it then runs
    in a session of its own, and the whole group (a wrapper script's children included) is
    killed, so no output pipe is left open by a straggler.
    """
    exe = shutil.which(argv[0], path=None if env is None else env.get("PATH"))
    if exe is None:
        return None
    try:
        proc = subprocess.Popen(
            [exe, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=None if env is None else dict(env),
            cwd=cwd,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
    except OSError:
        return None
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            return None
        except BaseException:
            kill_group(proc.pid)
            raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

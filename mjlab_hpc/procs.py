"""This machine's processes, and the memory they may use.

One process table, one way to end a process group, one way to run an external command with a
time limit, and whether the kernel's OOM killer ended one. Every caller that asks "is it
alive", "what is its command line" or "stop it and everything it started" goes through here,
so they all agree (a zombie, or a process in state X, is not alive).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import resource
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = [
    "OomCount",
    "ProcessEntry",
    "ProcessId",
    "ProcessTree",
    "alive",
    "descendants",
    "environ_value",
    "kill_group",
    "machine_id",
    "memory_room",
    "offer_to_oom_killer",
    "oom_count",
    "owner",
    "processes",
    "run_command",
    "send_signal",
    "user_name",
    "wait_gone",
]

_DEAD = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})


@dataclass(frozen=True)
class ProcessEntry:
    """One live process of the table."""

    pid: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class ProcessId:
    """One process, told apart from a later one that reuses its pid."""

    pid: int
    started: float
    """When it started (seconds since the epoch, from the kernel's start tick): a later
    process with the same pid started later."""
    machine: str
    """`machine_id()` of the kernel and pid namespace it runs in."""

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessId | None:
        """This process (or `pid`) as it runs now; None when it is gone."""
        try:
            started = psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        return cls(pid=pid or os.getpid(), started=started, machine=machine_id())

    @classmethod
    def parse(cls, data: Mapping[str, object]) -> ProcessId | None:
        """Read back `as_dict`'s fields (None when they are missing or not of their kind)."""
        pid, started, machine = data.get("pid"), data.get("started"), data.get("machine")
        if type(pid) is not int or not isinstance(started, float | int) or not machine:
            return None
        return cls(pid=pid, started=float(started), machine=str(machine))

    def as_dict(self) -> dict[str, object]:
        """The fields, for a JSON record."""
        return {"pid": self.pid, "started": self.started, "machine": self.machine}

    def running(self) -> bool:
        """Whether this very process still runs: on this machine, its pid alive and started
        when it did (not a later process that was given the pid)."""
        if self.machine != machine_id() or not alive(self.pid):
            return False
        now = ProcessId.of(self.pid)
        return now is not None and abs(now.started - self.started) < 0.05


def environ_value(pid: int, name: str) -> str | None:
    """The variable `name` in a process's environment ('' when unset).

    None where it cannot be read: another user's process (only root reads those), or one
    that is gone.
    """
    try:
        return str(psutil.Process(pid).environ().get(name, ""))
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process that `pid` started, and those they started ([] when it is gone)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class ProcessTree:
    """A process this one started, and every process it started in turn, as seen so far.

    psutil finds a process's children only while it lives: once it is gone (killed), those
    it started belong to init. What `live()` saw before stays known, by pid and start time.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self._seen: set[ProcessId] = set()

    def live(self) -> list[int]:
        """The root and its descendants that still run, those seen earlier included."""
        for pid in (self.root, *descendants(self.root)):
            if (seen := ProcessId.of(pid)) is not None:
                self._seen.add(seen)
        return sorted({p.pid for p in self._seen if p.running()})


def alive(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie only waits to be reaped).

    One of another user, or hidden by /proc's hidepid, exists: kill(2) says so.
    """
    if pid <= 0:  # kill(2) would signal a process group
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    try:
        return psutil.Process(pid).status() not in _DEAD
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def machine_id() -> str:
    """Name this kernel's boot and this process's pid namespace.

    Two processes with the same one see each other's pids; a host name does not say that
    (containers, reused names).
    """
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{_boot_id()}:{namespace}" if _boot_id() else ""


def user_name(uid: int) -> str:
    """Return the login name of a user id (`uid N` where the system knows none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def owner(pid: int) -> int | None:
    """Return the user id a live process runs as (None: it is gone)."""
    try:
        return int(psutil.Process(pid).uids().real)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def processes(match: Callable[[tuple[str, ...]], bool] | None = None) -> list[ProcessEntry]:
    """List the live processes of this machine (but this one) whose argv satisfies `match`."""
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
    """Signal a whole process group; nothing if it is gone.

    The group is a process started with start_new_session=True and everything it started.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_gone(pids: Iterable[int], timeout_s: float, poll_s: float = 0.05) -> list[int]:
    """Wait until none of `pids` is alive or `timeout_s` passed; return the ones still alive."""
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


# Memory: psutil sees the machine's, not a container's or a job's cgroup limit, nor the kernel's
# OOM-kill counters; those are read from the cgroup files here (v1 and v2).

_CGROUP_ROOTS = ("/sys/fs/cgroup/memory", "/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def _cgroup_dir(pid: int | str = "self") -> Path | None:
    """Return the memory cgroup folder of a process (v1's memory controller, else v2's)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths = [
        line.split(":", 2)[2]
        for line in lines
        if line.count(":") >= 2 and line.split(":")[1] in ("memory", "")
    ]
    for path in paths:
        for root in _CGROUP_ROOTS:
            folder = Path(root + path.rstrip("/"))
            if (folder / "memory.oom_control").exists() or (folder / "memory.events").exists():
                return folder
    return None


def _small_file(path: Path) -> str:
    """The text of a small regular file (a cgroup's counter), never a wait or a flood.

    The path may come from a record another user can write (a rank's start record names its
    OOM counter): a FIFO, a device or a huge file is refused (OSError), not read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is no regular file")
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


def _fields(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in re.findall(r"^(\w+) (\d+)$", _small_file(path), re.M)}
    except (OSError, ValueError):
        return {}


def _number(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(_small_file(path).strip())
    return None


def _cgroup_room(folder: Path) -> int | None:
    """Return what the cgroup's limit leaves (its ancestors' too), page cache counted free."""
    stat = _fields(folder / "memory.stat")
    if "hierarchical_memory_limit" in stat:  # v1
        used = (_number(folder / "memory.usage_in_bytes") or 0) - stat.get("total_inactive_file", 0)
        limit = stat["hierarchical_memory_limit"]
        return None if limit >= 1 << 60 else max(0, limit - used)
    rooms = []
    while (folder / "memory.max").exists():  # v2: every level's own limit
        limit = _number(folder / "memory.max")  # "max": no limit
        if limit is not None:
            inactive = _fields(folder / "memory.stat").get("inactive_file", 0)
            used = (_number(folder / "memory.current") or 0) - inactive
            rooms.append(max(0, limit - used))
        folder = folder.parent
    return min(rooms) if rooms else None


def memory_room() -> tuple[int, str]:
    """Return the bytes new processes of this one may still use here, and what sets that.

    The bound is the available memory, a memory cgroup's limit (a container, a Slurm job), or
    the address-space limit of a process; the second value says which, for people.
    """
    room, why = int(psutil.virtual_memory().available), "available"
    folder = _cgroup_dir()
    limited = _cgroup_room(folder) if folder is not None else None
    if limited is not None and limited < room:
        room, why = limited, f"left under the memory limit of cgroup {folder}"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < room:
        room, why = soft, "as the address-space limit of each process (ulimit -v)"
    return room, why


@dataclass(frozen=True)
class OomCount:
    """How many processes the kernel's OOM killer ended in a memory cgroup, when read."""

    kernel: str
    """The boot id of the kernel that counts (the counter means nothing under another)."""
    counter: str
    """The cgroup file that holds the count (memory.oom_control, memory.events)."""
    kills: int

    def rose(self) -> bool | None:
        """Whether the OOM killer ended a process of that cgroup since the count.

        None where that cannot be known here: another kernel, or the cgroup is gone.
        """
        now = _read_oom(Path(self.counter))
        if now is None or _boot_id() != self.kernel:
            return None
        return now > self.kills


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _read_oom(counter: Path) -> int | None:
    return _fields(counter).get("oom_kill")


def offer_to_oom_killer(score_adj: int = 500) -> None:
    """Make the kernel's OOM killer take this process before others in its memory cgroup.

    This process is a rank, whose worlds grow. The launcher and healer in the same cgroup
    must live to record why the rank ended. Raising one's own oom_score_adj needs no
    privilege; without Linux's /proc, nothing is done.
    """
    adj = Path("/proc/self/oom_score_adj")
    with contextlib.suppress(OSError, ValueError):
        if int(adj.read_text()) < score_adj:
            adj.write_text(str(score_adj))


def oom_count(pid: int | str = "self") -> OomCount | None:
    """Read the OOM kills counted so far in the memory cgroup of a process.

    None where there is no such counter. The kernel counts a kill in the victim's own cgroup,
    whatever limit or shortage caused it.
    """
    folder = _cgroup_dir(pid)
    if folder is None:
        return None
    for name in ("memory.oom_control", "memory.events"):
        kills = _read_oom(folder / name)
        if kills is not None:
            return OomCount(kernel=_boot_id(), counter=str(folder / name), kills=kills)
    return None

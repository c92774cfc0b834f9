"""Reductions between the ranks of one machine through shared memory.

A gloo collective between two processes on one machine costs 1-2 ms once the ranks have done
some work between calls (loopback TCP, gloo's own thread, and on a VM a halted vCPU to wake),
against tens of microseconds for a write to shared memory that the other rank is polling for:
measured on a 2-core KVM guest with ~10 ms of compute between calls, 1.5-2.0 ms per gloo
all-gather against 0.04-0.24 ms here. When every rank of the job is on this machine, the
ranks' sums and maxima go through one shared file in /dev/shm instead.

Each rank owns two slots (alternated by call parity) and a sequence counter on its own cache
line. A call writes this rank's tensor into its slot, then its counter; waits until every
counter has reached the call's number; and reduces the slots in rank order, so every rank
computes the same bits, the same bits as the all-gather path (`sums.sum_over_ranks`). With two
slots a rank can never overwrite data another rank is still reading: it reaches call n + 2
only after every rank has posted call n + 1, which each does after it has finished reading
call n. This relies on stores becoming visible in program order (x86-64's memory model):
other architectures use gloo.

The file is unlinked as soon as every rank has mapped it, so nothing is left behind, whatever
ends the processes. A rank waiting for another spins for a while (50 ms when every rank can
have a core of its own, else 2 ms, yielding the core to anything else runnable), then sleeps
in growing steps, checks that the ranks it waits for are still alive, and gives up after the
process group's timeout, with errors that name the rank and read as a lost peer (as gloo's do).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import socket
import time
import zlib
from typing import Any

__all__ = ["PeerLost", "SameNodeChannel", "open_channel"]

_LINE = 64  # bytes: one sequence counter per cache line
# Bytes per slot: at most 4 MiB and 32 MiB of /dev/shm for the whole channel (2 slots per
# rank). A tensor that does not fit goes through gloo (same result, only slower).
_SLOT_MAX = 4 << 20
_CHANNEL_MAX = 32 << 20
# Waiting: spin this long (the other rank is usually microseconds to milliseconds away), then
# sleep in steps growing to _SLEEP_MAX, checking the awaited ranks are alive every _ALIVE_EVERY.
# With a core per rank a spinning rank takes nothing from the others, and a rank that went to
# sleep wakes late (up to _SLEEP_MAX plus the VM's wake-up), which the next reduction makes
# every rank pay: measured on the 2-core VM, 2 ranks, a 2 ms spin left 1.5-4% of the iteration
# in reductions and a 50 ms spin 0.25-0.6%. With more ranks than cores the spin stays short, so
# a waiting rank gives its core to the one it waits for.
_SPIN_S = 50e-3
_SPIN_SHARED_CORES_S = 2e-3
_SLEEP_MAX = 1e-3
_ALIVE_EVERY = 0.05
_SHM_DIR = "/dev/shm"
_OPS = ("sum", "max")
_MAGIC = b"mjlab-hpc-same-node-v1"


class PeerLost(RuntimeError):
    """A rank this one waits for in a same-node reduction exited or timed out."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), None when it is gone or
    a zombie: with the pid, it names one process for as long as the machine runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X", "x") else fields[19]


def _identity() -> dict[str, Any]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {
        "host": socket.gethostname(),
        # Slurm's node name: the test cluster's nodes share one machine, but are nodes.
        "node": os.environ.get("SLURMD_NODENAME", ""),
        "boot": boot,
        "machine": platform.machine(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "cpus": sorted(os.sched_getaffinity(0)),
    }


class SameNodeChannel:
    """One shared mapping for the ranks of one machine: sums and maxima in rank order."""

    def __init__(self, mm: mmap.mmap, rank: int, world: int, slot_bytes: int,
                 peers: list[tuple[int, str]], timeout_s: float,
                 spin_s: float = _SPIN_S) -> None:  # fmt: skip
        import numpy as np

        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.timeout_s = timeout_s
        self.peers = peers  # (pid, start time) per rank
        self.spin_s = spin_s
        self.calls = 0
        self.seconds = 0.0  # time inside reductions, waiting included
        self._mm = mm
        words = world * _LINE // 8
        # Per rank, one cache line: the call counter, then what the call carries (element
        # count, dtype, operation), so that ranks whose calls differ fail instead of adding
        # each other's bytes up.
        self._lines = np.frombuffer(mm, dtype=np.int64, count=words).reshape(world, _LINE // 8)
        self._seq = self._lines[:, 0]
        self._data = np.frombuffer(mm, dtype=np.uint8, offset=world * _LINE)
        self._views: dict[tuple[Any, int, int], list[Any]] = {}
        self._n = 0

    def fits(self, tensor: Any) -> bool:
        """Whether this tensor can go through the channel: contiguous, on the CPU, small enough."""
        return (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and 0 < tensor.numel() * tensor.element_size() <= self.slot_bytes
        )

    def _slots(self, dtype: Any, numel: int, parity: int) -> list[Any]:
        key = (dtype, numel, parity)
        views = self._views.get(key)
        if views is None:
            import torch

            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            views = []
            # Ordinary tensors, even when first made inside torch.inference_mode(): an
            # inference tensor could not be written outside it later.
            with torch.inference_mode(False):
                for r in range(self.world):
                    start = (parity * self.world + r) * self.slot_bytes
                    buf = self._data[start : start + nbytes]
                    views.append(torch.frombuffer(buf, dtype=dtype, count=numel))
            self._views[key] = views
        return views

    def reduce_(self, tensor: Any, op: str) -> Any:
        """Replace `tensor` (one that `fits`) by its sum or elementwise maximum over the ranks,
        in place, the same bits on every rank."""
        import torch

        t0 = time.perf_counter()
        self._n += 1
        n = self._n
        slots = self._slots(tensor.dtype, tensor.numel(), n & 1)
        slots[self.rank].copy_(tensor.reshape(-1))
        what = (tensor.numel(), zlib.crc32(str(tensor.dtype).encode()), _OPS.index(op))
        head = slice(1, 4) if n & 1 else slice(4, 7)  # by parity, as the slots
        self._lines[self.rank, head] = what
        self._seq[self.rank] = n  # after the data: the others read it once they see n
        for r in range(self.world):
            if self._seq[r] < n:
                self._wait(r, n)
            if r != self.rank and tuple(self._lines[r, head]) != what:
                raise RuntimeError(
                    f"same-node reduction {n}: rank {r} sent {tuple(self._lines[r, head])} "
                    f"(elements, dtype code, operation), rank {self.rank} {what}: the ranks' "
                    "reductions do not match (a bug: every rank must reduce the same tensors)"
                )
        flat = tensor.view(-1)
        flat.copy_(slots[0])
        for part in slots[1:]:
            if op == "sum":
                flat += part
            else:
                torch.maximum(flat, part, out=flat)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return tensor

    def _wait(self, r: int, n: int) -> None:
        seq = self._seq
        start = time.monotonic()
        spin_until = start + self.spin_s
        while seq[r] < n and time.monotonic() < spin_until:
            os.sched_yield()  # gives the core to anything runnable, else returns at once
        sleep, alive_at, last = 2e-5, start + _ALIVE_EVERY, time.monotonic()
        while seq[r] < n:
            time.sleep(sleep)
            sleep = min(sleep * 2, _SLEEP_MAX)
            now = time.monotonic()
            if now - last > 1.0:  # this process was stopped (Ctrl-Z, a suspended job): not waiting
                start += now - last
            last = now
            if now >= alive_at:
                alive_at = now + _ALIVE_EVERY
                pid, started = self.peers[r]
                if _start_time(pid) != started and seq[r] < n:
                    raise PeerLost(f"rank {r} (pid {pid}) exited during a same-node reduction "
                                   f"(call {n}): peer lost")  # fmt: skip
                if now - start > self.timeout_s:
                    raise PeerLost(f"rank {r} (pid {pid}) did not reach same-node reduction "
                                   f"{n} within {self.timeout_s:g} s: timed out")  # fmt: skip

    def close(self) -> None:
        """Unmap the file (already unlinked). Views still exported are left to the process's
        exit."""
        self._views.clear()
        self._lines = self._seq = self._data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._mm.close()


def open_channel(timeout_s: float) -> SameNodeChannel | None:
    """Collectively (every rank of the default process group calls it): a channel when every
    rank runs on this machine (and on one Slurm node), in this PID namespace, on x86-64, and a
    shared mapping in /dev/shm works for all of them; else None on every rank."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ids: list[Any] = [None] * world
    dist.all_gather_object(ids, _identity())
    mine = ids[rank]
    ok = (
        mine["machine"] in ("x86_64", "AMD64")
        and bool(mine["boot"])
        and all(
            (i["host"], i["node"], i["boot"]) == (mine["host"], mine["node"], mine["boot"])
            for i in ids
        )
        # Same PID namespace: the peers' pids name the processes that reported them.
        and all(i["start"] is not None and _start_time(i["pid"]) == i["start"] for i in ids)
    )
    if not _agreed(ok):
        return None
    slot = min(_SLOT_MAX, _CHANNEL_MAX // (2 * world)) // _LINE * _LINE
    size = world * _LINE + 2 * world * slot
    made = _create(size) if rank == 0 else None
    try:
        name: list[Any] = [made]
        dist.broadcast_object_list(name, src=0)
        mm = _attach(name[0], size) if name[0] else None
        flag = torch.tensor([1 if mm is not None else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    finally:
        if made is not None:  # every rank has mapped it (or given up, or failed): none left
            with contextlib.suppress(OSError):
                os.unlink(made[0])
    if not flag.item():
        if mm is not None:
            mm.close()
        return None
    peers = [(i["pid"], i["start"]) for i in ids]
    # A core for each rank among the CPUs the ranks may use together (each rank's own set may
    # be one core when Slurm or MJLAB_HPC_PIN_CPUS binds it): then waits spin longer.
    cores = len(set().union(*(i["cpus"] for i in ids)))
    spin_s = _SPIN_S if world <= cores else _SPIN_SHARED_CORES_S
    return SameNodeChannel(mm, rank, world, slot, peers, timeout_s, spin_s)  # type: ignore[arg-type]


def _agreed(ok: bool) -> bool:
    """Whether every rank can take part (one all-reduce MIN)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _create(size: int) -> tuple[str, bytes] | None:
    """A new file of `size` bytes in /dev/shm, its pages reserved (a full tmpfs fails here,
    not later as SIGBUS in a reduction), with a random token to check at the other end."""
    token = secrets.token_bytes(16)
    path = os.path.join(_SHM_DIR, f"mjlab-hpc-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size + len(_MAGIC) + len(token))
        os.pwrite(fd, _MAGIC + token, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path, token


def _attach(name: tuple[str, bytes], size: int) -> mmap.mmap | None:
    """Map the file; None unless it is the one rank 0 made (same machine, same /dev/shm)."""
    path, token = name
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.pread(fd, len(_MAGIC) + len(token), size) != _MAGIC + token:
            return None
        return mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)

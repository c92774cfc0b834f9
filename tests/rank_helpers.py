"""Two real processes in a real gloo process group, for tests of what ranks exchange."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from mjlab_hpc.launch import free_port


def rank_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """torchrun-style variables of one rank on this machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_two_ranks(worker: Callable[..., None], timeout_s: float = 110.0) -> dict[int, Any]:
    """Start `worker(rank, port, queue)` in two spawned processes; each puts (rank, result)
    once. Returns {rank: result} after both exited cleanly."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    # Results first: a worker blocks on exit until its queued data has been read.
    got = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return got

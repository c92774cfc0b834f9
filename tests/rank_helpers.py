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


def _rank_main(body: Callable[[int], Any], rank: int, port: int, out: mp.Queue) -> None:
    import torch

    from mjlab_hpc.distributed import DistContext, process_group

    torch.set_num_threads(1)
    with process_group(DistContext.from_env(rank_env(rank, port)), "cpu", timeout_s=60):
        result = body(rank)
    out.put((rank, result))


def run_two_ranks(body: Callable[[int], Any], timeout_s: float = 110.0) -> dict[int, Any]:
    """Run `body(rank)` in two spawned processes joined in one gloo process group (a module
    -level function, so that the children can import it). Returns {rank: result} after both
    exited cleanly."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    # Results first: a worker blocks on exit until its queued data has been read.
    got = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return got

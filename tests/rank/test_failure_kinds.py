"""A rank names what ended it from the exception's type, never from its words.

Real errors: Warp's failed allocation, a real gloo process group whose peer closed its
connection or let a collective time out (gloo raises plain RuntimeErrors: told by where they
were raised). An error of our own code whose message reads like a lost peer is an exception.
"""

from __future__ import annotations

import datetime as dt
import errno
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers import rank_env

from mjlab_hpc.errors import Diverged
from mjlab_hpc.launch.local import free_port
from mjlab_hpc.rank.failures import failure_kind


def test_kinds_by_type() -> None:
    cases: list[tuple[BaseException, str]] = [
        (MemoryError("Unable to allocate 327. MiB"), "out-of-memory"),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), "out-of-memory"),
        (torch.OutOfMemoryError("CUDA out of memory"), "out-of-memory"),
        (OSError(errno.ENOSPC, "No space left on device"), "environment"),
        (Diverged(7, "the value loss is nan", 1.0), "diverged"),
        (ConnectionResetError(errno.ECONNRESET, "reset"), "peer-lost"),
        (TimeoutError("the store timed out"), "peer-lost"),
        (dist.DistBackendError("NCCL communicator was aborted"), "peer-lost"),
        (ValueError("reward is nan"), "exception"),
    ]
    for exc, kind in cases:
        assert failure_kind(exc) == kind, exc


def test_words_decide_nothing() -> None:
    """Raised by our own code, a message that reads like a lost peer or an allocation is an
    exception: only a type, or where gloo or Warp raise theirs, says otherwise."""
    for words in ("Connection reset by peer", "timed out", "Failed to allocate 8 bytes"):
        try:
            raise RuntimeError(words)
        except RuntimeError as exc:
            assert failure_kind(exc) == "exception", words


def test_a_failed_warp_allocation_is_out_of_memory() -> None:
    import warp as wp

    wp.config.quiet = True
    wp.init()
    with pytest.raises(RuntimeError) as raised:
        wp.empty(shape=(2**30, 2**10), dtype=wp.float64, device="cpu")  # 8 TiB
    assert failure_kind(raised.value) == "out-of-memory"


def _say(out: mp.Queue, value: object) -> None:
    out.put(value)
    out.close()
    out.join_thread()  # sent before the process ends at once


def _rank(rank: int, port: int, case: str, out: mp.Queue) -> None:
    os.environ.update(rank_env(rank, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=3))
    dist.all_reduce(torch.ones(1))  # both joined
    if rank == 1:
        if case == "timeout":
            time.sleep(5)  # alive, silent: rank 0's collective times out
        _say(out, (1, None))
        os._exit(0)  # gone: its connections close
    try:
        for _ in range(5):
            dist.all_reduce(torch.ones(1))
            time.sleep(0.5)
        kind = "no error"
    except Exception as exc:
        kind = f"{failure_kind(exc)} ({type(exc).__name__})"
    _say(out, (0, kind))
    os._exit(0)  # (gloo's threads may abort a normal exit)


@pytest.mark.training  # (it starts ranks)
@pytest.mark.parametrize("case", ["closed", "timeout"])
def test_a_real_gloo_peer_lost_is_a_consequence(case: str) -> None:
    ctx = mp.get_context("fork")  # (no import again: seconds, not tens)
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, case, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] == "peer-lost (RuntimeError)", got

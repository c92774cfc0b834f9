"""Sums and maxima over ranks on real processes in a real gloo process group: the same-node
shared-memory path gives the same bits as the all-gather path, falls back to gloo when a tensor
does not fit or when turned off, leaves no file, and a lost or silent peer ends a wait with
an error that reads as a lost peer (not a hang)."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import free_port, rank_env

from mjlab_hpc.collective import SHARED_MEMORY_ENV
from mjlab_hpc.rank.entry import failure_kind


def _main(body: Callable[[int], Any], rank: int, world: int, port: int, timeout_s: float,
          env: dict[str, str], out: mp.Queue) -> None:  # fmt: skip
    import torch

    from mjlab_hpc.rank.context import DistContext, process_group

    os.environ.update({k: v.format(rank=rank) for k, v in env.items()})
    torch.set_num_threads(1)
    try:
        with process_group(DistContext.from_env(rank_env(rank, port, world)), "cpu", timeout_s):
            out.put((rank, body(rank)))
    except Exception as e:  # the test reads what the rank saw
        out.put((rank, ("error", type(e).__name__, str(e))))


def _spawn(
    body: Callable[[int], Any],
    world: int = 2,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    wait_for: int | None = None,
) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_main, args=(body, r, world, port, timeout_s, env or {}, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(world if wait_for is None else wait_for))
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return got


def _reductions(rank: int) -> dict[str, Any]:
    """Every dtype the training reduces, sizes around the slot's capacity, the gather path's
    answer for the same inputs, and whether the channel carried them."""
    import torch
    import torch.distributed as dist

    from mjlab_hpc.collective import max_over_ranks, same_node_channel, sum_over_ranks

    channel = same_node_channel()
    gen = torch.Generator().manual_seed(1234 + rank)
    same, count = [], 0
    sizes = [1, 3, 2565, 100_000]
    if channel is not None:
        sizes.append(channel.slot_bytes // 4 + 1)  # one float32 too many: gloo
    for i in range(60):
        n = sizes[i % len(sizes)]
        dtype = [torch.float32, torch.float64, torch.int64][i % 3]
        x = (torch.randn(n, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        want_sum = parts[0].clone()
        for p in parts[1:]:
            want_sum += p
        want_max = torch.stack(parts).amax(dim=0)
        got_sum = sum_over_ranks(x.clone())
        got_max = max_over_ranks(x.clone())
        same.append(bool(torch.equal(got_sum, want_sum) and torch.equal(got_max, want_max)))
        count += 2
    # Non-contiguous tensors are not the channel's: they take the gloo path, same answer.
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)
    sum_over_ranks(m)
    return {
        "channel": channel is not None,
        "calls": channel.calls if channel is not None else 0,
        "spin_s": channel.spin_s if channel is not None else None,
        "same": all(same),
        "strided": m.tolist(),
        "files": sorted(glob.glob("/dev/shm/mjlab-hpc-*")),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_same_node_sums_are_bit_identical_to_the_gather_path(world: int) -> None:
    before = set(glob.glob("/dev/shm/mjlab-hpc-*"))
    got = _spawn(_reductions, world=world)
    for rank in range(world):
        r = got[rank]
        assert r["channel"] is True, r
        assert r["same"] is True
        # A waiting rank spins long only when every rank can have a core of its own.
        assert r["spin_s"] == (0.05 if world <= len(os.sched_getaffinity(0)) else 0.002)
        # 60 sums and 60 maxima, less the 12 of each that do not fit the slot.
        assert r["calls"] == 120 - 24
        want = [[float(sum(k + 1 for k in range(world)) * (4 * j + i)) for j in range(3)]
                for i in range(4)]  # fmt: skip
        assert r["strided"] == want
        # The mapping was unlinked once every rank had it: nothing on /dev/shm while running.
        assert set(r["files"]) <= before
    assert set(glob.glob("/dev/shm/mjlab-hpc-*")) <= before


def test_turned_off_on_rank_0_means_gloo_everywhere() -> None:
    got = _spawn(_reductions, env={SHARED_MEMORY_ENV: "0"})
    assert [got[r]["channel"] for r in (0, 1)] == [False, False]
    assert all(got[r]["same"] for r in (0, 1))


def test_ranks_on_different_slurm_nodes_use_gloo_even_on_one_machine() -> None:
    # The test cluster's nodes share this machine; a job over two of them is still multi-node.
    got = _spawn(_reductions, env={"SLURMD_NODENAME": "node{rank}"})
    assert [got[r]["channel"] for r in (0, 1)] == [False, False]
    assert all(got[r]["same"] for r in (0, 1))
    same = _spawn(_reductions, env={"SLURMD_NODENAME": "node1"})
    assert [same[r]["channel"] for r in (0, 1)] == [True, True]


def _dies_or_sleeps(how: str) -> Callable[[int], Any]:
    def body(rank: int) -> Any:
        import torch

        from mjlab_hpc.collective import same_node_channel, sum_over_ranks

        assert same_node_channel() is not None
        sum_over_ranks(torch.ones(4))
        if rank == 1:
            if how == "exit":
                os._exit(9)
            time.sleep(8)
            os._exit(0)
        t0 = time.monotonic()
        try:
            sum_over_ranks(torch.ones(4))
        except RuntimeError as e:
            return ("raised", str(e), time.monotonic() - t0)
        return ("returned", "", time.monotonic() - t0)

    return body


def _exit_body(rank: int) -> Any:
    return _dies_or_sleeps("exit")(rank)


def _sleep_body(rank: int) -> Any:
    return _dies_or_sleeps("sleep")(rank)


def test_a_peer_that_exits_ends_the_wait_as_a_lost_peer() -> None:
    got = _spawn(_exit_body, timeout_s=60, wait_for=1)
    what, msg, waited = got[0]
    assert what == "raised", got[0]
    assert "rank 1" in msg and "exited" in msg
    assert waited < 5  # not the 60 s timeout
    assert failure_kind(RuntimeError(msg)) == "peer-lost"


def test_a_silent_peer_times_out_with_the_process_group_timeout() -> None:
    got = _spawn(_sleep_body, timeout_s=3, wait_for=1)
    what, msg, waited = got[0]
    assert what == "raised", got[0]
    assert "rank 1" in msg and "timed out" in msg
    assert 3 <= waited < 10
    assert failure_kind(RuntimeError(msg)) == "peer-lost"


def _edge_cases(rank: int) -> dict[str, Any]:
    """A tensor first reduced inside torch.inference_mode and then outside it (the normalizer
    merge, then a float64 policy's gradients), an empty tensor, and ranks whose calls differ."""
    import torch

    from mjlab_hpc.collective import same_node_channel, sum_over_ranks

    got: dict[str, Any] = {"channel": same_node_channel() is not None}
    with torch.inference_mode():
        inside = sum_over_ranks(torch.full((5,), float(rank + 1), dtype=torch.float64))
    outside = sum_over_ranks(torch.full((5,), float(rank + 1), dtype=torch.float64))
    got["inference_then_not"] = [inside.tolist(), outside.tolist()]
    got["empty"] = sum_over_ranks(torch.empty(0)).numel()
    try:
        sum_over_ranks(torch.ones(3 if rank == 0 else 4))  # a bug in a caller
        got["mismatch"] = "no error"
    except RuntimeError as exc:
        got["mismatch"] = str(exc)
    return got


def test_odd_calls_do_not_pass_silently() -> None:
    got = _spawn(_edge_cases)
    for rank in (0, 1):
        r = got[rank]
        assert r["channel"] is True
        assert r["inference_then_not"] == [[3.0] * 5, [3.0] * 5]
        assert r["empty"] == 0
        # Different element counts: an error naming both, not each other's bytes added up.
        assert "do not match" in r["mismatch"] and "rank" in r["mismatch"], r["mismatch"]

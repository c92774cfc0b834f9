"""Sums and maxima over the ranks of the process group, the same bits on every rank.

The two reductions the training loop makes every iteration (gradients and normalizer moments:
sums; the stop agreement: a maximum) go through here. Three paths, picked per call, all giving
the same bits for the same inputs:

- every rank on this machine (set up by `same_node_reductions`, entered by the process group):
  shared memory, tens of microseconds (`shared_memory.SameNodeChannel`);
- gloo with up to `GATHER_MAX_RANKS` ranks: an all-gather and local additions in rank order;
- NCCL and larger gloo groups: torch.distributed's all-reduce.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from mjlab_hpc.collective.shared_memory import SameNodeChannel, open_channel

if TYPE_CHECKING:
    import torch

__all__ = [
    "GATHER_MAX_RANKS",
    "SHARED_MEMORY_ENV",
    "max_over_ranks",
    "same_node_channel",
    "same_node_reductions",
    "sum_over_ranks",
]

# Above this many ranks a gather moves too much data; all-reduce wins.
GATHER_MAX_RANKS = 8
#: Set to 0 to keep every reduction on torch.distributed (gloo) even when all ranks share a machine.
SHARED_MEMORY_ENV = "MJLAB_HPC_SHARED_MEMORY"

# The channel of the process group this process is in (torch.distributed keeps its default
# group the same way): set for the block of `same_node_reductions` only, which the process group
# enters; reductions happen on the thread that made the group.
_CHANNEL: ContextVar[SameNodeChannel | None] = ContextVar("mjlab_hpc_same_node", default=None)


def same_node_channel() -> SameNodeChannel | None:
    """The shared-memory channel of the current process group, None when there is none."""
    return _CHANNEL.get()


@contextmanager
def same_node_reductions(
    timeout_s: float, env: Mapping[str, str] | None = None
) -> Iterator[SameNodeChannel | None]:
    """Collectively, right after the process group is made: reductions between CPU tensors
    go through shared memory for the block when every rank is on this machine (and
    MJLAB_HPC_SHARED_MEMORY is not 0 on rank 0); yields the channel or None."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    channel = None
    if dist.get_backend() == "gloo":  # the same on every rank; NCCL keeps its own collectives
        wanted = [env.get(SHARED_MEMORY_ENV, "1").strip() != "0"]
        dist.broadcast_object_list(wanted, src=0)  # rank 0 decides: all ranks take one path
        channel = open_channel(timeout_s) if wanted[0] else None
    token = _CHANNEL.set(channel)
    try:
        yield channel
    finally:
        _CHANNEL.reset(token)
        if channel is not None:
            channel.close()


def _reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    import torch  # here: the CLIs import the process group's module and must not load torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    world = dist.get_world_size()
    if world == 1:
        return tensor
    channel = same_node_channel()
    if channel is not None and channel.fits(tensor):
        return channel.reduce_(tensor, op)
    if op == "max":
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor
    if dist.get_backend() != "gloo" or world > GATHER_MAX_RANKS:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    tensor.copy_(parts[0])
    for part in parts[1:]:
        tensor += part
    return tensor


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Replace `tensor` by its sum over all ranks (in place; returned). Without a process
    group it is left as it is.

    gloo's all-reduce takes several message rounds even between two processes: on a 2-core VM
    0.25-0.45 ms for one or two elements but 1.0-1.8 ms from four elements up (the gradient
    buffer included), while an all-gather of the same data takes 0.5-0.7 ms. With few ranks,
    gathering everyone's tensor and adding them locally is the cheaper sum; on one machine,
    shared memory is cheaper still. Additions run element by element in rank order, so every
    rank computes the same bits, on either path (on any CPU: one IEEE addition per element
    and step, no vectorised reduction tree). NCCL (GPUs) and larger gloo groups keep the
    all-reduce, whose cost does not grow with the world size as gathering does.
    """
    return _reduce(tensor, "sum")


def max_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Replace `tensor` by its elementwise maximum over all ranks (in place; returned)."""
    return _reduce(tensor, "max")

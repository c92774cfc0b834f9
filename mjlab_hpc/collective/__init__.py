"""Reductions over the ranks of a job: one home for how ranks sum and agree (shared memory on
one machine, gloo's all-gather or all-reduce otherwise, NCCL on GPUs). Light: torch loads when
a reduction runs."""

from mjlab_hpc.collective.shared_memory import PeerLost, SameNodeChannel
from mjlab_hpc.collective.sums import (
    SHARED_MEMORY_ENV,
    max_over_ranks,
    same_node_channel,
    same_node_reductions,
    sum_over_ranks,
)

__all__ = [
    "SHARED_MEMORY_ENV",
    "PeerLost",
    "SameNodeChannel",
    "max_over_ranks",
    "same_node_channel",
    "same_node_reductions",
    "sum_over_ranks",
]

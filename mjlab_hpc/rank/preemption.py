"""Preemption and time limits: stop at an iteration boundary, checkpoint, requeue, resume.

1. Slurm sends USR2 to every task `--signal-delay-s` before the time limit (SIGTERM when the
   job is preempted). The handler on every rank only records the signal: acting inside a
   handler could interrupt a collective half way.
2. At the next iteration boundary all ranks agree through one all-reduce (MAX of the recorded
   signal), so they stop at the same iteration even if the signal reached them at different
   moments.
3. The writer saves a complete checkpoint (atomically); then the job requeues itself (rank 0
   runs `scontrol requeue`; submitit's local executor restarts tasks that exit with 144) and
   every rank exits promptly.
4. The restarted job finds the checkpoint in the same run directory and continues.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from mjlab_hpc.errors import EXIT_LOCAL_REQUEUE, EXIT_STOPPED
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.slurm.client import SlurmClient

__all__ = [
    "LOCAL_REQUEUE_EXIT_CODE",
    "STOPPED_EXIT_CODE",
    "StopReason",
    "StopRequest",
    "Stopped",
    "after_stop",
    "agree",
    "stop_reason",
    "watch_signals",
]

log = logging.getLogger("mjlab_hpc")

# What submitit's local executor reads as "requeue me" (submitit.local.local).
LOCAL_REQUEUE_EXIT_CODE = EXIT_LOCAL_REQUEUE

StopReason = Literal["time-limit", "preemption", "interrupt"]


class StopRequest:
    """The signal a rank received, if any (written by the handler, read at a boundary)."""

    def __init__(self) -> None:
        self.signum = 0
        self.signaled_at: float | None = None

    def handler(self, signum: int, frame: object) -> None:
        # Only record: the training loop acts at the next iteration boundary.
        self.signum = max(self.signum, signum)
        if self.signaled_at is None:
            self.signaled_at = time.time()


@contextlib.contextmanager
def watch_signals(signal_names: tuple[str, ...]) -> Iterator[StopRequest]:
    """Record the given signals for the duration of the block, then restore the old handlers.

    Outside the main thread (where Python allows no handlers) nothing is installed.
    """
    request = StopRequest()
    old: dict[int, object] = {}
    try:
        for name in signal_names:
            num = signal.Signals[f"SIG{name}" if not name.startswith("SIG") else name]
            old[num] = signal.signal(num, request.handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield request
    finally:
        for num, handler in old.items():
            signal.signal(num, handler)  # type: ignore[arg-type]


def agree(request: StopRequest, distributed: bool, device: str) -> int:
    """The largest signal any rank recorded (0: none); the same answer on every rank."""
    if not distributed:
        return request.signum
    flag = torch.tensor([request.signum], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def stop_reason(signum: int, time_limit_signal: str) -> StopReason:
    """USR2 (our --signal) means the time limit is near; SIGTERM, a preemption."""
    name = signal.Signals(signum).name
    if name.removeprefix("SIG") == time_limit_signal.removeprefix("SIG"):
        return "time-limit"
    if name == "SIGTERM":
        return "preemption"
    return "interrupt"


class Stopped(Exception):
    """Raised out of the training loop after the stop checkpoint is on disk."""

    def __init__(
        self, iteration: int, reason: StopReason, signum: int, ctx: DistContext | None = None
    ) -> None:
        super().__init__(iteration, reason, signum)
        self.iteration = iteration
        self.reason = reason
        self.signum = signum
        self.ctx = ctx
        """The stopped rank's context (set by train_rank), for the launcher's next step."""

    def __str__(self) -> str:
        return f"stopped at iteration {self.iteration} ({self.reason}, signal {self.signum})"


# Exit code of a rank that stopped cleanly before the end, where nothing requeues it.
STOPPED_EXIT_CODE = EXIT_STOPPED


def after_stop(stop: Stopped, ctx: DistContext | None, max_restarts: int) -> int:
    """Requeue the job where the launcher can, and return the exit code for this rank.

    srun tasks: rank 0 runs `scontrol requeue` (up to `max_restarts` times); every rank then
    exits 0 and Slurm starts the job again with SLURM_RESTART_COUNT + 1. submitit's local
    executor: every rank exits 144 and the executor restarts them. Elsewhere (a plain process,
    torchrun): exit 3 and say how to resume. `ctx` defaults to the one the stop carries.
    """
    ctx = ctx or stop.ctx
    if ctx is None:
        return STOPPED_EXIT_CODE
    if ctx.mode == "slurm" and ctx.job_id:
        if ctx.restart_count >= max_restarts:
            log.error(
                "%s; not requeued: the job already restarted %d times (--max-restarts %d)",
                stop,
                ctx.restart_count,
                max_restarts,
            )
            return 1
        if ctx.is_main and not SlurmClient().requeue(ctx.job_id):
            return 1
        return 0
    if ctx.mode == "submitit-local":
        return LOCAL_REQUEUE_EXIT_CODE
    return STOPPED_EXIT_CODE

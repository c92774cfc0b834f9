"""What runs inside one rank: `RankJob` (what submitit runs in every task of a job), the
training from start to end (`train`: the per-rank entry point and the iteration boundary),
where the rank stands in the job (`context`), where it starts from (`resume`), what it trains
(`workload`: environments and runner), the runner (`runner`), what the ranks exchange (`ppo`,
`normalization`), stops (`stop`) and the hang watchdog (`watchdog`).

Only this module and `context` are light; the others import torch, warp and rsl-rl.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mjlab_hpc.procs import offer_to_oom_killer
from mjlab_hpc.rank.context import DETACHED_ENV, chain_link
from mjlab_hpc.rank.signals import handled
from mjlab_hpc.rundir.state import cancel_marker, read_record
from mjlab_hpc.spec import ResolvedSpec

if TYPE_CHECKING:
    from mjlab_hpc.rank.train import RankResult

__all__ = ["RankJob"]


@dataclass(frozen=True)
class RankJob:
    """One rank's training as a picklable callable, for submitit's executors. Light: the
    submitting process pickles it; the rank imports the training code when the job runs."""

    spec: ResolvedSpec
    master_port: int | None = None
    """The launcher's port for local jobs; Slurm jobs derive theirs from the job id."""

    def __call__(self) -> RankResult | None:
        offer_to_oom_killer()  # before the worlds take memory
        # Where this task runs, in its output before its rank log exists (`mjlab-hpc logs`):
        # the Slurm node, which the machine's own name need not be.
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"mjlab-hpc: starting on host {node}, pid {os.getpid()}", flush=True)
        done = _chain_done(self.spec.train.run_dir)
        if done is not None:
            print(done, file=sys.stderr, flush=True)
            return None
        # A stop that arrives while torch, Warp and rsl-rl load (seconds) is recorded here and
        # handed on; submitit's own handlers would only log it.
        early = _record_early_stops(self.spec.train.preempt_signal)
        from mjlab_hpc.rank.train import run_job  # torch, warp, rsl-rl: in the rank only

        return run_job(self.spec, self.master_port, early)


def _chain_done(run_dir: str | None) -> str | None:
    """Why a later job of a --chain has nothing to do (the run completed, or was cancelled
    with `mjlab-hpc cancel`), None when it continues the run (or is not in a chain)."""
    link = chain_link(os.environ)
    if link is None or link[0] == 1 or not run_dir:
        return None
    record = read_record(Path(run_dir))
    if record.get("state") == "completed":
        why = "the run already completed"
    elif cancel_marker(Path(run_dir), record) is not None:
        why = "the run was cancelled (mjlab-hpc cancel)"
    else:
        return None
    return f"job {link[0]} of {link[1]} of the chain: {why}, nothing to do"


def _record_early_stops(preempt_signal: str) -> list[int]:
    """Record every signal a rank handles (`rank.signals`; INT and HUP not when the job runs
    in the background) until `train_rank` installs its own handlers; the signals so far."""
    early: list[int] = []
    for num in handled(preempt_signal, DETACHED_ENV in os.environ):
        signal.signal(num, lambda signum, frame: early.append(signum))
    return early

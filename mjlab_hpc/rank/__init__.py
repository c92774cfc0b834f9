"""What runs inside one rank, and `RankJob`, what submitit runs in every task of a job.

`train` is the per-rank entry point; `context` says where the rank stands in the job,
`resume` where it starts from, `workload` and `runner` what it trains, `kernel_cache` where
Warp keeps its compiled kernels. `signals` and `stop` handle stops, `watchdog` hangs
(`beats`: how the ranks know each other alive), `stragglers` slow ranks, `normalization`
what the ranks' normalizers exchange. This module imports only light ones (`context`,
`signals`): the training code (torch, warp, rsl-rl) loads in the rank.
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
from mjlab_hpc.rundir.record import RunState, read_record
from mjlab_hpc.rundir.state import cancel_marker
from mjlab_hpc.spec import ResolvedSpec

if TYPE_CHECKING:
    from mjlab_hpc.rank.train import RankResult

__all__ = ["RankJob"]


@dataclass(frozen=True)
class RankJob:
    """One rank's training as a picklable callable, for submitit's executors.

    It is light: the submitting process pickles it, and the rank imports the training code
    when the job runs.
    """

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
    """Return why a later job of a --chain has nothing to do (None: it continues the run).

    The run completed, or was cancelled with `mjlab-hpc cancel`. A job outside a chain
    always continues.
    """
    link = chain_link(os.environ)
    if link is None or link[0] == 1 or not run_dir:
        return None
    record = read_record(Path(run_dir))
    if record.state == RunState.COMPLETED:
        why = "the run already completed"
    elif cancel_marker(Path(run_dir), record) is not None:
        why = "the run was cancelled (mjlab-hpc cancel)"
    else:
        return None
    return f"job {link[0]} of {link[1]} of the chain: {why}, nothing to do"


def _record_early_stops(preempt_signal: str) -> list[int]:
    """Record the signals a rank handles until `train_rank` installs its own handlers.

    Returns the list they are recorded in. INT and HUP are left alone when the job runs in
    the background (`rank.signals`).
    """
    early: list[int] = []
    for num in handled(preempt_signal, DETACHED_ENV in os.environ):
        signal.signal(num, lambda signum, frame: early.append(signum))
    return early

"""What every task of a submitted job runs (pickled by submitit): one rank's training, then
the exit a stop asks for.

This module stays light (no torch) because the submitting process pickles `RankJob`; the
rank imports the training code when the job runs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mjlab_hpc.errors import EXIT_INTERRUPTED
from mjlab_hpc.rank.context import DETACHED_ENV, chain_link
from mjlab_hpc.rundir.state import cancel_marker, read_record
from mjlab_hpc.spec import ResolvedSpec

if TYPE_CHECKING:
    from mjlab_hpc.rank.entry import RankResult

__all__ = ["RankJob"]


@dataclass(frozen=True)
class RankJob:
    """`train_rank(spec)` as a picklable callable, for submitit's executors."""

    spec: ResolvedSpec
    master_port: int | None = None
    """The launcher's port for local jobs; Slurm jobs derive theirs from the job id."""

    def __call__(self) -> RankResult | None:
        done = _chain_done(self.spec.train.run_dir)
        if done is not None:
            print(done, file=sys.stderr, flush=True)
            return None
        # A stop that arrives while torch, Warp and rsl-rl load (seconds) is recorded here and
        # handed on; submitit's own handlers would only log it.
        early = _record_early_stops(self.spec.train.preempt_signal)
        # torch, warp, rsl-rl: imported inside the rank only.
        from mjlab_hpc.rank.entry import train_rank
        from mjlab_hpc.rank.stop import Stopped, after_stop

        spec = self.spec
        try:
            return train_rank(spec, master_port=self.master_port, early_signals=early)
        except Stopped as stopped:
            code = after_stop(stopped, spec.train.max_restarts)
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once
            code = EXIT_INTERRUPTED
        # Leave at once, writing no result file (the job is not done): the checkpoint is on
        # disk, and a normal interpreter exit spends seconds collecting garbage while the
        # grace time runs.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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
    """Record stop signals (the time-limit signal, TERM, and INT/HUP unless the job runs in
    the background) until `train_rank` installs its own handlers; the signals so far."""
    early: list[int] = []
    names = ["TERM", preempt_signal.upper().removeprefix("SIG")]
    if DETACHED_ENV not in os.environ:
        names += ["INT", "HUP"]
    for name in names:
        signal.signal(signal.Signals["SIG" + name], lambda signum, frame: early.append(signum))
    return early

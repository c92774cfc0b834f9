"""The iteration boundary every rank runs after each PPO iteration: the watchdog's progress,
an injected fault, the one all-reduce on which all ranks agree (a stop, a time-based
checkpoint), the checkpoint, the stop's record, and the record of how a requeued run came
back (time from the fault to its first iteration, iterations computed again)."""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.stop import Stop, StopKind, Stopped, StopRequest, agree_boundary
from mjlab_hpc.rank.watchdog import FaultInjection, Watchdog
from mjlab_hpc.rank.workload import Workload, rank_state
from mjlab_hpc.rundir.checkpoint import Checkpoints
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.progress import IterationStats
from mjlab_hpc.rundir.state import interruptions, on_recovered, on_stop, read_record
from mjlab_hpc.rundir.writer import RunWriter
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.spec import TrainSpec

__all__ = ["IterationBoundary", "note_node_failure", "requeues_so_far"]

log = logging.getLogger("mjlab_hpc")

# Slurm node states that mean the node is lost, not preempted (a drain lets jobs finish).
_LOST = ("DOWN", "FAIL", "NOT_RESPONDING")


def requeues_so_far(run: RunDir) -> dict[str, int]:
    """Requeues of the run so far, by reason (time-limit, preemption, node-lost, crash, ...)."""
    counts: dict[str, int] = {}
    for entry in interruptions(read_record(run.path)):
        if entry.get("kind", "requeue") == "requeue":
            reason = str(entry.get("reason"))
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def note_node_failure(
    rec: dict[str, Any], job_id: str | None, restart_count: int, iteration: int
) -> dict[str, Any]:
    """The run record once a Slurm job that was requeued because a node failed starts again
    (sacct says NODE_FAIL for its previous run): the stop its ranks recorded (SIGTERM, taken
    for a preemption) becomes `node-lost`, or, when the node died before they could record
    anything, a `node-lost` fault is added."""
    if not job_id or restart_count < 1:
        return rec
    runs = SlurmClient().attempts(job_id)
    if not runs or len(runs) < 2 or runs[-2][0] != "NODE_FAIL":
        return rec
    _, nodes, ended = runs[-2]
    rec = copy.deepcopy(rec)
    mine = [e for e in interruptions(rec)
            if e.get("job_id") == job_id and e.get("restart_count", restart_count - 1)
            == restart_count - 1]  # fmt: skip
    if mine:
        if mine[-1].get("reason") == "preemption":
            mine[-1]["reason"] = "node-lost"
            mine[-1].setdefault("nodes", [nodes])
        return rec
    try:
        at_s = dt.datetime.fromisoformat(ended).timestamp()  # sacct: local time
    except ValueError:
        at_s = time.time()
    rec["faults"] = [*rec.get("faults", []), {
        "reason": "node-lost", "kind": "requeue", "nodes": [nodes], "job_id": job_id,
        "restart_count": restart_count - 1, "iteration": iteration, "at": ended,
        "at_s": at_s, "action": "requeued by Slurm (NODE_FAIL)",
    }]  # fmt: skip
    return rec


def _gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


@dataclass
class IterationBoundary:
    """The per-iteration boundary every rank runs (an rsl-rl iteration hook)."""

    work: Workload
    run: RunDir
    ctx: DistContext
    device: str
    spec: TrainSpec
    total: int
    start: int
    """The iteration this start resumed from."""
    request: StopRequest
    writer: RunWriter | None
    checkpoints: Checkpoints | None
    restarts: dict[str, int]
    """Requeues so far by reason (the same on every rank: read before training)."""
    watchdog: Watchdog | None = None
    injections: tuple[FaultInjection, ...] = ()
    _last_save: float = field(default_factory=time.monotonic)
    _recovered: bool = False

    def __call__(self, runner: Any, s: IterationStats) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(s.iteration)
        if self.writer is not None and not self._recovered:
            self._recovered = True
            self._record_recovery()
        for injection in self.injections:
            injection.fire_if_due(self.run, self.ctx.rank, s.iteration)
        every = self.spec.save_every_min
        due = every is not None and time.monotonic() - self._last_save >= every * 60
        stop, save = agree_boundary(self.request, self.ctx.is_distributed, self.device, due)
        if stop is not None and s.iteration >= self.total:
            stop = None  # the run is done: it completes (every rank agreed on the same value)
        if self.watchdog is not None and (stop is not None or s.iteration >= self.total):
            self.watchdog.disarm()  # what follows (W&B's upload, the last records) is no hang
        periodic = save or s.iteration % self.spec.save_interval == 0 or s.iteration == self.total
        if stop is not None or periodic:
            if self.watchdog is not None:
                with self.watchdog.paused():
                    self._checkpoint(s.iteration, stop)
            else:
                self._checkpoint(s.iteration, stop)
        if stop is not None:
            raise Stopped(s.iteration, stop, self.ctx, self.restarts.get(stop.reason, 0))

    def _checkpoint(self, iteration: int, stop: Stop | None) -> None:
        t0 = time.time()
        states = (
            _gather_to_main(rank_state(self.work.env, self.device), self.ctx)
            if self.work.exact_resume
            else None
        )
        if self.writer is not None and self.checkpoints is not None:
            path = self.writer.run.checkpoint(iteration)
            t1 = time.time()
            self.work.save(path, self.writer, states)
            written_s = time.time() - t1
            size = path.stat().st_size if path.is_file() else -1
            log.info(
                "checkpoint %s: %d bytes, ranks' states gathered in %.3f s, written in %.3f s",
                path.name, size, t1 - t0, written_s,
            )  # fmt: skip
            self.checkpoints.written(path)
            self.checkpoints.prune(self.spec.keep_checkpoints)
            if stop is not None:
                self._record_stop(stop, iteration, t0)
        if self.ctx.is_distributed:
            # The others wait here, not in the next iteration's first collective, so that
            # their watchdogs (paused now) never count a long write as a hang.
            dist.barrier()
        self._last_save = time.monotonic()

    def _record_recovery(self) -> None:
        assert self.writer is not None
        writer = self.writer

        def write() -> None:
            before = read_record(writer.run.path)
            after = on_recovered(before, self.start)
            if after != before:
                writer.write_json(writer.run.record, after)

        try:
            writer.last_records(write)
        except Exception as exc:  # a record, not the training
            log.warning("could not record the recovery in run.json: %s", exc)

    def _lost_nodes(self) -> list[str]:
        """Nodes of this job that Slurm marks down or failing (a SIGTERM because a node
        failed, not a preemption)."""
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if self.ctx.mode != "slurm" or not nodelist:
            return []
        client = SlurmClient()
        hosts = client.hostnames(nodelist) or []
        if not hosts:
            return []
        proc = client.run(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N|%T"])
        if proc is None or proc.returncode != 0:
            return []
        return sorted({
            line.split("|")[0] for line in proc.stdout.splitlines()
            if "|" in line and any(w in line.split("|")[1].upper() for w in _LOST)
        })  # fmt: skip

    def _record_stop(self, stop: Stop, iteration: int, t0: float) -> None:
        assert self.writer is not None
        reason: str = stop.reason
        lost = self._lost_nodes() if stop.reason == "preemption" else []
        if lost:
            reason = "node-lost"
        entry = {
            "reason": reason,
            "kind": "requeue" if stop.kind == StopKind.REQUEUE else "stop",
            "signal": stop.signal_name,
            "iteration": iteration,
            "job_id": self.ctx.job_id,
            "restart_count": self.ctx.restart_count,
            "signal_at": self.request.signaled_at,
            "checkpoint_at": time.time(),
            "checkpoint_s": round(time.time() - t0, 3),
        }
        if lost:
            entry["nodes"] = lost
            log.warning("node(s) %s lost: the job is requeued from iteration %d",
                        ", ".join(lost), iteration)  # fmt: skip
        run = self.writer.run
        writer = self.writer

        def write() -> None:
            writer.append_line(run.restarts, json.dumps(entry))
            writer.write_json(run.record, on_stop(read_record(run.path), entry))

        writer.last_records(write)

"""Where a rank's training starts: the newest checkpoint of the run that verifies, else the
checkpoint of another run it starts from (mjlab's `--agent.resume True`: models, optimizer
and normalizers, iteration 0), else iteration 0, refusing what cannot be continued (a run of
another task, a network of another shape, nothing valid left) before anything of the run is
changed.

Rank 0 decides (it verifies each checkpoint once) and every rank gets the same plan, or the
same refusal, through the process group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.workload import Workload
from mjlab_hpc.rundir.checkpoint import Checkpoints, Damaged, cannot_continue, load_verified
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.spec import ResolvedSpec

__all__ = ["ResumePlan", "ResumeRefused", "load_plan", "plan_resume"]

log = logging.getLogger("mjlab_hpc")


class ResumeRefused(SpecError):
    """The run directory cannot be continued by this spec; nothing of it was changed."""


@dataclass(frozen=True)
class ResumePlan:
    """What this start of the run continues from."""

    checkpoint: str | None
    """The checkpoint to load (None: iteration 0)."""
    damaged: tuple[Damaged, ...]
    """Checkpoints that do not verify and are skipped (newer than the one loaded)."""
    other_run: bool = False
    """The checkpoint is another run's (the run has none of its own yet): its weights start
    this run at iteration 0."""


def _decide(run: RunDir, resolved: ResolvedSpec, checkpoints: Checkpoints) -> ResumePlan:
    refusal = cannot_continue(checkpoints, resolved.task, resolved.train.restart_from_scratch)
    if refusal is not None:
        raise ResumeRefused(refusal.flag, refusal.problem)
    path, damaged = checkpoints.newest_valid()  # verdicts are cached: no second read
    source = resolved.start_checkpoint
    if path is None and source:
        flag = "--wandb-run-path" if resolved.train.wandb_run_path else "--agent.load-checkpoint"
        src = Path(source)
        why = Checkpoints(src.parent).problem(src) if src.is_file() else f"{src} is gone"
        if why is not None:
            raise ResumeRefused(flag, f"cannot start from {src}: {why}")
        return ResumePlan(str(src), tuple(damaged), other_run=True)
    return ResumePlan(None if path is None else str(path), tuple(damaged))


def plan_resume(
    run: RunDir, resolved: ResolvedSpec, ctx: DistContext, checkpoints: Checkpoints | None
) -> ResumePlan:
    """The same plan on every rank (`checkpoints`: rank 0's view of the run; None on the
    others), or ResumeRefused raised on every rank."""
    answer: list[Any] = [None]
    if ctx.is_main:
        assert checkpoints is not None
        try:
            answer = [_decide(run, resolved, checkpoints)]
        except ResumeRefused as exc:
            answer = [(exc.flag, exc.problem)]
    if ctx.is_distributed:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], tuple):
        raise ResumeRefused(*answer[0])
    plan = answer[0]
    assert isinstance(plan, ResumePlan)
    return plan


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def check_shapes(path: Path, ckpt: dict[str, Any], runner: Any, flag: str = "--run-dir") -> None:
    """ResumeRefused (as `flag`) naming the first parameter whose shape differs between the
    checkpoint and this run's networks (another task, other hidden sizes)."""
    for part, module in (("actor", runner.alg.actor), ("critic", runner.alg.critic)):
        saved = ckpt.get(f"{part}_state_dict")
        if not isinstance(saved, dict):
            continue
        ours = _shapes(module)
        theirs = {k: tuple(v.shape) for k, v in saved.items() if hasattr(v, "shape")}
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                raise ResumeRefused(
                    flag,
                    f"{path.name} holds a network of another shape: {part}.{key} is "
                    f"{theirs.get(key, 'absent')} there and {ours.get(key, 'absent')} here "
                    "(another task or other --agent settings); nothing was changed",
                )


def load_plan(plan: ResumePlan, work: Workload, device: str) -> int:
    """Restore the plan's checkpoint into this rank's workload; the iterations it had done
    (0: a fresh start)."""
    if plan.checkpoint is None:
        return 0
    path = Path(plan.checkpoint)
    ckpt = load_verified(path, map_location=device)
    check_shapes(
        path, ckpt, work.runner, "--agent.load-checkpoint" if plan.other_run else "--run-dir"
    )
    work.load(path, ckpt, plan.other_run)
    if plan.other_run:
        log.info("started from %s (another run's checkpoint, iteration %s there) at iteration 0",
                 path, ckpt.get("iter"))  # fmt: skip
        return 0
    log.info("resumed from %s at iteration %d", path.name, work.runner.current_learning_iteration)
    return int(work.runner.current_learning_iteration)

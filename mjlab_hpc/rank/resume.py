"""Where a rank's training starts, decided before anything of the run changes.

A run continues from its newest checkpoint that verifies, with this rank's saved environments
and random generators (new environments with --fresh-envs, where the saved ones do not fit).
A run without checkpoints of its own may start from another run's (mjlab's
`--agent.resume True`: models, optimizer and normalizers, at iteration 0), else at
iteration 0. What cannot be continued is refused: a run of another task, a network of another
shape, environments saved for another number of ranks or environments, seed or simulator
version, nothing valid left.

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
from mjlab_hpc.rank.workload import Workload, restore_rank_state
from mjlab_hpc.rundir.checkpoint import (
    Checkpoints,
    Damaged,
    cannot_continue,
    env_states_pruned,
    load_rank_state,
    load_verified,
    rank_state_world_size,
)
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
    """The checkpoint is another run's: its weights start this run at iteration 0.

    The run has none of its own yet."""


def _decide(run: RunDir, resolved: ResolvedSpec, checkpoints: Checkpoints) -> ResumePlan:
    train = resolved.train
    refusal = cannot_continue(
        checkpoints, resolved.task, train.restart_from_scratch, fresh_envs=train.fresh_envs
    )
    if refusal is not None:
        raise ResumeRefused(refusal.flag, refusal.problem)
    path, damaged = checkpoints.newest_valid()  # verdicts are cached: no second read
    source = resolved.start_checkpoint
    if path is None and source:
        flag = "--wandb-run-path" if resolved.train.wandb_run_path else "--agent.load-checkpoint"
        src = Path(source)
        why = Checkpoints(src.parent).problem(src)
        if why is not None:
            raise ResumeRefused(flag, f"cannot start from {src}: {why}")
        return ResumePlan(str(src), tuple(damaged), other_run=True)
    return ResumePlan(None if path is None else str(path), tuple(damaged))


def plan_resume(
    run: RunDir, resolved: ResolvedSpec, ctx: DistContext, checkpoints: Checkpoints | None
) -> ResumePlan:
    """Decide on rank 0 where the run starts, and hand every rank the same plan.

    `checkpoints` is rank 0's view of the run (None on the others). A refusal is raised as
    ResumeRefused on every rank.
    """
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
    """Refuse a checkpoint whose networks have another shape than this run's.

    The ResumeRefused (as `flag`) names the first parameter whose shape differs (another
    task, other hidden sizes).
    """
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


def _unfit(
    path: Path, ckpt: dict[str, Any], work: Workload, world_size: int, resized: bool
) -> tuple[str, str] | None:
    """Return (flag, why) when the checkpoint's saved environments cannot be restored here.

    `resized`: the healer changed the world size, which is then no reason.
    """
    saved = (ckpt.get("infos") or {}).get("environments")
    if env_states_pruned(path):
        return "--fresh-envs", f"{path.name}'s environment states were pruned (--keep-env-states)"
    if not isinstance(saved, dict) or rank_state_world_size(path) is None:
        return "--fresh-envs", f"{path.name} holds no environment state (older mjlab_hpc)"
    if saved["world_size"] != world_size and not resized:
        return "--num-procs", (
            f"{path.name} holds the environments of {saved['world_size']} rank(s); this start "
            f"has {world_size} (--num-procs, --gpu-ids, or the job's --nodes x --tasks-per-node)"
        )
    for key, flag in (("num_envs", "--num-envs"), ("seed", "--seed"), ("device", "--device")):
        if saved.get(key) != work.fits[key]:
            what = key.replace("_", " ")
            return flag, f"the run has {what} {saved[key]}; this start {work.fits[key]}"
    for name, version in work.fits["versions"].items():
        if saved["versions"].get(name) != version:
            return "--fresh-envs", (
                f"{path.name} was written with {name} {saved['versions'].get(name)}; this is "
                f"{name} {version} (saved environments belong to the version that made them)"
            )
    return None


def load_plan(
    plan: ResumePlan,
    work: Workload,
    device: str,
    ctx: DistContext,
    fresh_envs: bool = False,
    resized: bool = False,
) -> tuple[int, str]:
    """Restore the plan's checkpoint into this rank's workload.

    Returns the iterations the checkpoint had done (0 on a fresh start) and what became of
    the environments: `restored`, `fresh` (--fresh-envs), `new`, or `partly restored`. The
    last is when the healer changed the world size (`resized`): each rank takes the saved
    environments of the rank with its number, those of ranks that are gone are dropped, and
    a rank without saved ones starts new ones.
    """
    if plan.checkpoint is None:
        return 0, "new"
    path = Path(plan.checkpoint)
    ckpt = load_verified(path, map_location=device)
    flag = "--agent.load-checkpoint" if plan.other_run else "--run-dir"
    check_shapes(path, ckpt, work.runner, flag=flag)
    unfit = None if plan.other_run else _unfit(path, ckpt, work, ctx.world_size, resized=resized)
    if unfit is not None and not fresh_envs:
        raise ResumeRefused(
            unfit[0],
            f"{unfit[1]}: a continuation restores its environments exactly; give the run's "
            "value, or pass --fresh-envs to continue with new environments (models, optimizer "
            "and iteration kept; not exact); nothing was changed",
        )
    work.load(path, ckpt, plan.other_run)
    if plan.other_run:
        log.info(
            "started from %s (another run's checkpoint, iteration %s there) at iteration 0",
            path,
            ckpt.get("iter"),
        )
        return 0, "new"
    start = int(work.runner.current_learning_iteration)
    saved_for = (ckpt.get("infos") or {}).get("environments") or {}
    # The run the checkpoint belongs to stays the run's name (its folder may have moved).
    work.fits["run"] = saved_for.get("run") or work.fits["run"]
    if unfit is not None:
        log.warning(
            "resumed from %s at iteration %d with new environments (--fresh-envs): %s",
            path.name,
            start,
            unfit[1],
        )
        return start, "fresh"
    saved = rank_state_world_size(path) or ctx.world_size
    if ctx.rank >= saved:
        log.warning(
            "resumed from %s at iteration %d on %d ranks instead of %d: no saved "
            "environments for rank %d, new ones",
            path.name,
            start,
            ctx.world_size,
            saved,
            ctx.rank,
        )
        return start, "partly restored"
    belongs = {"run": work.fits["run"], "task": work.fits["task"], "iteration": start}
    problems = restore_rank_state(work, load_rank_state(path, ctx.rank, saved, belongs), device)
    for problem in problems:  # a buffer the fresh environment does not have
        log.warning("environment state not restored: %s", problem)
    if saved != ctx.world_size:
        gone = range(ctx.world_size, saved)
        log.warning(
            "resumed from %s at iteration %d on %d ranks instead of %d (the healer's "
            "--min-nodes): the environments of rank %d restored%s",
            path.name,
            start,
            ctx.world_size,
            saved,
            ctx.rank,
            f", those of rank(s) {', '.join(map(str, gone))} dropped" if gone else "",
        )
        return start, "partly restored"
    log.info("resumed from %s at iteration %d, environments restored", path.name, start)
    return start, "restored"

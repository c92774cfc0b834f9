"""Every registered mjlab task's whole environment state is saved and restored.

The state is restored into a freshly built env, compared path by path, then stepped on beside
the original. The runs that continue exactly are in test_mjlab_resume_*.py. Skipped when mjlab
is not installed, except under CI=true, where that fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import make_motion

if os.environ.get("CI") == "true":
    import mjlab  # noqa: F401  (make install brings the extra: on CI a missing mjlab fails)
else:
    pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

import torch
import warp as wp

from mjlab_hpc.tasks import envstate
from mjlab_hpc.tasks import mjlab as mt
from mjlab_hpc.tasks.memory import init_warp

pytestmark = pytest.mark.mjlab

MOTION_FLAG = "--env.commands.motion.motion-file"


def _build(task: str, motion: Path, num_envs: int = 3):
    overrides = [MOTION_FLAG, str(motion)] if "Tracking" in task else []
    with contextlib.redirect_stdout(io.StringIO()):
        runtime = mt.make_mjlab_runtime(
            task,
            num_envs=num_envs,
            max_iterations=1,
            seed=5,
            device="cpu",
            overrides=overrides,
            cpu_graph=True,
        )
    return runtime.env


def _step(env, actions: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    with wp.ScopedDevice("cpu"):
        for a in actions:
            obs, rewards, dones, _ = env.step(a)
            out += [obs["actor"].clone(), rewards.clone(), dones.clone()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("task", mt.list_mjlab_tasks())
def test_every_task_restores_its_whole_state(task: str, tmp_path: Path) -> None:
    """Build, step, save; build again, restore: every tensor, Warp array, generator and value
    reachable from the env is what was saved (the first difference named), nothing is left
    unplaced, and both envs then step on identically. Two fresh builds are identical too, so
    nothing saved is a pointer or handle of one process."""
    init_warp()
    motion = make_motion(tmp_path / "motion.npz")
    first = _build(task, motion)
    rules = mt.state_rules()
    fresh = envstate.capture(first.unwrapped, rules)
    gen = torch.Generator().manual_seed(1)
    acts = [2 * torch.rand(first.num_envs, first.num_actions, generator=gen) - 1 for _ in range(8)]
    _step(first, acts[:4])
    saved = mt.capture_env(first)
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    second = _build(task, motion)
    assert envstate.differences(fresh, envstate.capture(second.unwrapped, rules)) == []
    assert mt.restore_env(second, saved, "cpu") == []
    assert envstate.differences(saved, mt.capture_env(second)) == []

    stepped = []
    for env in (first, second):
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        stepped.append(_step(env, acts[4:]))
    assert all(torch.equal(a, b) for a, b in zip(*stepped, strict=True))
    assert envstate.differences(mt.capture_env(first), mt.capture_env(second)) == []

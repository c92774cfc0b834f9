"""Every Warp array of a rank's workload lives on the rank's device.

Checked on the CPU with the walker the GPU checks use on `cuda:0` (`warp_devices` in
tests/helpers.py, tests/gpu/test_gpu.py).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import warp as wp
from helpers import warp_devices

import mjlab_hpc
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.workload import Workload, build_workload
from mjlab_hpc.rundir.layout import RunDir

wp.config.quiet = True
pytestmark = pytest.mark.training  # builds and steps real worlds


def cpu_workload(tmp_path: Path, task: str, envs: int, *overrides: str) -> Workload:
    """One rank's workload, built as `train_rank` builds it (a single process, on the CPU)."""
    spec = mjlab_hpc.TrainSpec(task=task, num_envs=envs, log_root=str(tmp_path))
    resolved = mjlab_hpc.resolve(spec.replace(overrides=overrides))
    return build_workload(
        resolved,
        DistContext.from_env({}),
        device="cpu",
        seed=0,
        run=RunDir(tmp_path / "run"),
        quiet=io.StringIO(),
    )


def test_every_warp_array_of_a_builtin_rank_is_on_its_device(tmp_path: Path) -> None:
    work = cpu_workload(tmp_path, "cartpole", 4)
    devices = warp_devices(work.env)
    # The model, the data (its nested structs included) and the captured graph are found.
    assert len(devices) > 300, len(devices)
    assert {"env.data.qpos", "env.data.efc.J", "env.model.opt.timestep", "env._graph"} <= set(
        devices
    )
    assert set(devices.values()) == {"cpu"}
    # Reached through the runner too (rsl-rl's runner holds the environment).
    through_runner = warp_devices(work.runner, "runner")
    assert through_runner["runner.env.data.qpos"] == "cpu"
    assert len(through_runner) == len(devices)


def test_the_walker_finds_arrays_in_containers_and_names_them(tmp_path: Path) -> None:
    """What the GPU check would report: an array left in a nested container, by its path."""
    work = cpu_workload(tmp_path, "cartpole", 2)
    stray = wp.zeros(3, dtype=float, device="cpu")
    env: Any = work.env
    env.extra_buffers = {"history": [None, (stray,)]}
    devices = warp_devices(env)
    assert devices["env.extra_buffers['history'][1][0]"] == "cpu"
    # A rank on cuda:0 would report every one of them as misplaced.
    misplaced = {path for path, device in devices.items() if device != "cuda:0"}
    assert misplaced == set(devices)


@pytest.mark.mjlab
@pytest.mark.slow
def test_every_warp_array_of_an_mjlab_rank_is_on_its_device(tmp_path: Path) -> None:
    if os.environ.get("CI") != "true":
        pytest.importorskip(
            "mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')"
        )
    work = cpu_workload(
        tmp_path, "Mjlab-Velocity-Flat-Unitree-G1", 2, "--agent.logger", "tensorboard"
    )
    devices = warp_devices(work.env)
    sim = "env.env.sim"  # mjlab's RslRlVecEnvWrapper -> ManagerBasedRlEnv -> Simulation
    assert {f"{sim}._wp_data.qpos", f"{sim}._wp_model.body_mass"} <= set(devices)
    assert any(".scene." in path for path in devices)  # the sensors' arrays too
    assert set(devices.values()) == {"cpu"}

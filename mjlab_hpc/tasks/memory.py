"""What a task's worlds take in memory, and Warp initialised quietly.

`world_bytes` counts what `mujoco_warp.make_data` allocates per world (state, contacts and
constraints for nconmax and njmax). The model's own arrays, the torch buffers and the
process itself come on top, so `num_envs * world_bytes` is what a rank needs at least.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Any

from mjlab_hpc.spec import ResolvedSpec
from mjlab_hpc.tasks import mjlab
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS

__all__ = ["device_memory", "init_warp", "world_bytes"]


def init_warp() -> None:
    """Initialise Warp without its warning that it finds no CUDA driver.

    Machines without a GPU would print it on every rank. The native library writes it to
    stderr; everything else it writes there is passed on.
    """
    import warp as wp

    wp.config.quiet = True
    wp.config.log_level = wp.LOG_WARNING  # kernel-load lines go nowhere useful on N ranks
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            wp.init()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        for line in caught.read().decode(errors="replace").splitlines(keepends=True):
            if "Could not find or load the NVIDIA CUDA driver" not in line:
                sys.stderr.write(line)


def _array_bytes(data: Any) -> int:
    import warp as wp

    total = 0
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if isinstance(value, wp.array):
            total += int(value.capacity)
        elif dataclasses.is_dataclass(value):
            total += _array_bytes(value)
    return total


def world_bytes(resolved: ResolvedSpec) -> int:
    """Measure the bytes of MuJoCo Warp data per world of the task's model.

    It makes the data for one and for two worlds on the CPU (the same size on every device).
    It loads Warp and MuJoCo Warp, and torch for a built-in task: ask only when the answer
    matters.
    """
    if resolved.task in BUILTIN_TASKS:
        physics = BUILTIN_TASKS[resolved.task].physics
        assert physics is not None
        cfg = physics()
        import mujoco

        model, nconmax, njmax = mujoco.MjModel.from_xml_string(cfg.xml), cfg.nconmax, cfg.njmax
    else:
        train = resolved.train
        model, nconmax, njmax = mjlab.world_model(train.task, train.num_envs, train.overrides)
    init_warp()
    import mujoco_warp as mjw
    import warp as wp

    def size(nworld: int) -> int:
        with wp.ScopedDevice("cpu"):
            return _array_bytes(mjw.make_data(model, nworld=nworld, nconmax=nconmax, njmax=njmax))

    return max(0, size(2) - size(1))


def device_memory(index: int) -> int:
    """Return the total memory of CUDA device `index` (relative to CUDA_VISIBLE_DEVICES)."""
    init_warp()
    import warp as wp

    return int(wp.get_device(f"cuda:{index}").total_memory)

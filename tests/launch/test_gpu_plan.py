"""Which GPU each rank trains on, decided without a GPU: `--gpu-ids` relative to
CUDA_VISIBLE_DEVICES mapped to physical ids (`physical_gpu_ids`, `plan_launch`), then the
variable the rank process gets, then its device (`resolve_device`), for the launch paths a
GPU job takes. The same mappings run on a real GPU in tests/gpu/test_gpu.py."""

from __future__ import annotations

import pytest

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.local import LaunchPlan, physical_gpu_ids, plan_launch
from mjlab_hpc.rank.context import resolve_device
from mjlab_hpc.spec import TrainSpec


def count(n: int):
    """A CUDA device count that is only read when GPUs were asked for."""
    return lambda: n


def never() -> int:
    raise AssertionError("CUDA was asked about although no GPU was requested")


@pytest.mark.parametrize(
    ("ids", "visible", "expected"),
    [
        ((0, 1), None, [0, 1]),  # nothing hidden: the ids are the physical ones
        ((0, 1), "2,3", [2, 3]),  # ids count within CUDA_VISIBLE_DEVICES
        ((1,), "2,3", [3]),
        ((0, 1), " 4 , 5 ", [4, 5]),
    ],
)
def test_physical_gpu_ids(ids: tuple[int, ...], visible: str | None, expected: list[int]) -> None:
    assert physical_gpu_ids(ids, visible) == expected


@pytest.mark.parametrize(
    ("ids", "visible", "message"),
    [
        ((1,), "3", "GPU 1 is not visible: CUDA_VISIBLE_DEVICES='3' shows 1 GPU"),
        ((0,), "GPU-5d2c", "'GPU-5d2c' is not an index"),
    ],
)
def test_physical_gpu_ids_refused(ids: tuple[int, ...], visible: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        physical_gpu_ids(ids, visible)


@pytest.mark.parametrize(
    ("gpu_ids", "n", "visible", "plan"),
    [
        ((0,), 1, None, LaunchPlan(single_gpu=0)),  # in this process, on GPU 0
        ((0,), 1, "3", LaunchPlan(single_gpu=3)),  # a Slurm task's one GPU, real index 3
        ((0, 1), 2, None, LaunchPlan(ranks=2, gpus=(0, 1))),  # one local rank per GPU
        ("all", 2, "4,6", LaunchPlan(ranks=2, gpus=(4, 6))),
    ],
)
def test_plan_launch_on_gpus(
    gpu_ids: tuple[int, ...] | str, n: int, visible: str | None, plan: LaunchPlan
) -> None:
    assert plan_launch(TrainSpec(gpu_ids=gpu_ids), "single", count(n), visible) == plan


@pytest.mark.parametrize("gpu_ids", ["auto", None])
def test_plan_launch_without_gpu_ids_does_not_ask_cuda(gpu_ids: str | None) -> None:
    assert plan_launch(TrainSpec(gpu_ids=gpu_ids), "single", never, None) == LaunchPlan()


def test_plan_launch_refusals() -> None:
    with pytest.raises(SpecError, match="no CUDA device is visible"):
        plan_launch(TrainSpec(gpu_ids=(0,)), "single", count(0), None)
    with pytest.raises(SpecError, match="already one rank of a torchrun launch"):
        plan_launch(TrainSpec(gpu_ids=(0, 1)), "torchrun", count(2), None)


def test_gpu_id_beyond_the_machine_is_refused() -> None:
    with pytest.raises(SpecError, match="--gpu-ids"):
        plan_launch(TrainSpec(gpu_ids=(1,)), "single", count(1), None)


# From the launch to the physical GPU of each rank: (what the launcher gives the rank as
# CUDA_VISIBLE_DEVICES, its local rank, ranks on the node) -> the GPU it trains on.
@pytest.mark.parametrize(
    ("case", "visible", "local_rank", "local_world", "physical"),
    [
        ("mjlab-train --gpu-ids 0, variable unset (set to the chosen id)", "0", 0, 1, 0),
        ("mjlab-train --gpu-ids 1 under CUDA_VISIBLE_DEVICES=2,3", "3", 0, 1, 3),
        ("mjlab-train --gpu-ids 0 1: local rank 1 of the local executor", "0,1", 1, 2, 1),
        ("srun --gpus-per-task=1: local task 1 sees only its GPU 5", "5", 1, 4, 5),
        ("srun --gpus-per-node=4: local task 3 sees all four", "0,1,2,3", 3, 4, 3),
        ("torchrun, 2 ranks, CUDA_VISIBLE_DEVICES=0 (two ranks on one GPU)", "0", 1, 2, 0),
    ],
)
def test_each_rank_trains_on_its_gpu(
    case: str, visible: str, local_rank: int, local_world: int, physical: int
) -> None:
    shown = [v.strip() for v in visible.split(",")]
    device = resolve_device(
        "auto", local_rank, local_world, cuda_count=len(shown), cuda_visible_devices=visible
    )
    assert device.startswith("cuda:"), case
    assert int(shown[int(device.split(":")[1])]) == physical, case

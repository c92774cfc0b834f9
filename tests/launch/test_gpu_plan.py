"""Which GPU each rank trains on, decided without a GPU.

`--gpu-ids` counts within CUDA_VISIBLE_DEVICES and maps to physical ids (`physical_gpu_ids`,
`plan_launch`). The rank process gets that variable and picks its device (`resolve_device`),
for each launch path a GPU job takes. The same mappings run on a real GPU in
tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import pytest

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.local import LaunchPlan, physical_gpu_ids, plan_launch
from mjlab_hpc.rank.context import own_mig, resolve_device
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.tasks.video import egl_device_id


def count(n: int):
    """A CUDA device count that is only read when GPUs were asked for."""
    return lambda: n


def never() -> int:
    raise AssertionError("CUDA was asked about although no GPU was requested")


# Sites give CUDA_VISIBLE_DEVICES as indices, GPU UUIDs, or MIG instances' UUIDs (also in
# the older MIG-GPU-<uuid>/<gi>/<ci> form): the ids count within it, whatever it holds.
UUID_A = "GPU-5d2c8e1a-0b7f-4c62-9a4e-3f1d2b6c7a80"
UUID_B = "GPU-9e41b3c7-2d5a-4f08-8b1c-6a7e0d3f2c19"
MIG_A = "MIG-0f3a9c2e-7b41-5d86-a1e2-4c9b8d7f6e50"
MIG_B = "MIG-b2d74e19-3c58-5a0f-9e6d-1f8a2c4b7e33"


@pytest.mark.parametrize(
    ("ids", "visible", "expected"),
    [
        ((0, 1), None, ["0", "1"]),  # nothing hidden: the ids are the physical ones
        ((0, 1), "2,3", ["2", "3"]),  # ids count within CUDA_VISIBLE_DEVICES
        ((1,), "2,3", ["3"]),
        ((0, 1), " 4 , 5 ", ["4", "5"]),
        ((1,), f"{UUID_A},{UUID_B}", [UUID_B]),
        ((0, 1), f"{MIG_A},{MIG_B}", [MIG_A, MIG_B]),
        (
            (0,),
            "MIG-GPU-5d2c8e1a-0b7f-4c62-9a4e-3f1d2b6c7a80/3/0",
            ["MIG-GPU-5d2c8e1a-0b7f-4c62-9a4e-3f1d2b6c7a80/3/0"],
        ),
    ],
)
def test_physical_gpu_ids(ids: tuple[int, ...], visible: str | None, expected: list[str]) -> None:
    assert physical_gpu_ids(ids, visible) == expected


@pytest.mark.parametrize(
    ("ids", "visible", "message"),
    [
        ((1,), "3", "GPU 1 is not visible: CUDA_VISIBLE_DEVICES='3' shows 1 GPU"),
        # Slurm's value for a task without GPU devices.
        ((0,), "NoDevFiles", "'NoDevFiles' names no GPU"),
    ],
)
def test_physical_gpu_ids_refused(ids: tuple[int, ...], visible: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        physical_gpu_ids(ids, visible)


@pytest.mark.parametrize(
    ("gpu_ids", "n", "visible", "plan"),
    [
        ((0,), 1, None, LaunchPlan(single_gpu="0")),  # in this process, on GPU 0
        ((0,), 1, "3", LaunchPlan(single_gpu="3")),  # a Slurm task's one GPU, real index 3
        ((0, 1), 2, None, LaunchPlan(ranks=2, gpus=("0", "1"))),  # one local rank per GPU
        ("all", 2, "4,6", LaunchPlan(ranks=2, gpus=("4", "6"))),
        ((0,), 2, f"{UUID_B},{UUID_A}", LaunchPlan(single_gpu=UUID_B)),
        ("all", 2, f"{MIG_A},{MIG_B}", LaunchPlan(ranks=2, gpus=(MIG_A, MIG_B))),
    ],
)
def test_plan_launch_on_gpus(
    gpu_ids: tuple[int, ...] | str, n: int, visible: str | None, plan: LaunchPlan
) -> None:
    spec = TrainSpec(gpu_ids=gpu_ids)
    got = plan_launch(spec, launched_by="single", cuda_count=count(n), cuda_visible=visible)
    assert got == plan


@pytest.mark.parametrize("gpu_ids", ["auto", None])
def test_plan_launch_without_gpu_ids_does_not_ask_cuda(gpu_ids: str | None) -> None:
    spec = TrainSpec(gpu_ids=gpu_ids)
    got = plan_launch(spec, launched_by="single", cuda_count=never, cuda_visible=None)
    assert got == LaunchPlan()


def test_plan_launch_refusals() -> None:
    with pytest.raises(SpecError, match="no CUDA device is visible"):
        spec = TrainSpec(gpu_ids=(0,))
        plan_launch(spec, launched_by="single", cuda_count=count(0), cuda_visible=None)
    with pytest.raises(SpecError, match="already one rank of a torchrun launch"):
        spec = TrainSpec(gpu_ids=(0, 1))
        plan_launch(spec, launched_by="torchrun", cuda_count=count(2), cuda_visible=None)


def test_gpu_id_beyond_the_machine_is_refused() -> None:
    with pytest.raises(SpecError, match="--gpu-ids"):
        spec = TrainSpec(gpu_ids=(1,))
        plan_launch(spec, launched_by="single", cuda_count=count(1), cuda_visible=None)


# From the launch to the physical GPU of each rank: (what the launcher gives the rank as
# CUDA_VISIBLE_DEVICES, its local rank, ranks on the node) -> the GPU it trains on.
@pytest.mark.parametrize(
    ("case", "visible", "local_rank", "local_world", "physical"),
    [
        ("mjlab-train --gpu-ids 0, variable unset (set to the chosen id)", "0", 0, 1, "0"),
        ("mjlab-train --gpu-ids 1 under CUDA_VISIBLE_DEVICES=2,3", "3", 0, 1, "3"),
        ("mjlab-train --gpu-ids 0 1: local rank 1 of the local executor", "0,1", 1, 2, "1"),
        ("srun --gpus-per-task=1: local task 1 sees only its GPU 5", "5", 1, 4, "5"),
        ("srun --gpus-per-node=4: local task 3 sees all four", "0,1,2,3", 3, 4, "3"),
        ("torchrun, 2 ranks, CUDA_VISIBLE_DEVICES=0 (two ranks on one GPU)", "0", 1, 2, "0"),
        # task/cgroup + ConstrainDevices: each task's GPUs renumbered from 0 (SLURM_STEP_GPUS
        # still says 3): local task 3 sees one GPU, index 0.
        ("cgroup-constrained task 3 of 4, its GPU renumbered to 0", "0", 3, 4, "0"),
        ("a site's UUIDs, local task 1 of 2", f"{UUID_A},{UUID_B}", 1, 2, UUID_B),
        ("a task's one MIG instance", MIG_B, 1, 2, MIG_B),
    ],
)
def test_each_rank_trains_on_its_gpu(
    case: str, visible: str, local_rank: int, local_world: int, physical: str
) -> None:
    shown = [v.strip() for v in visible.split(",")]
    device = resolve_device(
        "auto", local_rank, local_world, cuda_count=len(shown), cuda_visible_devices=visible
    )
    assert device.startswith("cuda:"), case
    assert shown[int(device.split(":")[1])] == physical, case


@pytest.mark.parametrize(
    ("visible", "local_rank", "local_world", "mine"),
    [
        (f"{MIG_A},{MIG_B}", 1, 2, MIG_B),  # CUDA would show rank 1 only MIG_A as cuda:0
        (f"{MIG_A},{MIG_B}", 0, 2, MIG_A),
        (MIG_A, 0, 1, None),  # already its own
        (f"{UUID_A},{UUID_B}", 1, 2, None),  # whole GPUs: all visible, cuda:<local rank>
        ("0,1", 1, 2, None),
        (None, 0, 1, None),
    ],
)
def test_a_rank_narrows_mig_instances_to_its_own(
    visible: str | None, local_rank: int, local_world: int, mine: str | None
) -> None:
    assert own_mig(visible, local_rank, local_world) == mine


@pytest.mark.parametrize(
    ("device", "egl", "expected"),
    [
        ("cuda:0", {0: 2}, "2"),  # EGL numbers the machine's GPUs its own way
        ("cuda:1", {0: 3, 1: 0}, "0"),
        ("cuda:1", {}, "1"),  # no NVIDIA EGL to ask: the CUDA ordinal
        ("cuda", {}, "0"),
    ],
)
def test_the_egl_device_is_the_one_of_the_ranks_gpu(
    device: str, egl: dict[int, int], expected: str
) -> None:
    asked: list[int] = []

    def egl_of(ordinal: int) -> int | None:
        asked.append(ordinal)
        return egl.get(ordinal)

    assert egl_device_id(device, egl_of) == expected
    assert asked == [int(device.partition(":")[2] or 0)]

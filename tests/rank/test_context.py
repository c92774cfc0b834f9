"""The distributed context for every launch mode, its errors, ports, devices, process groups."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from helpers import rank_env

from mjlab_hpc.errors import LaunchError
from mjlab_hpc.launch.local import free_port
from mjlab_hpc.rank.context import (
    PORT_BASE,
    PORT_SPAN,
    DistContext,
    backend_for,
    derive_master_port,
    detect_mode,
    process_group,
    resolve_device,
    seed_for_rank,
    tasks_on_node,
)


def srun_env(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """Variables srun gives task `procid` of `srun -N2 --ntasks-per-node=2` (observed)."""
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
    }
    env.update(extra)
    return env


def test_single_process() -> None:
    ctx = DistContext.from_env({})
    got = (ctx.mode, ctx.rank, ctx.world_size, ctx.is_main, ctx.is_distributed)
    assert got == ("single", 0, 1, True, False)


@pytest.mark.parametrize(
    ("procid", "localid", "nodeid"), [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
)
def test_srun_task(procid: int, localid: int, nodeid: int) -> None:
    ctx = DistContext.from_env(srun_env(procid, localid, nodeid))
    assert ctx.mode == "slurm"
    assert (ctx.rank, ctx.local_rank, ctx.node_rank) == (procid, localid, nodeid)
    assert (ctx.world_size, ctx.local_world_size, ctx.num_nodes) == (4, 2, 2)
    assert ctx.master_addr == "gpu007"  # first host, zero padding kept
    assert ctx.master_port == derive_master_port("123456", 0)
    assert ctx.is_main == (procid == 0)


def test_srun_explicit_master_wins() -> None:
    env = srun_env(1, 1, 0, MASTER_PORT="23456", MASTER_ADDR="login1")
    ctx = DistContext.from_env(env)
    assert (ctx.master_addr, ctx.master_port) == ("login1", 23456)


def test_srun_restart_changes_port() -> None:
    first = DistContext.from_env(srun_env(0, 0, 0))
    again = DistContext.from_env(srun_env(0, 0, 0, SLURM_RESTART_COUNT="1"))
    assert again.restart_count == 1
    assert first.master_port != again.master_port


def test_srun_uneven_tasks_per_node() -> None:
    env = srun_env(2, 0, 1, SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="2,1")
    ctx = DistContext.from_env(env)
    assert (ctx.local_world_size, ctx.world_size) == (1, 3)


def test_batch_script_is_not_a_rank() -> None:
    # The batch shell of a 4-task job has SLURM_PROCID=0 and SLURM_NTASKS=4 but no step.
    env = srun_env(0, 0, 0)
    del env["SLURM_STEP_ID"]
    ctx = DistContext.from_env(env)
    assert (ctx.mode, ctx.world_size, ctx.job_id) == ("single", 1, "123456")


def test_torchrun() -> None:
    env = {
        "RANK": "4",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "abc",
    }
    ctx = DistContext.from_env(env)
    assert ctx.mode == "torchrun"
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (4, 1, 6, 3)
    got = (ctx.node_rank, ctx.num_nodes, ctx.master_addr, ctx.master_port)
    assert got == (1, 2, "node1", 29500)
    assert ctx.job_id == "abc"


def test_torchrunx_without_group_rank() -> None:
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }
    ctx = DistContext.from_env(env)
    assert (ctx.node_rank, ctx.num_nodes) == (1, 2)


def test_torchrun_inside_slurm_uses_torchrun_ranks() -> None:
    env = srun_env(0, 0, 0) | {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1234",
        "SLURM_RESTART_COUNT": "2",
    }
    ctx = DistContext.from_env(env)
    assert (ctx.mode, ctx.rank, ctx.restart_count, ctx.job_id) == ("torchrun", 1, 2, "123456")


def test_submitit_local() -> None:
    env = {
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_ID": "4242",
    }
    ctx = DistContext.from_env(env, master_port=31000)
    got = (ctx.mode, ctx.rank, ctx.world_size, ctx.master_addr)
    assert got == ("submitit-local", 1, 2, "127.0.0.1")
    assert ctx.master_port == 31000
    assert DistContext.from_env(env).master_port == derive_master_port("4242")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {
                "RANK": "2",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "rank 2 is outside the world of 2",
        ),
        ({"RANK": "0"}, "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
        (
            {
                "RANK": "x",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "RANK='x' is not an integer",
        ),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "local rank 2 is outside",
        ),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "70000",
            },
            "not a TCP port",
        ),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
        (srun_env(4, 0, 1), "rank 4 is outside the world of 4"),
        (srun_env(0, 0, 0, SLURM_JOB_NODELIST="gpu[1-"), "cannot find the master host"),
        (srun_env(0, 0, 3), "lists 2 nodes, but this is node 3"),
        ({"SUBMITIT_LOCAL_GLOBALID": "0"}, "SUBMITIT_LOCAL_NTASKS"),
    ],
)
def test_inconsistent_variables(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("[", r"\[")):
        DistContext.from_env(env)


def test_detect_mode_order() -> None:
    assert detect_mode({"SLURM_JOB_ID": "1"}) == "single"
    assert detect_mode({"SUBMITIT_LOCAL_NTASKS": "2"}) == "submitit-local"
    assert detect_mode({"SLURM_PROCID": "0", "SLURM_STEPID": "0"}) == "slurm"


def test_port_properties() -> None:
    ports = [derive_master_port(str(j)) for j in range(1_000_000, 1_010_000)]
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert PORT_BASE + PORT_SPAN <= 32768  # below Linux's ephemeral range
    assert len(set(ports)) == len(ports)  # 10,000 concurrent jobs: no two share a port
    assert derive_master_port("77") == derive_master_port("77")  # every rank agrees
    restarts = {derive_master_port("77", r) for r in range(20)}
    assert len(restarts) == 20
    assert PORT_BASE <= derive_master_port("12345_7") < PORT_BASE + PORT_SPAN


@pytest.mark.parametrize(
    ("spec", "node", "expected"),
    [("2(x2)", 1, 2), ("4", 0, 4), ("3,2", 1, 2), ("2(x3),1", 3, 1), (" 8(x2) ", 0, 8)],
)
def test_tasks_on_node(spec: str, node: int, expected: int) -> None:
    assert tasks_on_node(spec, node) == expected


def test_tasks_on_node_error() -> None:
    with pytest.raises(LaunchError, match="cannot parse"):
        tasks_on_node("2(y3)", 0)


# resolve_device is a pure function of what CUDA reports; the GPU cases are described here
# by their counts because this machine has no GPU (checked for real on the device machine).
@pytest.mark.parametrize(
    ("choice", "local_rank", "local_world", "count", "visible", "expected"),
    [
        ("auto", 0, 1, 0, None, "cpu"),
        ("cpu", 3, 4, 4, "0,1,2,3", "cpu"),
        ("auto", 3, 4, 4, "0,1,2,3", "cuda:3"),  # task sees all the node's GPUs
        ("cuda", 2, 4, 4, None, "cuda:2"),
        ("auto", 1, 4, 1, "1", "cuda:0"),  # --gpus-per-task=1: real index 1, seen as cuda:0
        ("auto", 3, 4, 1, "GPU-5d2c", "cuda:0"),
        ("auto", 0, 1, 1, None, "cuda:0"),
    ],
)
def test_resolve_device(
    choice: str, local_rank: int, local_world: int, count: int, visible: str | None, expected: str
) -> None:
    device = resolve_device(
        choice, local_rank, local_world, cuda_count=count, cuda_visible_devices=visible
    )
    assert device == expected


def test_resolve_device_errors() -> None:
    with pytest.raises(LaunchError, match="local rank 2 has no GPU"):
        resolve_device(
            "auto", local_rank=2, local_world_size=4, cuda_count=2, cuda_visible_devices="0,1"
        )
    with pytest.raises(LaunchError, match="no CUDA device is visible"):
        resolve_device(
            "cuda", local_rank=0, local_world_size=1, cuda_count=0, cuda_visible_devices=""
        )


def test_seed_and_backend() -> None:
    ctx = DistContext.from_env(srun_env(3, 1, 1))
    assert seed_for_rank(10, ctx) == 13
    assert backend_for("cuda:1") == "nccl"
    assert backend_for("cpu") == "gloo"


def _pg_worker(rank: int, port: int, fail: bool, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    ctx = DistContext.from_env(rank_env(rank, port))
    try:
        with process_group(ctx, "cpu", timeout_s=30):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            out.put((rank, dist.get_backend(), t.item()))
            if fail:
                raise RuntimeError("boom")
    except RuntimeError:
        pass
    out.put((rank, "initialized after exit", dist.is_initialized()))


@pytest.mark.parametrize("fail", [False, True])
def test_process_group_real_gloo(fail: bool) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pg_worker, args=(r, port, fail, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = [out.get(timeout=5) for _ in range(4)]
    sums = sorted(g for g in got if g[1] == "gloo")
    assert sums == [(0, "gloo", 3.0), (1, "gloo", 3.0)]
    # Destroyed on every exit path, an exception included.
    assert all(g[2] is False for g in got if g[1] == "initialized after exit")

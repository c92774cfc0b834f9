"""The preflight check (`--preflight`, `mjlab_hpc.rank.preflight`): its rule, its checks, and
real all-reduces between processes (gloo) that name a slow node.

The GPU part (free memory, NVML) is checked against stand-ins for torch.cuda and pynvml: this
machine has no GPU. The Slurm drill (a node whose device check fails, left out for a spare)
is in tests/launch/test_healing.py.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mjlab_hpc.rank import preflight as pf
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.watchdog import FaultInjection, parse_faults


def test_the_rule_names_only_a_node_far_out_of_line() -> None:
    """Above 5x the others' median and above the floor: slow; noise below the floor is not."""
    assert pf.slow_nodes({"a": 0.004, "b": 0.005, "c": 0.300}) == ["c"]
    assert pf.slow_nodes({"a": 0.001, "b": 0.001, "c": 0.040}) == []  # 40x, under the floor
    assert pf.slow_nodes({"a": 0.100, "b": 0.120, "c": 0.450}) == []  # under 5x
    assert pf.slow_nodes({"a": 0.01, "b": 0.9}) == ["b"]
    assert pf.slow_nodes({"a": 0.9}) == []  # nothing to compare with


def test_ring_rounds_pair_every_node_with_both_neighbours() -> None:
    for n in range(2, 9):
        rounds = pf._ring_rounds(n)
        pairs = [p for r in rounds for p in r]
        for r in rounds:
            used = [x for p in r for x in p]
            assert len(used) == len(set(used)), (n, r)  # a node in one pair per round
        assert {x for p in pairs for x in p} == set(range(n))
        if n > 2:
            assert sorted(pairs) == sorted((i, (i + 1) % n) for i in range(n))


def test_the_device_check_knows_its_result() -> None:
    got, expected = pf.known_result("cpu")
    assert got == expected and expected != 0
    ok = pf.check_device(0, "n0", "cpu")
    assert ok.problem is None and ok.memory == "not checked (CPU)"
    bad = pf.check_device(1, "n1", "cpu", broken=True)
    assert bad.problem == f"matmul sum {expected + 1:.0f}, expected {expected:.0f}"


def test_gpu_memory_and_nvml_against_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked (no GPU here): free memory under 10% fails; NVML's uncorrected ECC errors and a
    pending row remapping fail; without pynvml it says "not checked"."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 * 2**30, 80 * 2**30))
    text, problem = pf._gpu_memory("cuda:0")
    assert text == "2.0 of 80.0 GiB free" and "another process holds it" in (problem or "")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * 2**30, 80 * 2**30))
    assert pf._gpu_memory("cuda:0") == ("70.0 of 80.0 GiB free", None)

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    assert pf._nvml("cuda:0") == ("not checked (pynvml is not importable)", None)

    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByPciBusId=lambda bus: f"h{bus}",
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 3,
        nvmlDeviceGetRemappedRows=lambda h: (0, 1, 1, 0),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(pci_bus_id=7)
    )
    text, problem = pf._nvml("cuda:0")
    assert "3 uncorrected ECC error(s)" in text and "XID not checked" in text
    assert problem == (
        "3 uncorrected ECC error(s) since the driver loaded; a row remapping is pending or "
        "failed (reset the GPU)"
    )
    fake.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: 0
    fake.nvmlDeviceGetRemappedRows = lambda h: (0, 0, 0, 0)
    assert pf._nvml("cuda:0")[1] is None


def test_drills_parse_and_apply_once(tmp_path: Path) -> None:
    from mjlab_hpc.rundir.layout import RunDir

    run = RunDir(tmp_path)
    run.heartbeats.mkdir(parents=True)
    faults = parse_faults({"MJLAB_HPC_FAULT": "preflight-device@0:rank1:once,preflight-slow@4"})
    assert faults[0] == FaultInjection("preflight-device", 0, rank=1, once=True)
    assert pf.preflight_drills(faults, run, rank=1, iteration=0) == ("preflight-device",)
    assert pf.preflight_drills(faults, run, rank=1, iteration=0) == ()  # once
    assert pf.preflight_drills(faults, run, rank=0, iteration=3) == ()
    assert pf.preflight_drills(faults, run, rank=0, iteration=4) == ("preflight-slow",)
    assert pf.preflight_drills(faults, run, rank=0, iteration=9) == ("preflight-slow",)
    with pytest.raises(ValueError, match="preflight-slow"):
        parse_faults({"MJLAB_HPC_FAULT": "preflight-lost@0"})


def _rank(rank: int, world: int, store: str, drills: dict[int, tuple[str, ...]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ctx = DistContext("torchrun", rank, 0, world, 1, rank, world, "localhost", 0)
    t0 = time.perf_counter()
    try:
        report = pf.preflight(ctx, "cpu", f"node{rank}", drills.get(rank, ()))
        line = f"passed {report.seconds:.3f} {time.perf_counter() - t0:.3f} {report.summary()}"
    except pf.PreflightFailed as exc:
        failed = ";".join(f"{f.node}:{f.check}" for f in exc.report.failed)
        line = f"failed {failed} here={len(exc.here)} {exc}"
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(line)


def _run(tmp_path: Path, world: int, drills: dict[int, tuple[str, ...]]) -> list[str]:
    store = tmp_path / f"store-{time.monotonic_ns()}"
    # Spawned, not forked: a fork after torch's threads started (this test's own matmul) hangs.
    mp.start_processes(
        _rank, args=(world, str(store), drills, str(tmp_path)), nprocs=world, start_method="spawn"
    )  # raises if a process failed
    return [(tmp_path / f"rank{r}").read_text() for r in range(world)]


@pytest.mark.slow
def test_real_all_reduces_pass_and_name_a_slow_or_broken_node(tmp_path: Path) -> None:
    """Three processes, each its own node, over gloo: all pass (the time the check took is
    printed); with node1's all-reduces slowed by the drill every rank names node1 and the
    all-reduce check with its figures; with node2's device broken, node2 and the device
    check."""
    passed = _run(tmp_path, 3, {})
    assert all(line.startswith("passed ") for line in passed), passed
    print("preflight, 3 ranks on 3 nodes (gloo, this machine):", passed[0])
    slow = _run(tmp_path, 3, {1: ("preflight-slow",)})
    assert all(line.startswith("failed node1:all-reduce ") for line in slow), slow
    assert "here=1" in slow[1] and "here=0" in slow[0], slow
    assert "the other nodes' median" in slow[0] and "ms for 4 MiB" in slow[0], slow
    broken = _run(tmp_path, 3, {2: ("preflight-device",)})
    assert all(line.startswith("failed node2:device ") for line in broken), broken
    assert "matmul sum" in broken[0], broken

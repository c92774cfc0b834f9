"""The preflight check (`--preflight`, `mjlab_hpc.rank.preflight`): its rule, its checks, and
real all-reduces between processes (gloo) that name a slow node.

The GPU part (free memory, NVML) is checked against stand-ins for torch.cuda and pynvml: this
machine has no GPU. The Slurm drill (a node whose device check fails, left out for a spare)
is in tests/launch/test_healing.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import BIN, cli_env, only_run, reference_digests
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_OK
from mjlab_hpc.launch.heal import decide, find_fault, record_healing
from mjlab_hpc.rank import preflight as pf
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.watchdog import FAULT_ENV, FaultInjection, parse_faults
from mjlab_hpc.rundir.ends import RankExit, RankStart, record_end, record_start, start_hosts
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

CARTPOLE = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1"]
# tests/launch/test_healing.py's run and its uninterrupted reference (shared digests).
COMMON = [*CARTPOLE, "--save-interval", "5", "--max-iterations", "12"]
REFERENCE = [*CARTPOLE, "--save-interval", "100", "--max-iterations", "12"]


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
    run = RunDir(tmp_path)
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


@pytest.mark.training
def test_real_all_reduces_pass_and_name_a_slow_and_a_broken_node(tmp_path: Path) -> None:
    """Three processes, each its own node, over gloo: all pass (the time the check took is
    printed). With node1's all-reduces slowed and node2's device broken by the drills, every
    rank names node2's device check and node1's all-reduce check, with their figures."""
    passed = _run(tmp_path, 3, {})
    assert all(line.startswith("passed ") for line in passed), passed
    print("preflight, 3 ranks on 3 nodes (gloo, this machine):", passed[0])
    failed = _run(tmp_path, 3, {1: ("preflight-slow",), 2: ("preflight-device",)})
    assert all(line.startswith("failed node2:device;node1:all-reduce ") for line in failed), failed
    assert "here=1" in failed[1] and "here=1" in failed[2] and "here=0" in failed[0], failed
    assert "failed the device check: rank 2 on cpu: matmul sum" in failed[0], failed
    assert "node1 failed the all-reduce check: " in failed[1], failed  # its own failure
    assert "ms for 4 MiB, the other nodes' median" in failed[1], failed


def _hpc(cluster: SlurmCluster, *args: str) -> str:
    cmd = [BIN / "mjlab-hpc", *args]
    env = cli_env(base=cluster.environ())
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).stdout


@pytest.mark.slurm
def test_slurm_node_failing_the_preflight_is_left_out_for_a_spare(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 and --preflight whose rank 1's device computes a wrong
    result in the first start's check: that start ends before training, the next srun step in
    the same allocation leaves rank 1's node out for the spare, and the run ends with the
    parameters of a run that never failed. run.json, status and logs name the node, the check
    and its figures; the time the check added to the healed start is printed."""
    cluster = slurm_cluster3
    cmd = [BIN / "mjlab-submit", *COMMON, "--nodes", "2", "--tasks-per-node", "1"]
    cmd += ["--spare-nodes", "1", "--preflight", "--gpus-per-node", "0", "--time", "10"]
    cmd += ["--log-root", str(tmp_path), "--follow"]
    env = cli_env({FAULT_ENV: "preflight-device@0:rank1:once"}, base=cluster.environ())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    (fault,) = read_record(run.path).faults
    bad, spare = start_hosts(run.path, rank=1)
    kept = start_hosts(run.path, rank=0)
    assert (fault.reason, fault.kind, fault.iteration) == ("preflight", "in-allocation", 0)
    assert fault.hosts == (bad,) and fault.excluded_nodes == (bad,), fault
    figures = f"rank 1 on {bad} failed the preflight check: device check: rank 1 on cpu: matmul"
    assert fault.error.startswith(figures) and ", expected " in fault.error, fault
    assert spare not in (bad, kept[0]) and kept == [kept[0], kept[0]], (bad, spare, kept)
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12 and summary["world_size"] == 2
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    row = json.loads(_hpc(cluster, "status", "--json", str(run.path)))[0]
    assert row["restart_reasons"] == ["preflight"], row
    assert row["interruptions"][0]["error"].startswith(figures), row
    logs = _hpc(cluster, "logs", str(run.path))
    assert f"preflight of rank 1 on {bad} at iteration 0 ({figures}" in logs, logs[-3000:]
    assert f"excluded {bad}" in logs, logs[-3000:]
    took = re.findall(r"preflight passed: .*; took ([0-9.]+) s", run.rank_log(0).read_text())
    assert len(took) == 1, took  # the healed start's (the first failed)
    print(f"preflight on 2 nodes (Slurm test cluster): added {took[0]} s to the start")
    assert cluster.wait_job(summary["job_id"], timeout=60) == "COMPLETED"


def _preflight_start(run: RunDir, bad: str) -> None:
    """A start of two ranks whose rank 1 on `bad` failed the device check (rank 0's end is
    the consequence), as rank/train.py records it."""
    now = time.time()
    for rank, node in ((0, "n1"), (1, bad)):
        start = record_start(run, RankStart(run.path.name, rank, 2, node, 1, "cpu", now))
        here = rank == 1
        how = "preflight" if here else "failed"
        detail = "device check: rank 1 on cpu: matmul sum 2, expected 1"
        end = RankExit(how=how, detail=detail, at=now, peer_lost=not here)
        record_end(run, start, end)


def test_the_healer_leaves_a_node_that_failed_the_preflight_out(tmp_path: Path) -> None:
    """Its node is suspect (a lost node); the same node failing again is a repeat, not retried;
    another node failing is retried."""
    run = RunDir(tmp_path)
    _preflight_start(run, "n2")
    fault = find_fault(run.path)
    assert fault is not None and (fault.reason, fault.suspect_nodes) == ("preflight", ("n2",))
    assert fault.error == (
        "rank 1 on n2 failed the preflight check: device check: rank 1 on cpu: matmul sum 2, "
        "expected 1"
    )
    heal = decide(run.path, max_restarts=3)
    assert heal.requeue and heal.exclude == ["n2"], heal
    record_healing(run.path, heal)
    _preflight_start(run, "n3")  # the spare's device fails too: retried
    heal = decide(run.path, max_restarts=3)
    assert heal.requeue and heal.exclude == ["n3"], heal
    record_healing(run.path, heal)
    _preflight_start(run, "n3")  # the same node again: a repeat
    assert not decide(run.path, max_restarts=3).requeue


@pytest.mark.training
def test_local_two_ranks_pass_the_preflight(tmp_path: Path) -> None:
    """`mjlab-train --num-procs 2 --preflight` (gloo, one node): both ranks pass before their
    first iteration and train; the time the check added is printed. (A failed check healed
    is the Slurm drill's above.)"""
    cmd = [BIN / "mjlab-train", "cartpole", "--num-envs", "16", "--max-iterations", "2"]
    cmd += ["--torch-threads", "1", "--num-procs", "2", "--preflight", "--log-root", str(tmp_path)]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    run = only_run(tmp_path)
    for rank in (0, 1):
        text = run.rank_log(rank).read_text()
        passed = r"preflight passed: 2 device\(s\) .*over all ranks .*; took ([0-9.]+) s"
        took = re.findall(passed, text)
        assert len(took) == 1 and text.index("preflight passed") < text.index("iteration 1/2")
    print(f"preflight, 2 ranks on one node (gloo): added {took[0]} s to the start")


def test_a_preflight_drill_without_preflight_is_refused(tmp_path: Path) -> None:
    """Exit 2 before anything is made, naming the variable and the fix."""
    cmd = [BIN / "mjlab-train", "cartpole", "--max-iterations", "1", "--log-root", str(tmp_path)]
    env = cli_env({FAULT_ENV: "preflight-device@0:rank1"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{FAULT_ENV}: preflight-device drills the preflight check: add --preflight" in (
        proc.stderr
    )
    assert list(tmp_path.iterdir()) == []

"""The preflight check (`--preflight`, `mjlab_hpc.rank.preflight`): its rule, its checks, and
real processes (gloo) that name a node with slow links or a node throttled to a fifth of a
CPU, and the rank at fault on every launch path.

The GPU part (free memory, NVML) is checked against stand-ins for torch.cuda and pynvml: this
machine has no GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import BIN, cli_env, cpu_cgroup, only_run, reference_digests, wait_for
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


def test_a_node_computes_as_slowly_as_its_slowest_rank() -> None:
    """Above 3x the other nodes' median and the floor: the node fails, naming the slow ranks;
    2x (a core shared with another process on a busy machine) passes; of two nodes only one
    can fail, and one node never does."""
    nodes = ["a", "a", "b", "c"]
    devices = [pf.DeviceCheck(r, n, "cpu", 1.0, 1.0, 0.0, "", "") for r, n in enumerate(nodes)]
    per_node, failed = pf._slow_compute(devices, [0.02, 0.09, 0.02, 0.025])
    assert per_node == {"a": 0.09, "b": 0.02, "c": 0.025}
    (slow,) = failed
    assert (slow.node, slow.check, slow.ranks, slow.who()) == ("a", "compute", (1,), "rank 1 on a")
    assert slow.figures == (
        "90 ms for 1000 steps, the other nodes' median 22 ms (limit: 3x, and over 20 ms)"
    )
    assert pf._slow_compute(devices, [0.09, 0.09, 0.02, 0.02])[1][0].who() == "ranks 0, 1 on a"
    assert pf._slow_compute(devices, [0.02, 0.04, 0.02, 0.02])[1] == []  # 2x: a busy machine
    assert pf._slow_compute(devices, [0.001, 0.006, 0.001, 0.001])[1] == []  # under the floor
    two = devices[1:3]
    assert [f.node for f in pf._slow_compute(two, [0.02, 0.07])[1]] == ["b"]
    assert [f.node for f in pf._slow_compute(two, [0.07, 0.02])[1]] == ["a"]
    assert pf._slow_compute(devices[:2], [0.02, 0.2])[1] == []  # one node


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
    threads = torch.get_num_threads()
    windows = pf.compute_windows("cpu", 2)
    assert len(windows) == 2 and all(0 < w < float("inf") for w in windows), windows
    assert torch.get_num_threads() == threads  # (one thread while it timed)
    # A device that raises fails the check, said in one line (the others get the answer).
    raised = pf.check_device(2, "n2", "nodevice")
    assert raised.problem is not None and raised.problem.startswith("RuntimeError: "), raised
    figures, problem = pf._timed_compute("nodevice")
    assert figures == [] and (problem or "").startswith("the compute check raised RuntimeError")


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


def _rank(
    rank: int,
    world: int,
    store: str,
    drills: dict[int, tuple[str, ...]],
    out: str,
    phases: int = 1,
) -> None:
    """One rank, its own node: `phases` preflight checks, each after the test's `go<phase>`
    file when there are several (the test sets the scene in between); each one's outcome in
    `rank<rank>-<phase>` (JSON)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ctx = DistContext("torchrun", rank, 0, world, 1, rank, world, "localhost", 0)
    Path(out, f"ready{rank}").write_text(str(os.getpid()))
    try:
        for phase in range(phases):
            while phases > 1 and not Path(out, f"go{phase}").exists():
                time.sleep(0.01)
            t0 = time.perf_counter()
            try:
                report = pf.preflight(ctx, "cpu", f"node{rank}", drills.get(rank, ()))
                got = {"passed": True, "summary": report.summary()}
            except pf.PreflightFailed as exc:
                report = exc.report
                failed = [[f.node, f.check, list(f.ranks)] for f in report.failed]
                got = {"passed": False, "failed": failed, "here": len(exc.here), "error": str(exc)}
            got |= {"seconds": time.perf_counter() - t0, "compute": dict(report.compute_s)}
            Path(out, f"rank{rank}-{phase}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def _start(tmp_path: Path, world: int, drills: dict[int, tuple[str, ...]], phases: int = 1) -> Any:
    store = tmp_path / f"store-{time.monotonic_ns()}"
    # Spawned, not forked: a fork after torch's threads started (this test's own matmul) hangs.
    return mp.start_processes(
        _rank,
        args=(world, str(store), drills, str(tmp_path), phases),
        nprocs=world,
        start_method="spawn",
        join=False,
    )


def _outcomes(tmp_path: Path, world: int, phase: int = 0) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"rank{r}-{phase}").read_text()) for r in range(world)]


def _run(tmp_path: Path, world: int, drills: dict[int, tuple[str, ...]]) -> list[dict[str, Any]]:
    processes = _start(tmp_path, world, drills)
    while not processes.join():  # raises if a process failed
        pass
    return _outcomes(tmp_path, world)


@pytest.mark.training
def test_real_all_reduces_pass_and_name_a_slow_and_a_broken_node(tmp_path: Path) -> None:
    """Three processes, each its own node, over gloo: all pass (the time the check took is
    printed). With node1's all-reduces slowed and node2's device broken by the drills, every
    rank names node2's device check and node1's all-reduce check, with their figures."""
    passed = _run(tmp_path, 3, {})
    assert all(got["passed"] for got in passed), passed
    print("preflight, 3 ranks on 3 nodes (gloo, this machine):", passed[0])
    failed = _run(tmp_path, 3, {1: ("preflight-slow",), 2: ("preflight-device",)})
    for got in failed:
        assert got["failed"] == [["node2", "device", [2]], ["node1", "all-reduce", [1]]], got
    assert [got["here"] for got in failed] == [0, 1, 1], failed
    assert failed[0]["error"].startswith(
        "preflight: rank 2 on node2 failed the device check: matmul sum"
    ), failed
    assert failed[1]["error"].startswith("preflight: rank 1 on node1 failed the all-reduce check")
    assert "ms for 4 MiB, the other nodes' median" in failed[1]["error"], failed


@pytest.mark.training
def test_a_node_throttled_to_a_fifth_of_a_cpu_fails_the_compute_check(tmp_path: Path) -> None:
    """Two processes, each its own node (gloo). On a busy machine (two more processes spin
    beside them) both pass. Then they get their CPUs before the machine's other work (a cpu
    cgroup of high shares) and node1's is throttled to 20% of a CPU (a CFS quota, as a
    container's or a job's CPU limit): every rank names rank 1 on node1 and the compute
    check, with the figures. The figures and the time the check took are printed."""
    hogs: list[subprocess.Popen[bytes]] = []
    with (
        cpu_cgroup("mjlab-preflight", shares=262144) as first,
        cpu_cgroup("mjlab-throttled", quota=0.2, parent=first) as throttled,
    ):
        processes = _start(tmp_path, 2, {}, phases=2)
        try:
            ready = [tmp_path / f"ready{r}" for r in (0, 1)]
            wait_for(lambda: all(p.exists() for p in ready), 300, "the ranks to start")
            pids = [p.read_text() for p in ready]
            spin = [sys.executable, "-c", "while True: pass"]
            hogs = [subprocess.Popen(spin) for _ in range(2)]
            (tmp_path / "go0").touch()
            wait_for(lambda: (tmp_path / "rank1-0").exists(), 120, "the busy machine's check")
            busy = _outcomes(tmp_path, 2, 0)
            for hog in hogs:
                hog.kill()
            for pid in pids:
                (first / "cgroup.procs").write_text(pid)
            (throttled / "cgroup.procs").write_text(pids[1])
            (tmp_path / "go1").touch()
            while not processes.join():
                pass
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
            for process in processes.processes:
                process.kill()
    assert all(got["passed"] for got in busy), busy
    slow = _outcomes(tmp_path, 2, 1)
    for got in slow:
        assert got["failed"] == [["node1", "compute", [1]]], got
    assert [got["here"] for got in slow] == [0, 1], slow
    assert re.fullmatch(
        r"preflight: rank 1 on node1 failed the compute check: \d+ ms for 1000 steps, the "
        r"other nodes' median \d+ ms \(limit: 3x, and over 20 ms\)",
        slow[0]["error"],
    ), slow
    healthy, throttled_s = slow[0]["compute"]["node0"], slow[0]["compute"]["node1"]
    assert throttled_s > 3 * healthy, slow
    print(
        f"compute per 1000 steps: busy machine {busy[0]['compute']}, took "
        f"{busy[0]['seconds']:.2f} s; node1 at 20% of a CPU {throttled_s * 1000:.0f} ms vs "
        f"{healthy * 1000:.0f} ms, took {slow[0]['seconds']:.2f} s"
    )


def _hpc(cluster: SlurmCluster, *args: str) -> str:
    cmd = [BIN / "mjlab-hpc", *args]
    env = cli_env(base=cluster.environ())
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).stdout


@pytest.mark.slurm
def test_slurm_slow_and_failing_node_is_left_out_for_a_spare(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 and --preflight whose rank 1's node (node2) is
    throttled to 20% of a CPU (its slurmd's cpu cgroup: a CFS quota, which the job's
    processes inherit) and whose device computes a wrong result in the first start's check
    (a drill). The nodes get their CPUs before the machine's other work (high cpu shares), as
    a node of its own would. That start ends before training, naming both checks of rank 1
    with their figures; the next srun step in the same allocation leaves node2 out for the
    spare, and the run ends with the parameters of a run that never failed. run.json, status
    and logs name the node, the checks and the figures; the compute figures and the time the
    check added to the healed start are printed."""
    cluster = slurm_cluster3
    cmd = [BIN / "mjlab-submit", *COMMON, "--nodes", "2", "--tasks-per-node", "1"]
    cmd += ["--spare-nodes", "1", "--preflight", "--gpus-per-node", "0", "--time", "10"]
    cmd += ["--log-root", str(tmp_path), "--follow"]
    env = cli_env({FAULT_ENV: "preflight-device@0:rank1:once"}, base=cluster.environ())

    def slurmd(node: str) -> str:
        return (cluster.state_dir / "run" / f"slurmd-{node}.pid").read_text().strip()

    with (
        cpu_cgroup("mjlab-nodes", shares=262144) as nodes,
        cpu_cgroup("mjlab-node2", quota=0.2, parent=nodes) as node2,
    ):
        for node in ("node1", "node3"):
            (nodes / "cgroup.procs").write_text(slurmd(node))
        (node2 / "cgroup.procs").write_text(slurmd("node2"))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    (fault,) = read_record(run.path).faults
    bad, spare = start_hosts(run.path, rank=1)
    kept = start_hosts(run.path, rank=0)
    assert bad == "node2", (bad, spare, kept)
    assert (fault.reason, fault.kind, fault.iteration) == ("preflight", "in-allocation", 0)
    assert fault.hosts == (bad,) and fault.excluded_nodes == (bad,), fault
    assert fault.ranks == (1,), fault
    figures = f"rank 1 on {bad} failed the preflight check: device check: matmul sum "
    assert fault.error.startswith(figures) and ", expected " in fault.error, fault
    slow = re.search(
        r"; compute check: (\d+) ms for 1000 steps, the other nodes' median "
        r"(\d+) ms \(limit: 3x",
        fault.error,
    )
    assert slow, fault.error
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
    took = re.findall(
        r"preflight passed: .*1000 steps per node: (.*?); .*; took ([0-9.]+) s",
        run.rank_log(0).read_text(),
    )
    assert len(took) == 1, took  # the healed start's (the first failed)
    print(
        f"preflight on 2 nodes (Slurm test cluster): node2 at 20% of a CPU {slow[1]} ms vs "
        f"{slow[2]} ms per 1000 steps; healed start {took[0][0]}, added {took[0][1]} s"
    )
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
def test_local_two_ranks_name_the_rank_at_fault_then_pass(tmp_path: Path) -> None:
    """`mjlab-train --num-procs 2 --preflight` (gloo, one node) whose rank 1's device check
    fails in the first start: the fault, run.json and status name rank 1 (rank 0's end is a
    consequence, not a second failure); the healed start passes before its first iteration
    and trains; the time the check added is printed."""
    cmd = [BIN / "mjlab-train", "cartpole", "--num-envs", "16", "--max-iterations", "2"]
    cmd += ["--torch-threads", "1", "--num-procs", "2", "--preflight", "--log-root", str(tmp_path)]
    env = cli_env({FAULT_ENV: "preflight-device@0:rank1:once"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    run = only_run(tmp_path)
    (fault,) = read_record(run.path).faults
    host = start_hosts(run.path, rank=1)[0]
    assert (fault.reason, fault.ranks, fault.hosts) == ("preflight", (1,), (host,)), fault
    assert fault.error.startswith(
        f"rank 1 on {host} failed the preflight check: device check: matmul sum "
    ), fault
    first = [json.loads(run.rank_end(r, 1).read_text()) for r in (0, 1)]
    assert [(e["how"], e["peer_lost"]) for e in first] == [("failed", True), ("preflight", False)]
    for rank in (0, 1):
        text = run.rank_log(rank).read_text()
        passed = r"preflight passed: 2 device\(s\) .*over all ranks .*; took ([0-9.]+) s"
        took = re.findall(passed, text)
        assert len(took) == 1 and text.index("preflight passed") < text.index("iteration 1/2")
    print(f"preflight, 2 ranks on one node (gloo): added {took[0]} s to the start")


@pytest.mark.training
def test_one_rank_failing_the_preflight_is_one_line_and_a_failed_run(tmp_path: Path) -> None:
    """`mjlab-train --preflight` in one process whose device check fails: no traceback, one
    closing line naming rank 0 and the check, exit 1, and run.json and status say FAILED with
    that cause (not UNKNOWN)."""
    cmd = [BIN / "mjlab-train", "cartpole", "--num-envs", "16", "--max-iterations", "2"]
    cmd += ["--torch-threads", "1", "--preflight", "--log-root", str(tmp_path)]
    env = cli_env({FAULT_ENV: "preflight-device@0"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run = only_run(tmp_path)
    host = start_hosts(run.path, rank=0)[0]
    cause = f"rank 0 on {host} failed the preflight check: device check: matmul sum "
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"failed before the first iteration: {cause}"), proc.stderr[-3000:]
    record = read_record(run.path)
    assert record.state == "failed" and record.failure is not None, record
    assert (record.failure.kind, record.failure.rank, record.failure.host) == (
        "preflight",
        0,
        host,
    )
    row = json.loads(_hpc_local("status", "--json", str(run.path)))[0]
    assert row["state"] == "FAILED" and row["cause"].startswith(cause), row


def _hpc_local(*args: str) -> str:
    proc = subprocess.run(
        [BIN / "mjlab-hpc", *args], env=cli_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


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

"""The benchmark (`make bench`), with no timing asserted.

A real `--quick` run writes every figure and a readable PNG, and the GPU figures where there
is a GPU (else the reason they were skipped). The statistics, the compile counter and the GPU
section's orchestration (with stand-in commands) are tested on their own. The figures of a
quick run on a shared machine mean nothing: the test only checks that they are all there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu, recovery
from benchmarks.compile import CompileWatch
from benchmarks.config import BenchConfig
from benchmarks.healing import HANG_TIMEOUT_S, healing_figures
from benchmarks.report import main as bench_main
from benchmarks.session import Bench
from benchmarks.stats import Figure, parse_rsl_rl_log, spread, throughput
from benchmarks.target import CONFIGS
from benchmarks.watch import bench_env
from mjlab_hpc.rundir.record import Interruption

FIGURES = {
    "envstate_bytes",
    "envstate_write_s",
    "envstate_capture_s",
    "envstate_restore_s",
    "scaling_efficiency",
    "machine_limit",
    "scaling_of_limit",
    "collective_share",
    "rollout_overhead_cartpole",
    "rollout_overhead_ant",
    "launch_cost",
    "launch_cost_2ranks",
    "mjlab_vs_train",
    "mjlab_graph_vs_train",
    "compile_duplication",
    "recovery_stop_iterations",
    "recovery_resume_ratio",
    "recovery_iterations_lost",
    "lock_takeover_s",
    "lock_handover_ms",
    "time_to_target_cartpole",
    "time_to_target_cartpole_2e",
    "time_to_target_cartpole_steps_2e",
}
COUNTS = {"recovery_iterations_lost"}
ENVSTATE = {"envstate_bytes", "envstate_write_s", "envstate_capture_s", "envstate_restore_s"}
UNTARGETED = {
    "scaling_efficiency",
    "machine_limit",
    "scaling_of_limit",
    "collective_share",
    *ENVSTATE,
    "time_to_target_cartpole",
    "time_to_target_cartpole_2e",
    "time_to_target_cartpole_steps_2e",
}  # may be 0, or reported without a target; every other figure is a positive ratio
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.training
@pytest.mark.mjlab
@pytest.mark.timeout(900)  # 300 s without a GPU; with one, the GPU section follows
def test_quick_bench_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench"
    # Self-healing has its own tests (tests/launch/test_healing.py) and figures test below.
    assert bench_main(["--quick", "--no-healing", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scaling efficiency" in printed  # the table comes last

    doc = json.loads((out / "bench.json").read_text())
    assert doc["failures"] == []
    assert doc["quick"] is True
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    if doc["gpu"]["measured"]:
        assert doc["machine"]["gpu"] and doc["gpu"]["skipped"] is None
        assert set(doc["figures"]) == FIGURES | set(gpu.GPU_FIGURES)
    else:  # said in bench.json and printed after the table
        assert doc["gpu"]["skipped"].startswith("no GPU: "), doc["gpu"]
        assert doc["machine"]["gpu"] is None
        assert f"GPU figures: skipped: {doc['gpu']['skipped']}" in printed.split("target")[-1]
        assert set(doc["figures"]) == FIGURES
    for key, fig in doc["figures"].items():
        assert fig["n"] >= 1, key
        for stat in ("median", "q1", "q3", "min", "max"):
            value = fig[stat]
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, stat, value)
            assert value >= 0 if key in COUNTS else value > 0, (key, stat, value)
        assert fig["min"] <= fig["median"] <= fig["max"]
        # The CPU scaling figures are reported without a target (CPU ranks are for testing).
        assert fig["met"] is None if key in UNTARGETED else isinstance(fig["met"], bool), key
    compiles = doc["details"]["compilations"]
    assert compiles["one-1"]["compilations"] >= 1  # the partly cold cache did compile
    assert doc["details"]["pairs"][0]["recovery"]["completed"] is True
    # The machine's limit: two 1-rank trainings ran at once, each measured against one alone.
    assert len(doc["details"]["pairs"][0]["limit_each_vs_alone"]) == 2
    figs = doc["figures"]
    of_limit = figs["scaling_efficiency"]["samples"][0] / figs["machine_limit"]["samples"][0]
    assert figs["scaling_of_limit"]["samples"][0] == pytest.approx(of_limit, rel=1e-3)
    # A rank's whole environment state, measured at two sizes and restored completely.
    envstate = doc["details"]["envstate"]
    assert [m["num_envs"] for m in envstate["measured"]] == [4, 16]
    assert all(m["problems"] == [] for m in envstate["measured"])
    assert envstate["bytes"]["per_env"] > 0
    # mjlab's train and ours ran the same configuration and seeds: the same rewards.
    assert doc["details"]["mjlab"]["pairs"][0]["same_rewards"] is True

    # Time to target: every configuration trained until its reward reached the target, and
    # stopped there (a run that went on would have written its last iterations too).
    target = doc["details"]["time_to_target"]["cartpole"]
    assert [r["config"] for r in target["runs"]] == [c[0] for c in CONFIGS]
    for run in target["runs"]:
        hit = run["reached"]
        assert hit is not None and hit["reward"] >= target["target"], run
        assert hit["wall_s"] > 0 and hit["env_steps"] == run["curve"][hit["iteration"] - 1][1]
        assert len(run["curve"]) < target["max_iterations"], run
    assert "time to target (median" in printed  # its table

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    for name in ("bench.png", "time_to_target.png"):
        png = out / name
        assert png.read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_spread_and_targets() -> None:
    s = spread([3.0, 1.0, 2.0, float("nan"), 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["n"] == 4
    assert s["q1"] <= s["median"] <= s["q3"]
    assert spread([])["median"] is None
    hi = Figure("x", "x", (0.9, 0.97, 0.99), 0.95, ">=", "d", "s").summary()
    lo = Figure("y", "y", (0.03,), 0.02, "<=", "d", "s").summary()
    assert hi["met"] is True and lo["met"] is False
    assert Figure("z", "z", (), 1.0, "<=", "d", "s").summary()["met"] is None


# Two iterations as rsl-rl's OnPolicyRunner prints them in mjlab's `train` (shortened).
RSL_RL_CONSOLE = """\
Storing git diff for 'main' in: logs/rsl_rl/cartpole/2026-11-22_07-00-31/git/main.diff
################################################################################
\x1b[1m                             Learning iteration 0/2                             \x1b[0m

                            Total steps: 512
                       Steps per second: 642
                        Collection time: 0.751s
                          Learning time: 0.047s
                        Mean value loss: 0.0277
                        Mean action std: 1.01
--------------------------------------------------------------------------------
                         Iteration time: 0.80s
################################################################################
\x1b[1m                             Learning iteration 1/2                             \x1b[0m

                            Total steps: 1024
                       Steps per second: 621
                        Collection time: 0.777s
                          Learning time: 0.046s
                            Mean reward: -1.57
                    Mean episode length: 99.19
--------------------------------------------------------------------------------
################################################################################
\x1b[1m                             Learning iteration 2/2                             \x1b[0m

                            Total steps: 1536
"""


def test_parse_rsl_rl_console() -> None:
    records = parse_rsl_rl_log(RSL_RL_CONSOLE)
    assert [r["iteration"] for r in records] == [1, 2]  # the cut-off third is dropped
    assert [r["env_steps"] for r in records] == [512, 512]
    assert records[0]["collect_s"] == 0.751 and records[1]["learn_s"] == 0.046
    assert "reward" not in records[0] and records[1]["reward"] == -1.57
    assert throughput(records) == pytest.approx(1024 / (0.751 + 0.047 + 0.777 + 0.046))


def test_compile_watch_counts_builds_per_process(tmp_path: Path) -> None:
    """Warp builds each module in `<module>_p<pid>_t<thread>`: every such folder is one
    compilation by that process, even when two processes build the same module."""
    cache = tmp_path / "cache"
    with CompileWatch(cache) as watch:
        for name in ("wp_a_1234567_p10_t1", "wp_b_7654321_p10_t1", "wp_a_1234567_p11_t9"):
            (cache / name).mkdir()
        (cache / "wp_a_1234567").mkdir()  # a finished module: not a compilation
        (cache / "notes").mkdir()
        deadline = time.monotonic() + 5
        while len(watch.compiles) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    summary = watch.summary()
    assert summary["compilations"] == 3
    assert summary["distinct_modules"] == 2
    assert summary["processes_compiling"] == 2
    assert summary["per_process"] == [2, 1]


def test_bench_env_drops_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "2")
    env = bench_env({"WARP_CACHE_PATH": "/x"})
    assert "RANK" not in env and "SLURM_PROCID" not in env and "SUBMITIT_LOCAL_NTASKS" not in env
    assert env["WARP_CACHE_PATH"] == "/x"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU figures stay CPU figures on a GPU machine
    with_gpus = bench_env(gpus=True)  # the GPU section: the GPUs this process sees
    assert with_gpus.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_cuda_probe_answers_or_says_why_not() -> None:
    found = gpu.cuda_probe(bench_env(gpus=True))
    assert isinstance(found["available"], bool)
    if found["available"]:
        assert found["name"] and found["count"] >= 1
    else:
        assert found["reason"] and "torch" in found["reason"], found


def test_gpu_section_without_a_gpu_is_skipped_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    why = "torch 2.13.0+cpu is a CPU build, nvidia-smi is not installed"
    monkeypatch.setattr(gpu, "cuda_probe", lambda env: {"available": False, "reason": why})
    bench = Bench(BenchConfig(out=tmp_path), said.append)
    record = gpu.run_gpu(bench)
    assert record["skipped"] == f"no GPU: {why}"
    assert bench.details["gpu"] is record
    assert said == [f"GPU figures: skipped: no GPU: {why}"]
    assert gpu.gpu_figures(bench.cfg, record) == []


# Stand-ins for mjlab's `train` (rsl-rl's console blocks) and our `mjlab-train`
# (progress.jsonl): 1000 env-steps per iteration in 0.3 s and in 0.24 s of collection + update.
MJLAB_TRAIN = """
import os, pathlib, sys, time
if sys.argv[sys.argv.index("--gpu-ids") + 1] != "[0]":  # mjlab 1.6 parses lists as Python
    sys.exit("Value 0 (type int) does not match expected type list[int]")
pathlib.Path("cache.txt").write_text(os.environ.get("WARP_CACHE_PATH", ""))
n = int(sys.argv[sys.argv.index("--agent.max-iterations") + 1])
for i in range(n):
    time.sleep(0.1)
    print("#" * 80)
    print(f"                 Learning iteration {i}/{n}")
    print(f"                 Total steps: {(i + 1) * 1000}")
    print("                 Collection time: 0.200s")
    print("                 Learning time: 0.100s")
    print(f"                 Mean reward: {i:.2f}", flush=True)
"""
OUR_TRAIN = """
import json, os, pathlib, sys, time
pathlib.Path("cache.txt").write_text(os.environ.get("WARP_CACHE_PATH", ""))
n = int(sys.argv[sys.argv.index("--max-iterations") + 1])
run = pathlib.Path(sys.argv[sys.argv.index("--log-root") + 1]) / "g1" / "run"
run.mkdir(parents=True)
for i in range(1, n + 1):
    time.sleep(0.1)
    with open(run / "progress.jsonl", "a") as f:
        f.write(json.dumps({"iteration": i, "env_steps": 1000, "collect_s": 0.16,
                            "learn_s": 0.08, "mean_reward": i - 1.0}) + "\\n")
"""


def test_gpu_section_runs_both_sides_and_computes_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU comparison's orchestration on a machine without a GPU: stand-in commands,
    a stand-in probe and rollout; alternation, parsing, first-iteration times and figures."""
    pytest.importorskip("mjlab", reason="the GPU comparison needs the [mjlab] extra")
    scripts = {}
    for name, code in (("train", MJLAB_TRAIN), ("mjlab-train", OUR_TRAIN)):
        path = tmp_path / name
        path.write_text(f"#!{sys.executable}\n{code}")
        path.chmod(0o755)
        scripts[name] = str(path)
    rollouts = []

    def rollout(cfg: BenchConfig, env: dict, device: str, n: int, timeout_s: float) -> dict:
        rollouts.append((device, n))
        return {"cartpole": {"ratios": [0.5, 0.7]}}

    def state(
        task: str, num_envs: int, folder: Path, device: str, env: dict, timeout_s: float
    ) -> dict:
        assert (task, num_envs, device) == ("Mjlab-Velocity-Flat-Unitree-G1", 4096, "cuda:0")
        return {"capture_s": 0.5, "write_s": 1.0, "restore_s": 2.0}

    monkeypatch.setattr(gpu, "cli", scripts.__getitem__)
    monkeypatch.setattr(gpu, "run_rollout", rollout)
    monkeypatch.setattr(gpu, "measure_in_process", state)
    monkeypatch.setattr(gpu, "cuda_probe", lambda env: {"available": True, "name": "Stand-in"})
    said: list[str] = []
    cfg = BenchConfig(out=tmp_path / "out", iterations=2, gpu_repeats=2)
    between: list[dict] = []
    record = gpu.run_gpu(Bench(cfg, said.append), after_cold=lambda r: between.append(dict(r)))

    assert rollouts == [("cuda:0", 4096)]
    pairs = record["mjlab"]["pairs"]
    assert len(pairs) == 2 and all(p["same_rewards"] for p in pairs)
    assert [p["mjlab_train"] for p in pairs] == pytest.approx([2000 / 0.6] * 2)
    assert [p["ours"] for p in pairs] == pytest.approx([2000 / 0.48] * 2)
    for p in pairs:  # after about one 0.1 s iteration, not at the end of the run
        assert (
            0.05 < p["ours_first_iteration_s"] < 5 and 0.05 < p["mjlab_train_first_iteration_s"] < 5
        )
    # The cold start-ups first, at once, each side with its own empty cache, which its later
    # runs reuse; then alternating order: mjlab's train first, then ours first.
    started = [line.split(":")[0].strip() for line in said if line.startswith("  gpu-")]
    assert sorted(started[:2]) == ["gpu-mjlab-train-cold", "gpu-ours-cold"]
    assert started[2:] == ["gpu-mjlab-train-1", "gpu-ours-1", "gpu-ours-2", "gpu-mjlab-train-2"]
    runs = cfg.out / "runs"
    for side in ("mjlab-train", "ours"):
        caches = {(runs / f"gpu-{side}-{k}" / "cache.txt").read_text() for k in ("cold", 1, 2)}
        assert caches == {str((runs / f"warp-cache-{side.replace('-', '_')}").resolve())}
    assert len(between) == 1 and set(between[0]["cold"]) == {"mjlab_train", "ours"}
    figures = {f.key: f.summary() for f in gpu.gpu_figures(cfg, record)}
    assert set(figures) == {
        "gpu_mjlab_vs_train",
        "gpu_first_iteration",
        "gpu_first_iteration_cold",
        "gpu_rollout_overhead_cartpole",
        "gpu_state_save_s",
        "gpu_state_restore_s",
    }
    assert set(figures) == set(gpu.GPU_FIGURES) - {"gpu_rollout_overhead_ant"}
    assert figures["gpu_mjlab_vs_train"]["median"] == pytest.approx(1.25)
    assert figures["gpu_mjlab_vs_train"]["met"] is True
    assert figures["gpu_first_iteration"]["n"] == 2
    assert figures["gpu_first_iteration_cold"]["n"] == 1
    assert figures["gpu_rollout_overhead_cartpole"]["median"] == pytest.approx(0.6)
    assert figures["gpu_rollout_overhead_cartpole"]["target"] == 0.95
    assert figures["gpu_state_save_s"]["median"] == pytest.approx(1.5)
    assert figures["gpu_state_restore_s"]["median"] == pytest.approx(2.0)


def test_healing_figures() -> None:
    """The self-healing figures from what the crash and hang jobs recorded in run.json."""
    details = {
        "crash": {"recovery_s": 21.5, "recomputed": 3},
        "hang": {"recovery_s": 33.0, "recomputed": 3},
    }
    figs = {f.key: f.summary() for f in healing_figures(details)}
    assert figs["heal_crash_s"]["median"] == 21.5 and figs["heal_crash_s"]["met"] is True
    assert figs["heal_hang_s"]["target"] == 60.0 + HANG_TIMEOUT_S
    assert "3 iteration(s) recomputed" in figs["heal_hang_s"]["definition"]
    assert [f.samples for f in healing_figures({})] == [(), ()]


def test_recovery_cases_and_outcomes(capsys: pytest.CaptureFixture) -> None:
    """`make bench-recovery`: every fault with a spare and with --min-nodes, and each case's
    figures from what its run recorded: bit-identical only where the world size was kept, a
    requeue or a second fault is not a case that healed in its allocation."""
    faults, hows = ("crash", "hang", "node-loss"), ("spare", "min-nodes")
    assert {c.name for c in recovery.CASES} == {
        *(f"{f}-{h}" for f in faults for h in hows),
        "node-loss-no-spare",
    }
    assert [c.requeues for c in recovery.CASES if c.requeues] == [1]
    case = next(c for c in recovery.CASES if c.name == "node-loss-spare")
    assert case.lose_node and "--spare-nodes" in case.args
    fault = Interruption(
        kind="in-allocation",
        reason="crash",
        recovery_s=12.7,
        recomputed=1,
        resumed_from=5,
        job_id="7",
        excluded_nodes=("node2",),
    )
    summary = {"iterations": 12, "world_size": 2, "job_id": 7, "param_digest_per_rank": ["a", "b"]}
    got = {"summary": summary, "faults": [fault], "restarts": 0}
    row = recovery.outcome(case, got, ["a", "b"])
    assert row["bit_identical"] is True and row["as_expected"] and row["world_size"] == [2, 2]
    assert recovery.outcome(case, got, ["a", "c"])["bit_identical"] is False
    assert recovery.outcome(case, {**got, "restarts": 1}, ["a", "b"])["as_expected"] is False
    fewer = {
        **got,
        "summary": {**summary, "world_size": 1},
        "faults": [dataclasses.replace(fault, world_size=(2, 1))],
    }
    assert recovery.outcome(case, fewer, ["a", "b"])["bit_identical"] is None
    no_spare = next(c for c in recovery.CASES if c.requeues)
    requeue = dataclasses.replace(fault, kind="requeue")
    requeued = {**got, "faults": [requeue], "restarts": 1}
    assert recovery.outcome(no_spare, requeued, ["a", "b"])["as_expected"] is True
    with pytest.raises(ValueError, match="one fault healed by kind in-allocation"):
        recovery.outcome(case, {**got, "faults": [requeue]}, None)
    with pytest.raises(ValueError, match="ended at iteration 9"):
        recovery.outcome(case, {**got, "summary": {**summary, "iterations": 9}}, None)
    recovery.print_table([row, {"case": "hang-spare", "error": "timed out"}])
    printed = capsys.readouterr().out
    assert "node-loss-spare" in printed and "12.7" in printed and "hang-spare" in printed
    assert recovery.main(["--cases", "crash-nowhere"]) == 2


def test_fsops_counts_the_calls_on_the_run_directory_and_fits_their_growth() -> None:
    """strace's lines (threads and children too) become ops of the run's processes, outside
    the run directory and outside the window not counted; a growth is named by its term."""
    from benchmarks.fsops import count, fit, parse_trace, predict

    run = "/r/run"
    lines = [
        '100 1.0 openat(AT_FDCWD</w>, "/r/run/progress.jsonl", O_WRONLY|O_CREAT|O_APPEND) = 3',
        '100 1.1 openat(4</r/run/logs>, "heartbeat", O_RDONLY|O_PATH) = 5</r/run/logs/heartbeat>',
        "101 1.2 getdents64(6</r/run/logs/heartbeat>, 0x55 /* 7 entries */, 32768) = 240",
        '101 1.3 renameat(5</r/run/logs/heartbeat>, ".n.tmp", 5</r/run/logs/heartbeat>, "n") = 0',
        '100 1.4 newfstatat(3</r/run/progress.jsonl>, "", {st_mode=S_IFREG}, AT_EMPTY_PATH) = 0',
        '100 1.5 openat(AT_FDCWD</w>, "/elsewhere/x", O_RDONLY) = 3',
        "100 1.6 clone3({flags=CLONE_VM|CLONE_THREAD, exit_signal=0}, 88 <unfinished ...>",
        "100 1.7 <... clone3 resumed> => {parent_tid=[102]}, 88) = 102",
        '102 1.8 unlinkat(5</r/run/logs/heartbeat>, "hang.json", 0) = 0',
        "100 1.9 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|SIGCHLD) = 103",
        '103 2.0 stat("/r/run/run.json", 0x7ff) = -1 ENOENT (No such file or directory)',
        '103 9.0 stat("/r/run/run.json", 0x7ff) = 0',  # after the window
        "104 1.9 getdents64(6</r/run/logs/heartbeat>,  <unfinished ...>",
        "104 2.0 <... getdents64 resumed>0x7f /* 3 entries */, 32768) = 72",
    ]
    counts = count(parse_trace(lines, run), {100: "rank 0", 101: "ranks"}, {}, (0.0, 2.0))
    per_s = {k: v * 2.0 for k, v in counts.by_kind.items()}  # ops in the 2 s window
    assert per_s == {
        "create": 1,
        "open": 1,
        "readdir": 2,
        "rename": 1,
        "fstat": 1,
        "unlink": 1,
        "stat": 1,
    }, per_s
    roles = {k: v * 2.0 for k, v in counts.by_role.items()}
    assert roles == {"rank 0": 5, "ranks": 2, "other": 1}, roles
    assert counts.readdir_entries * 2.0 == 10 and counts.by_file["logs/heartbeat/*"] * 2.0 == 5
    squared = [(r, n, 3 + 2 * n + 0.5 * r * r) for r, n in ((2, 1), (8, 1), (8, 4), (32, 8))]
    model = fit(squared)
    assert model["growth"] == "per rank^2" and round(predict(model, 64, 8)) == 3 + 16 + 2048
    per_node = [(r, n, 10 + 4 * n) for r, n in ((2, 1), (8, 1), (8, 4), (32, 8), (16, 16))]
    assert fit(per_node)["growth"] == "per node"

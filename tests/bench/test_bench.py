"""The benchmark (`make bench`): a real `--quick` run writes every figure and a readable PNG;
the statistics and the compile counter on their own. No timing is asserted: the figures of a
quick run on a shared machine mean nothing, only that they are all there."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from mjlab_hpc.bench.compile import CompileWatch
from mjlab_hpc.bench.report import main as bench_main
from mjlab_hpc.bench.stats import Figure, parse_rsl_rl_log, spread, throughput
from mjlab_hpc.bench.watch import bench_env

FIGURES = {
    "scaling_efficiency",
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
}
COUNTS = {"recovery_iterations_lost"}  # may be 0; every other figure is a positive ratio
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.training
@pytest.mark.mjlab
@pytest.mark.timeout(300)
def test_quick_bench_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench"
    assert bench_main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scaling efficiency" in printed  # the table comes last

    doc = json.loads((out / "bench.json").read_text())
    assert doc["failures"] == []
    assert doc["quick"] is True
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    assert set(doc["figures"]) == FIGURES
    for key, fig in doc["figures"].items():
        assert fig["n"] >= 1, key
        for stat in ("median", "q1", "q3", "min", "max"):
            value = fig[stat]
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, stat, value)
            assert value >= 0 if key in COUNTS else value > 0, (key, stat, value)
        assert fig["min"] <= fig["median"] <= fig["max"]
        assert isinstance(fig["met"], bool)
    compiles = doc["details"]["compilations"]
    assert compiles["one-1"]["compilations"] >= 1  # the partly cold cache did compile
    assert doc["details"]["pairs"][0]["recovery"]["completed"] is True
    # mjlab's train and ours ran the same configuration and seeds: the same rewards.
    assert doc["details"]["mjlab"]["pairs"][0]["same_rewards"] is True

    png = out / "bench.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

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

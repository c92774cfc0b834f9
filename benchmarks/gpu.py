"""The GPU figures of the benchmark, measured only where CUDA is available; without a GPU the
section records (and says) why it was skipped.

- an mjlab task (Mjlab-Velocity-Flat-Unitree-G1, 4096 envs) through our `mjlab-train
  --gpu-ids 0` against mjlab's own `train --gpu-ids 0` on the same GPU, in alternating order:
  env-steps/s of iterations 2.., and the time from the process's start to its first finished
  iteration;
- env.step / raw mujoco_warp graph replay of the built-in tasks on `cuda:0` (`rollout`).

Both trainings run with their default threads and unbuffered output, so that the end of the
first iteration is seen when it happens (ours: the first line of progress.jsonl; mjlab's:
rsl-rl's first "Learning iteration" block, printed when that iteration ends).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.rollout import run_rollout
from benchmarks.session import Bench
from benchmarks.stats import Figure, reward_text, throughput
from benchmarks.watch import bench_env, cli, find_run_dir, kill_job, measured_records
from mjlab_hpc.rundir.layout import PROGRESS, read_jsonl

__all__ = ["GPU_FIGURES", "cuda_probe", "gpu_figures", "run_gpu"]

#: The GPU figures of a default run (with a GPU and the [mjlab] extra).
GPU_FIGURES = (
    "gpu_mjlab_vs_train",
    "gpu_first_iteration",
    "gpu_rollout_overhead_cartpole",
    "gpu_rollout_overhead_ant",
)

# Asked in a fresh interpreter: the benchmark process itself never initialises CUDA.
_PROBE = """
import json, torch
out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "available": torch.cuda.is_available()}
if out["available"]:
    p = torch.cuda.get_device_properties(0)
    out.update(count=torch.cuda.device_count(), name=p.name,
               capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
print(json.dumps(out))
"""
# rsl-rl prints this header when an iteration has ended.
_RSL_ITERATION_DONE = re.compile(r"Learning iteration\s+\d+/\d+")
_POLL_S = 0.05


def _nvidia_smi_gpus() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "nvidia-smi is not installed"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed ({exc})"
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    return f"nvidia-smi lists {count} GPU(s)"


def cuda_probe(env: dict[str, str], timeout_s: float = 120.0) -> dict[str, Any]:
    """What CUDA torch sees, asked in a fresh interpreter with environment `env`: `available`,
    and the first device's `name`, `count`, `capability`, `memory_gib`; else `reason`."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
        found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"available": False, "reason": f"the CUDA probe failed ({exc})"}
    if not found["available"]:
        smi = _nvidia_smi_gpus()
        if found.get("torch_cuda"):
            why = f"torch {found['torch']} (CUDA {found['torch_cuda']}) sees no CUDA device"
        else:
            why = f"torch {found['torch']} is a CPU build"
        hint = ""
        if "lists 0" not in smi and "lists" in smi:  # a GPU, but not for this torch
            hint = "; for GPU figures run make bench VENV=.venv-gpu GPU=1 (torch's CUDA build)"
        found["reason"] = f"{why}, {smi}{hint}"
    return found


def run_gpu(bench: Bench) -> dict[str, Any]:
    """Measure the GPU figures into `bench.details["gpu"]` where CUDA is available; else record
    and say why they were skipped. Returns that record."""
    cfg = bench.cfg
    if not cfg.gpu:
        record: dict[str, Any] = {"skipped": "not asked for (--no-gpu)"}
    else:
        probe = cuda_probe(bench_env(gpus=True))
        if probe["available"]:
            record = {"device": probe}
        else:
            record = {"skipped": f"no GPU: {probe['reason']}", "probe": probe}
    bench.details["gpu"] = record
    if "skipped" in record:
        bench.say(f"GPU figures: skipped: {record['skipped']}")
        return record
    name, n = record["device"]["name"], cfg.gpu_num_envs
    bench.say(f"GPU rollout overhead on {name}: {', '.join(cfg.rollout_tasks)} x {n} worlds")
    try:
        record["rollout"] = run_rollout(
            cfg, bench_env(gpus=True), "cuda:0", n, timeout_s=2 * cfg.run_timeout_s
        )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        bench.failures.append(f"gpu rollout: {exc}")
        record["rollout"] = {}
    _mjlab_pairs(bench, record)
    return record


def _mjlab_pairs(bench: Bench, record: dict[str, Any]) -> None:
    cfg = bench.cfg
    if importlib.util.find_spec("mjlab") is None:
        record["mjlab"] = {"skipped": "the [mjlab] extra is not installed"}
        bench.say("GPU mjlab comparison: skipped (the [mjlab] extra is not installed)")
        return
    last = cfg.measured + 1  # iteration 1 is the warm-up
    pairs: list[dict[str, Any]] = []
    record["mjlab"] = {"task": cfg.gpu_task, "num_envs": cfg.gpu_num_envs, "pairs": pairs}
    sides = ("mjlab_train", "ours")
    for r in range(1, cfg.gpu_pairs + 1):
        order = sides if r % 2 else sides[::-1]
        bench.say(f"GPU {r}/{cfg.gpu_pairs}: {cfg.gpu_task} x {cfg.gpu_num_envs} envs: "
                  f"{' | '.join(order)}")  # fmt: skip
        got: dict[str, dict[str, Any]] = {}
        for side in order:
            run = _gpu_run(bench, side, r, last)
            if run is None:
                break
            got[side] = run
        if len(got) < len(sides):
            continue
        pairs.append(
            {
                **{side: throughput(got[side]["records"]) for side in sides},
                **{f"{side}_first_iteration_s": got[side]["first_s"] for side in sides},
                # Informative: GPU physics and PPO need not be bit-reproducible.
                "same_rewards": _rewards(got["mjlab_train"]["records"], "reward")
                == _rewards(got["ours"]["records"], "mean_reward"),
            }
        )


def _rewards(records: list[dict[str, Any]], key: str) -> list[str | None]:
    return [reward_text(r.get(key)) for r in records]


def _gpu_run(bench: Bench, side: str, repeat: int, iterations: int) -> dict[str, Any] | None:
    """One side of the GPU comparison in `<runs>/gpu-<side>-<repeat>`: its records of
    iterations 2..`iterations` and seconds to its first iteration; None if it failed."""
    cfg = bench.cfg
    name = f"gpu-{side.replace('_', '-')}-{repeat}"
    cwd = (bench.runs / name).resolve()
    cwd.mkdir(parents=True)
    envs, its = str(cfg.gpu_num_envs), str(iterations)
    out = cwd / f"{name}.out"
    if side == "mjlab_train":
        cmd = [
            cli("train"), cfg.gpu_task,
            "--env.scene.num-envs", envs,
            "--agent.max-iterations", its,
            "--agent.logger", "tensorboard",
            "--gpu-ids", "0",
        ]  # fmt: skip
    else:
        cmd = [
            cli("mjlab-train"), cfg.gpu_task,
            "--num-envs", envs,
            "--max-iterations", its,
            "--gpu-ids", "0",
            "--log-root", str(cwd / "logs"),
            "--agent.logger", "tensorboard",
        ]  # fmt: skip

    def first_done() -> bool:
        if side == "mjlab_train":
            return bool(_RSL_ITERATION_DONE.search(out.read_text(errors="replace")))
        run = find_run_dir(cwd / "logs")
        return run is not None and bool(read_jsonl(run / PROGRESS))

    code, first_s = _run_timed(cmd, cwd, out, first_done, 2 * cfg.run_timeout_s)
    text = out.read_text(errors="replace")
    records = measured_records(side, text, cwd, iterations)
    if code != 0 or len(records) != iterations - 1:
        bench.failures.append(f"{name}: exit {code}\n{text[-1500:]}")
        bench.say(f"  {name}: FAILED (exit {code}), output in {out}")
        return None
    first = f"{first_s:.1f} s" if first_s is not None else "not seen"
    bench.say(f"  {name}: {throughput(records):,.0f} env-steps/s, first iteration {first}")
    return {"records": records, "first_s": first_s}


def _run_timed(
    cmd: list[str], cwd: Path, out: Path, first_done: Callable[[], bool], timeout_s: float
) -> tuple[int | None, float | None]:
    """Run `cmd` to its end (killed after `timeout_s`); its exit code and the seconds from its
    start until `first_done()` was first true (None: not seen while it ran)."""
    first: float | None = None
    with open(out, "w") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=bench_env({"PYTHONUNBUFFERED": "1"}, gpus=True), stdout=f,
            stderr=subprocess.STDOUT, start_new_session=True,  # a timeout ends the whole job
        )  # fmt: skip
        try:
            while proc.poll() is None and time.monotonic() - t0 < timeout_s:
                if first is None and first_done():
                    first = time.monotonic() - t0
                time.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                kill_job(proc)
    return proc.returncode, first


def gpu_figures(cfg: BenchConfig, record: dict[str, Any]) -> list[Figure]:
    """The figures of the GPU section (none when it was skipped)."""
    if "skipped" in record:
        return []
    figs = [
        Figure(f"gpu_rollout_overhead_{task}", f"GPU env.step / raw physics ({task})",
               tuple(data["ratios"]), 0.9, ">=",
               "env.step throughput / raw mujoco_warp graph replay throughput on cuda:0, same "
               "worlds and substeps, each side synchronised", "gpu")
        for task, data in record.get("rollout", {}).items()
    ]  # fmt: skip
    mj = record.get("mjlab", {})
    if "skipped" in mj:
        return figs
    pairs, task = mj.get("pairs", []), cfg.gpu_task
    firsts = [
        p["ours_first_iteration_s"] / p["mjlab_train_first_iteration_s"]
        for p in pairs
        if p["ours_first_iteration_s"] and p["mjlab_train_first_iteration_s"]
    ]
    figs += [
        Figure("gpu_mjlab_vs_train", f"GPU {task}: ours / mjlab train",
               tuple(p["ours"] / p["mjlab_train"] for p in pairs), 1.0, ">=",
               "env-steps/s of mjlab-train --gpu-ids 0 / mjlab's own train --gpu-ids 0, same "
               "GPU, task and envs, iterations 2..", "gpu"),
        Figure("gpu_first_iteration", f"GPU {task}: first iteration, ours / mjlab train",
               tuple(firsts), 1.2, "<=",
               "process start to first finished iteration, mjlab-train / mjlab's own train "
               "(imports, environment, CUDA graphs, one iteration)", "gpu"),
    ]  # fmt: skip
    return figs

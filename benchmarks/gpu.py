"""The GPU figures of the benchmark, measured only where CUDA is available.

Without a GPU the section records (and says) why it was skipped. Measured are:

- an mjlab task (Mjlab-Velocity-Flat-Unitree-G1, 4096 envs) through our `mjlab-train
  --gpu-ids 0` against mjlab's own `train --gpu-ids "[0]"` on the same GPU. First the time
  from the process's start to its first finished iteration with a cold Warp kernel cache
  (both at once, each with an empty cache of its own); then, with each side's cache warm, in
  alternating order, env-steps/s of iterations 2.. and the time to the first iteration again;
- env.step / raw mujoco_warp graph replay of the built-in tasks on `cuda:0` (`rollout`);
- the seconds to save and to restore one rank's whole state of that task at 4096 envs on the
  GPU (`benchmarks.envstate`).

Both trainings run with their default threads and unbuffered output, so that the end of the
first iteration is seen when it happens (ours: the first line of progress.jsonl; mjlab's:
rsl-rl's first "Learning iteration" block, printed when that iteration ends).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.envstate import measure_in_process
from benchmarks.rollout import run_rollout
from benchmarks.session import Bench
from benchmarks.stats import Figure, read_jsonl, reward_text, throughput
from benchmarks.watch import bench_env, cli, find_run_dir, kill_job, measured_records
from mjlab_hpc.rundir.layout import PROGRESS
from mjlab_hpc.tasks.video import gl_unloadable

__all__ = ["GPU_FIGURES", "cuda_probe", "gpu_figures", "run_gpu"]

#: The GPU figures of a default run (with a GPU and the [mjlab] extra).
GPU_FIGURES = (
    "gpu_mjlab_vs_train",
    "gpu_first_iteration",
    "gpu_first_iteration_cold",
    "gpu_rollout_overhead_cartpole",
    "gpu_rollout_overhead_ant",
    "gpu_state_save_s",
    "gpu_state_restore_s",
)
_SIDES = ("mjlab_train", "ours")

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
    """Ask a fresh interpreter with environment `env` what CUDA torch sees.

    The answer holds `available`, and the first device's `name`, `count`, `capability` and
    `memory_gib`; else `reason`.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
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


def run_gpu(
    bench: Bench, after_cold: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Measure the GPU figures into `bench.details["gpu"]` where CUDA is available.

    Without CUDA it records and says why they were skipped. Returns that record.
    `after_cold(record)` runs once the cold start-ups have filled the kernel caches
    (`record["caches"]`), before the rest.
    """
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
    mjlab = importlib.util.find_spec("mjlab") is not None
    if mjlab:
        _cold_pair(bench, record)
    else:
        record["mjlab"] = {"skipped": "the [mjlab] extra is not installed"}
        bench.say("GPU mjlab comparison and state: skipped (the [mjlab] extra is not installed)")
    if after_cold is not None:
        after_cold(record)
    name, n = record["device"]["name"], cfg.gpu_num_envs
    bench.say(f"GPU rollout overhead on {name}: {', '.join(cfg.rollout_tasks)} x {n} worlds")
    try:
        record["rollout"] = run_rollout(
            cfg, _gpu_env(record, "ours"), "cuda:0", n, timeout_s=2 * cfg.run_timeout_s
        )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        bench.failures.append(f"gpu rollout: {exc}")
        record["rollout"] = {}
    if mjlab:
        _warm_pairs(bench, record)
        _state(bench, record)
    return record


def _gpu_env(record: dict[str, Any], side: str) -> dict[str, str]:
    """Return a GPU run's environment: unbuffered, with the side's own kernel cache, if any."""
    extra = {"PYTHONUNBUFFERED": "1"}
    if "MUJOCO_GL" not in os.environ and gl_unloadable("egl") is not None:
        # No EGL here: mjlab's own train would fail importing it; both sides render nothing.
        extra["MUJOCO_GL"] = "disable"
    if cache := record.get("caches", {}).get(side):
        extra["WARP_CACHE_PATH"] = cache
    return bench_env(extra, gpus=True)


def _cold_pair(bench: Bench, record: dict[str, Any]) -> None:
    """Start both sides at once, each from an empty Warp kernel cache of its own.

    Kernels compile on the CPU, one module at a time per process, so the two do not wait on
    each other. Their caches then serve every later run of the side.
    """
    cfg = bench.cfg
    caches = {side: (bench.runs / f"warp-cache-{side}").resolve() for side in _SIDES}
    record["caches"] = {side: str(path) for side, path in caches.items()}
    bench.say(
        f"GPU cold start: {cfg.gpu_task} x {cfg.gpu_num_envs} envs, both sides at once, "
        "each with an empty kernel cache"
    )
    started = {}
    for side in _SIDES:
        caches[side].mkdir(parents=True, exist_ok=True)
        started[side] = _start(bench, side, label="cold", iterations=2, env=_gpu_env(record, side))
    got = {side: _finish(bench, *started[side], iterations=2) for side in _SIDES}
    record["cold"] = {side: run and run["first_s"] for side, run in got.items()}


def _warm_pairs(bench: Bench, record: dict[str, Any]) -> None:
    cfg = bench.cfg
    last = cfg.measured + 1  # iteration 1 is the warm-up
    pairs: list[dict[str, Any]] = []
    record["mjlab"] = {"task": cfg.gpu_task, "num_envs": cfg.gpu_num_envs, "pairs": pairs}
    for r in range(1, cfg.gpu_pairs + 1):
        order = _SIDES if r % 2 else _SIDES[::-1]
        bench.say(
            f"GPU {r}/{cfg.gpu_pairs}: {cfg.gpu_task} x {cfg.gpu_num_envs} envs: "
            f"{' | '.join(order)}"
        )
        got: dict[str, dict[str, Any]] = {}
        for side in order:
            start = _start(bench, side, label=str(r), iterations=last, env=_gpu_env(record, side))
            run = _finish(bench, *start, iterations=last)
            if run is None:
                break
            got[side] = run
        if len(got) < len(_SIDES):
            continue
        pairs.append(
            {
                **{side: throughput(got[side]["records"]) for side in _SIDES},
                **{f"{side}_first_iteration_s": got[side]["first_s"] for side in _SIDES},
                # Informative: GPU physics and PPO need not be bit-reproducible.
                "same_rewards": _rewards(got["mjlab_train"]["records"], "reward")
                == _rewards(got["ours"]["records"], "mean_reward"),
            }
        )


def _state(bench: Bench, record: dict[str, Any]) -> None:
    """One rank's whole state of the GPU task on the GPU: seconds to save and to restore."""
    cfg = bench.cfg
    bench.say(f"GPU rank state: {cfg.gpu_task} x {cfg.gpu_num_envs} envs, save and restore")
    folder = bench.runs / "gpu-state"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        record["state"] = measure_in_process(
            cfg.gpu_task,
            num_envs=cfg.gpu_num_envs,
            folder=folder,
            device="cuda:0",
            env=_gpu_env(record, "ours"),
            timeout_s=2 * cfg.run_timeout_s,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        bench.failures.append(f"gpu rank state: {exc}")
        record["state"] = {}


def _rewards(records: list[dict[str, Any]], key: str) -> list[str | None]:
    return [reward_text(r.get(key)) for r in records]


def _start(
    bench: Bench, side: str, label: str, iterations: int, env: dict[str, str]
) -> tuple[str, Path, subprocess.Popen[bytes], float]:
    """Start one side of the GPU comparison in `<runs>/gpu-<side>-<label>`."""
    cfg = bench.cfg
    name = f"gpu-{side.replace('_', '-')}-{label}"
    cwd = (bench.runs / name).resolve()
    cwd.mkdir(parents=True)
    envs, its = str(cfg.gpu_num_envs), str(iterations)
    if side == "mjlab_train":
        # mjlab's `train` command; where only its package is there (a site module), the
        # same entry point through Python.
        train = cli("train")
        head = [train] if Path(train).is_file() else [sys.executable, "-m", "mjlab.scripts.train"]
        cmd = [
            *head,
            cfg.gpu_task,
            "--env.scene.num-envs",
            envs,
            "--agent.max-iterations",
            its,
            "--agent.logger",
            "tensorboard",
            "--gpu-ids",
            "[0]",  # mjlab 1.6 reads lists in Python's syntax
        ]
    else:
        cmd = [
            cli("mjlab-train"),
            cfg.gpu_task,
            "--num-envs",
            envs,
            "--max-iterations",
            its,
            "--gpu-ids",
            "0",
            "--log-root",
            str(cwd / "logs"),
            "--agent.logger",
            "tensorboard",
        ]
    out = cwd / f"{name}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a timeout ends the whole job
        )
    return side, cwd, proc, time.monotonic()


def _first_done(side: str, cwd: Path) -> bool:
    """Whether the side's first iteration has ended.

    Ours has then written its first progress record; mjlab's has printed rsl-rl's first
    "Learning iteration" block.
    """
    if side == "mjlab_train":
        out = next(cwd.glob("*.out"))
        return bool(_RSL_ITERATION_DONE.search(out.read_text(errors="replace")))
    run = find_run_dir(cwd / "logs")
    return run is not None and bool(read_jsonl(run / PROGRESS))


def _finish(
    bench: Bench,
    side: str,
    cwd: Path,
    proc: subprocess.Popen[bytes],
    t0: float,
    iterations: int,
) -> dict[str, Any] | None:
    """Wait for a started side to end; it is killed after twice the run timeout.

    Returns its records of iterations 2..`iterations` and the seconds from its start to its
    first iteration; None if it failed.
    """
    first: float | None = None
    timeout_s = 2 * bench.cfg.run_timeout_s
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout_s:
            if first is None and _first_done(side, cwd):
                first = time.monotonic() - t0
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    if first is None and _first_done(side, cwd):  # ended between two polls
        first = time.monotonic() - t0
    out = next(cwd.glob("*.out"))
    text = out.read_text(errors="replace")
    records = measured_records(side, text, cwd, iterations)
    if proc.returncode != 0 or len(records) != iterations - 1:
        bench.failures.append(f"{cwd.name}: exit {proc.returncode}\n{text[-1500:]}")
        bench.say(f"  {cwd.name}: FAILED (exit {proc.returncode}), output in {out}")
        return None
    seen = f"{first:.1f} s" if first is not None else "not seen"
    bench.say(f"  {cwd.name}: {throughput(records):,.0f} env-steps/s, first iteration {seen}")
    return {"records": records, "first_s": first}


def gpu_figures(cfg: BenchConfig, record: dict[str, Any]) -> list[Figure]:
    """The figures of the GPU section (none when it was skipped)."""
    if "skipped" in record:
        return []
    task, n = cfg.gpu_task, cfg.gpu_num_envs
    figs = [
        Figure(
            key=f"gpu_rollout_overhead_{name}",
            label=f"GPU env.step / raw physics ({name})",
            samples=tuple(data["ratios"]),
            target=0.95,
            direction=">=",
            definition=(
                "env.step throughput / raw mujoco_warp graph replay throughput on cuda:0, same "
                "worlds and substeps, each side synchronised"
            ),
            section="gpu",
        )
        for name, data in record.get("rollout", {}).items()
    ]
    mj = record.get("mjlab", {})
    if "skipped" in mj:
        return figs
    pairs = mj.get("pairs", [])
    firsts = [
        p["ours_first_iteration_s"] / p["mjlab_train_first_iteration_s"]
        for p in pairs
        if p["ours_first_iteration_s"] and p["mjlab_train_first_iteration_s"]
    ]
    cold = record.get("cold", {})
    cold_ratio = (
        (cold["ours"] / cold["mjlab_train"],)
        if cold.get("ours") and cold.get("mjlab_train")
        else ()
    )
    state = record.get("state", {})
    figs += [
        Figure(
            key="gpu_mjlab_vs_train",
            label=f"GPU {task}: ours / mjlab train",
            samples=tuple(p["ours"] / p["mjlab_train"] for p in pairs),
            target=1.0,
            direction=">=",
            definition=(
                "env-steps/s of mjlab-train --gpu-ids 0 / mjlab's own train --gpu-ids [0], same "
                "GPU, task and envs, iterations 2.."
            ),
            section="gpu",
        ),
        Figure(
            key="gpu_first_iteration",
            label=f"GPU {task}: first iteration, ours / mjlab train",
            samples=tuple(firsts),
            target=1.2,
            direction="<=",
            definition=(
                "process start to first finished iteration, mjlab-train / mjlab's own train, "
                "warm kernel cache (imports, environment, CUDA graphs, one iteration)"
            ),
            section="gpu",
        ),
        Figure(
            key="gpu_first_iteration_cold",
            label=f"GPU {task}: first iteration, cold cache, ours / mjlab train",
            samples=cold_ratio,
            target=1.2,
            direction="<=",
            definition=(
                "process start to first finished iteration from an empty Warp kernel cache "
                "(kernels compiled), both sides at once, each with its own cache"
            ),
            section="gpu",
        ),
        Figure(
            key="gpu_state_save_s",
            label=f"GPU {task}: rank state save, {n} envs (s)",
            samples=(state["capture_s"] + state["write_s"],) if state else (),
            target=None,
            direction="<=",
            definition="capture the env's whole state on the GPU and write the rank's file (fsync)",
            section="gpu",
        ),
        Figure(
            key="gpu_state_restore_s",
            label=f"GPU {task}: rank state restore, {n} envs (s)",
            samples=(state["restore_s"],) if state else (),
            target=None,
            direction="<=",
            definition="read the rank's file and restore it into a fresh env on the GPU",
            section="gpu",
        ),
    ]
    return figs

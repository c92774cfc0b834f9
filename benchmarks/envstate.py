"""Checkpoints with every rank's environments: the cost of one rank's whole state.

The task is Rough G1, mjlab's largest (terrain, raycast sensors), at several sizes, each in a
process of its own. Measured are the bytes of its state file, the seconds to capture and write
it (serialise, write, fsync: what each rank does at every checkpoint), and the seconds to read
and restore it into a freshly built env (what each rank does on a continuation). The bytes are
fitted as a + b * envs and the times scaled by the bytes, so a size this machine cannot build
is extrapolated (the figures name the sizes measured).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.stats import Figure

__all__ = ["envstate_figures", "fit", "measure_in_process", "run_envstate"]

TASK = "Mjlab-Velocity-Rough-Unitree-G1"
#: The size the figures are given at (mjlab's default for its velocity tasks).
AT = 4096


def _measure(task: str, num_envs: int, folder: Path, device: str = "cpu") -> dict[str, Any]:
    """Build, step, save, load and restore one env of `num_envs` on `device`, timing each.

    It runs in a process of its own. CUDA work is waited for inside each timed part.
    """
    import torch
    import warp as wp

    from mjlab_hpc.rundir.checkpoint import load_rank_state, publish_rank_states, write_rank_state
    from mjlab_hpc.tasks import mjlab as mt
    from mjlab_hpc.tasks.memory import init_warp

    init_warp()

    def build() -> Any:
        with contextlib.redirect_stdout(io.StringIO()):
            return mt.make_mjlab_runtime(
                task, num_envs=num_envs, max_iterations=1, seed=0, device=device, cpu_graph=True
            ).env

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    env = build()
    actions = torch.zeros(num_envs, env.num_actions, device=device)
    with wp.ScopedDevice(device):
        env.step(actions)
        sync()
        t0 = time.perf_counter()
        env.step(actions)
        sync()
        step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mt.capture_env(env)
    first_s = time.perf_counter() - t0  # the first in a process: once per start
    t0 = time.perf_counter()
    state = {"env": mt.capture_env(env), "torch_rng": torch.get_rng_state()}
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    belongs = {"run": "bench", "task": task, "iteration": 1}
    checkpoint = folder / "model_1.pt"
    written = write_rank_state(checkpoint, 0, 1, state, belongs)
    write_s = time.perf_counter() - t0
    publish_rank_states(checkpoint, [written], lambda: None)
    size = written[2]
    del env, state
    fresh = build()
    t0 = time.perf_counter()
    loaded = load_rank_state(checkpoint, 0, 1, belongs)  # as a resume loads it: weights only
    problems = mt.restore_env(fresh, loaded["env"], device)
    sync()
    restore_s = time.perf_counter() - t0
    shutil.rmtree(folder / "rank_states")
    return {
        "num_envs": num_envs,
        "bytes": size,
        "capture_s": capture_s,
        "write_s": write_s,
        "restore_s": restore_s,
        "env_step_s": step_s,
        "first_capture_s": first_s,
        "problems": problems,
        "device": device,
    }


def measure_in_process(
    task: str, num_envs: int, folder: Path, device: str, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Run `_measure` in a fresh interpreter with environment `env`; RuntimeError if it failed."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.envstate", task, str(folder), device, str(num_envs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1000:]}")
    return dict(json.loads(lines[-1]))


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares a + b * x through (x, y) points: (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - b * mx, b


def run_envstate(
    cfg: BenchConfig, say: Callable[[str], None], runs: Path
) -> tuple[dict[str, Any], list[str]]:
    """Measure every size in its own process; the details (with the fits) and failures."""
    # A quick run measures its two small sizes in one process (mjlab imports once).
    # AT itself is fitted, not built: G1 rough at 4096 envs steps too slowly on a small CPU.
    groups = [(4, 16)] if cfg.quick else [(64,), (256,), (1024,)]
    folder = runs / "envstate"
    folder.mkdir(parents=True, exist_ok=True)
    measured, failures = [], []
    for sizes in groups:
        say(f"rank state of {TASK} with {', '.join(map(str, sizes))} envs")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.envstate",
                TASK,
                str(folder),
                "cpu",
                *map(str, sizes),
            ],
            capture_output=True,
            text=True,
            timeout=cfg.run_timeout_s * 4,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or len(lines) != len(sizes):
            failures.append(f"rank state with {sizes} envs: {proc.stderr[-500:]}")
            continue
        measured.extend(json.loads(x) for x in lines)
    details: dict[str, Any] = {"task": TASK, "measured": measured, "at": AT}
    if len(measured) >= 2:
        a, b = fit([(m["num_envs"], m["bytes"]) for m in measured])
        details["bytes"] = {"fixed": a, "per_env": b, "at": a + b * AT}
        # Times scale with the bytes moved; a line through a few noisy times can slope down.
        total = sum(m["bytes"] for m in measured)
        for key in ("capture_s", "write_s", "restore_s"):
            per_byte = sum(m[key] for m in measured) / total
            details[key] = {"per_byte": per_byte, "at": per_byte * details["bytes"]["at"]}
    return details, failures


def envstate_figures(details: dict[str, Any]) -> list[Figure]:
    """A rank's state at `AT` envs: megabytes, and seconds to save and to restore it."""
    sizes = ", ".join(str(m["num_envs"]) for m in details.get("measured", []))
    how = f"{TASK}, one rank, from {sizes} envs (bytes: a + b*envs; times: per byte)"
    figs = []
    for key, label, scale in (
        ("bytes", f"rank state, {AT} envs (MB)", 1e-6),
        ("write_s", f"rank state write, {AT} envs (s)", 1.0),
        ("capture_s", f"rank state capture, {AT} envs (s)", 1.0),
        ("restore_s", f"rank state load+restore, {AT} envs (s)", 1.0),
    ):
        got = details.get(key)
        figs.append(
            Figure(
                key=f"envstate_{key}",
                label=label,
                samples=(got["at"] * scale,) if got else (),
                target=None,
                direction="<=",
                definition=how,
                section="checkpoints",
            )
        )
    return figs


if __name__ == "__main__":  # TASK FOLDER DEVICE SIZE...
    task, folder, device = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    for size in sys.argv[4:]:
        got = _measure(task, num_envs=int(size), folder=folder, device=device)
        print(json.dumps(got), flush=True)

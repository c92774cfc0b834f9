"""Rollout overhead: `env.step` against raw MuJoCo Warp graph replay of the same worlds.

Each side runs in a fresh subprocess with one torch thread, on the CPU or (the GPU section) on
a CUDA device.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.config import BenchConfig
from mjlab_hpc.tasks.builtin import get_task

__all__ = ["rollout_worker", "run_rollout"]


def rollout_worker(args_json: str) -> dict[str, Any]:
    """Time env.step against raw graph replay of the same worlds, alternately, for each task.

    Runs in a fresh process with one torch thread (called through `python -c`). The two
    alternate at every step from the same state with the same fixed actions. `device`
    (default cpu) may name a CUDA device: each timed part then ends with a synchronisation,
    since CUDA work is only queued when the call returns.
    """
    import torch
    import warp as wp

    args = json.loads(args_json)
    device = args.get("device", "cpu")
    wp.config.quiet = True
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in args["tasks"]:
        task = get_task(name)
        if task.make_env is None:
            raise ValueError(f"{name}: the rollout benchmark takes built-in tasks")
        with wp.ScopedDevice(device):
            env = task.make_env(args["num_envs"], device, 0, True)
            out[name] = _rollout_pairs(env, args["pairs"], args["block_s"])
    return out


def _synchronizer(device: str) -> Callable[[], None]:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if not device.startswith("cuda"):
        return lambda: None
    import torch

    # The whole device: torch's stream and Warp's.
    return lambda: torch.cuda.synchronize(torch.device(device))


def _rollout_pairs(env: Any, pairs: int, block_s: float) -> dict[str, Any]:
    import torch

    sync = _synchronizer(str(env.device))
    gen = torch.Generator().manual_seed(0)
    actions = (torch.rand((env.num_envs, env.num_actions), generator=gen) * 2 - 1).to(env.device)
    state = env.state_dict()

    def timed(fn: Callable[[], object], k: int) -> float:
        env.load_state_dict(state)
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        return time.perf_counter() - t0

    def pair(k: int) -> tuple[float, float]:
        # Alternate at every step (raw replay, back to the same state, env.step), so that both
        # sides of a pair see the same states and the same moments of machine load.
        env.load_state_dict(state)
        raw = stepped = 0.0
        for _ in range(k):
            before = env.state_dict()
            sync()
            t0 = time.perf_counter()
            env.simulate()
            sync()
            t1 = time.perf_counter()
            env.load_state_dict(before)
            sync()
            t2 = time.perf_counter()
            env.step(actions)
            sync()
            t3 = time.perf_counter()
            raw += t1 - t0
            stepped += t3 - t2
        return raw, stepped

    # Enough steps per pair for block_s of physics (a short block is all timer noise).
    per = timed(env.simulate, 3) / 3
    k = max(3, math.ceil(block_s / max(per, 1e-6)))
    pair(2)  # warm-up of the torch side
    raw, stepped = [], []
    for _ in range(pairs):
        r, st = pair(k)
        raw.append(r)
        stepped.append(st)
    breakdown = _step_breakdown(env, actions, state, k, sync)
    n = env.num_envs
    return {
        "device": str(env.device),
        "steps_per_block": k,
        "num_envs": n,
        "decimation": env.cfg.decimation,
        "raw_env_steps_per_s": [k * n / s for s in raw],
        "step_env_steps_per_s": [k * n / s for s in stepped],
        "ratios": [r / s for r, s in zip(raw, stepped, strict=True)],
        "step_breakdown_us": breakdown,
    }


def _step_breakdown(
    env: Any, actions: Any, state: dict[str, Any], k: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Microseconds per env.step in each of its parts (a profile of the overhead)."""
    import torch

    env.load_state_dict(state)
    done = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
    parts: dict[str, Callable[[], object]] = {
        "actions_to_ctrl": lambda: env.ctrl.copy_(actions.clamp(-1.0, 1.0) * env.cfg.action_scale),
        "physics": env.simulate,
        "reward_termination": env._reward_and_termination,
        "reset_worlds": lambda: env._reset_worlds(done),
        "observations": env._observations,
        "wrap_tensordict": lambda: env._wrap(env._obs),
    }
    out = {}
    for name, fn in parts.items():
        env.load_state_dict(state)
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        out[name] = (time.perf_counter() - t0) / k * 1e6
    env.load_state_dict(state)
    return out


def run_rollout(
    cfg: BenchConfig,
    env: dict[str, str],
    device: str = "cpu",
    num_envs: int | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run `rollout_worker` in a fresh interpreter on `device` with `num_envs` worlds
    (default: the CPU benchmark's) and return its result."""
    args = {
        "tasks": list(cfg.rollout_tasks),
        "device": device,
        "num_envs": num_envs or cfg.envs,
        "pairs": 2 if cfg.quick else max(cfg.pairs, 7),
        "block_s": 0.05 if cfg.quick else 0.3,
    }
    code = (
        "import json, sys\n"
        "from benchmarks.rollout import rollout_worker\n"
        "print('BENCH-RESULT ' + json.dumps(rollout_worker(sys.argv[1])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s or cfg.run_timeout_s,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            return dict(json.loads(line.removeprefix("BENCH-RESULT ")))
    raise RuntimeError(f"rollout benchmark failed ({proc.returncode}): {proc.stderr[-2000:]}")

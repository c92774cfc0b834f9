"""The benchmark's outputs (bench.json, bench.png, the table printed last) and its entry
point."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tyro

from benchmarks.config import BenchConfig
from benchmarks.envstate import envstate_figures, run_envstate
from benchmarks.gpu import gpu_figures, run_gpu
from benchmarks.healing import healing_figures, run_healing
from benchmarks.lock import lock_figures, run_lock
from benchmarks.session import Bench
from benchmarks.target import print_target_table, run_target, target_figures, write_target_png

__all__ = ["main", "run", "run_bench"]

SCHEMA_VERSION = 1


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform's answer elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the figures came from."""
    versions = {}
    for pkg in ("torch", "warp-lang", "mujoco", "mujoco-warp", "rsl-rl-lib", "submitit", "mjlab"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "gpu": None,
    }


def write_png(path: Path, figures: Sequence[dict[str, Any]]) -> None:
    """One panel per figure: median bar, min-max whiskers, quartile box, target line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    shown = [f for f in figures if f["median"] is not None]
    cols = 3
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, f in zip(axes.flat, shown, strict=False):
        colour = {True: "tab:green", False: "tab:red"}.get(f["met"], "tab:grey")
        med = f["median"]
        ax.bar([0], [med], width=0.5, color=colour, alpha=0.6)
        ax.errorbar(
            [0],
            [med],
            yerr=[[med - f["min"]], [f["max"] - med]],
            fmt="o",
            color="black",
            capsize=8,
            label="median, min-max",
        )
        ax.vlines([0], f["q1"], f["q3"], color="black", linewidth=5, alpha=0.5, label="IQR")
        if f["target"] is not None:
            ax.axhline(
                f["target"],
                color="tab:blue",
                linestyle="--",
                label=f"target {f['direction']} {f['target']:g}",
            )
        top = max(f["max"], f["target"] or 0) * 1.25 or 1.0
        ax.set_ylim(0, top)
        ax.set_xlim(-1, 1)
        ax.set_xticks([])
        ax.set_title(f"{f['label']}\n{med:.3g} (n={f['n']})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle("mjlab_hpc bench: ratios measured alternately (median, IQR, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(figures: Sequence[dict[str, Any]], out: Path) -> None:
    """The figures as a rich table (last thing printed)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mjlab_hpc bench ({out / 'bench.json'})")
    for col in ("figure", "median", "IQR", "min-max", "n", "target", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for f in figures:
        target = "-" if f["target"] is None else f"{f['direction']} {f['target']:g}"
        if f["median"] is None:
            table.add_row(f["label"], "n/a", "", "", "0", target, "?")
            continue
        met = {True: "[green]yes[/]", False: "[red]no[/]"}.get(f["met"], "-")
        table.add_row(
            f["label"],
            f"{f['median']:.3f}",
            f"{f['q1']:.3f}-{f['q3']:.3f}",
            f"{f['min']:.3f}-{f['max']:.3f}",
            str(f["n"]),
            target,
            met,
        )
    Console(width=120).print(table)


def run_bench(cfg: BenchConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Run every benchmark and return the JSON document (also written to <out>)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(cfg, say)
    shutil.rmtree(bench.runs, ignore_errors=True)
    bench.runs.mkdir(parents=True)
    t0 = time.time()
    load0 = os.getloadavg()
    # First: it also loads (on a cold cache: compiles) every task's kernels for what follows.
    bench.rollout()
    bench.training_pairs()
    bench.mjlab_pairs()
    target: dict[str, Any] = {}
    if cfg.target:
        target, target_failures = run_target(cfg, bench.env, bench.runs, say)
        bench.failures.extend(target_failures)
        write_target_png(cfg.out / "time_to_target.png", target)
    bench.details["time_to_target"] = target
    gpu = run_gpu(bench)  # where CUDA is available; else the reason it was skipped
    if cfg.cold_compile and not cfg.quick:
        bench.compilations()
    healing: dict[str, Any] = {"skipped": "--no-healing"}
    if cfg.healing:
        healing, healing_failures = run_healing(cfg, bench.env, bench.runs, say)
        bench.failures.extend(healing_failures)
    bench.details["healing"] = healing
    # Checkpoints with every rank's environments: Rough G1 at several sizes.
    envstate, envstate_failures = run_envstate(cfg, say, bench.runs)
    bench.failures.extend(envstate_failures)
    bench.details["envstate"] = envstate
    # The run directory's writer lock with many contenders (no training).
    lock, lock_failures = run_lock(cfg, say, bench.runs)
    bench.failures.extend(lock_failures)
    bench.details["lock"] = lock
    figures = {
        f.key: f.summary()
        for f in [
            *bench.figures(),
            *target_figures(target),
            *gpu_figures(cfg, gpu),
            *(healing_figures(healing) if cfg.healing else []),
            *lock_figures(lock),
            *envstate_figures(envstate),
        ]
    }
    machine = machine_info()
    machine["gpu"] = gpu.get("device", {}).get("name")
    doc = {
        "schema": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks " + " ".join(_argv_of(cfg)),
        "quick": cfg.quick,
        "config": {
            **asdict(cfg),
            "out": str(cfg.out),
            "repeats": cfg.pairs,
            "num_envs": cfg.envs,
            "iterations": cfg.measured,
        },
        "machine": machine,
        "duration_s": round(time.time() - t0, 1),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "figures": figures,
        "details": bench.details,
        "failures": bench.failures,
        "gpu": {
            "measured": "skipped" not in gpu,
            "device": machine["gpu"],
            "skipped": gpu.get("skipped"),
        },
    }
    (cfg.out / "bench.json").write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    write_png(cfg.out / "bench.png", list(figures.values()))
    return doc


def _json_default(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _argv_of(cfg: BenchConfig) -> list[str]:
    argv = ["--quick"] if cfg.quick else []
    if cfg.out != Path("bench-results"):
        argv += ["--out", str(cfg.out)]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run `python -m benchmarks` (`make bench`); 0 unless a benchmark could not run.

    A missed target is a finding, not an error.
    """
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)
    return run(cfg)


def run(cfg: BenchConfig) -> int:
    """Run the benchmarks of `cfg`, print the table; the exit code."""

    def say(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    doc = run_bench(cfg, say)
    for failure in doc["failures"]:
        say(f"FAILED: {failure}")
    say(f"wrote {cfg.out / 'bench.json'} and {cfg.out / 'bench.png'} in {doc['duration_s']} s")
    print_table(list(doc["figures"].values()), cfg.out)
    if doc["details"]["time_to_target"]:
        print_target_table(doc["details"]["time_to_target"])
        say(f"time-to-target curves: {cfg.out / 'time_to_target.png'}")
    if doc["gpu"]["skipped"]:
        say(f"GPU figures: skipped: {doc['gpu']['skipped']}")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make gpu-check`: the GPU tests and the GPU figures, on one GPU, within a time budget.

In order: both sides of the mjlab comparison start from empty Warp kernel caches at once (the
cold start-up figure; the kernels every later step needs are compiled then), the GPU tests
(`pytest -m gpu tests/gpu`, in parallel, on those warm caches), then the rest of the GPU
section of the benchmark (rollout overhead, one warm pair, a rank's state saved and restored).
It ends with a table of the figures and what was skipped and why; gpu-check.json holds all.
Exit 1 when a test failed or a figure could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.gpu import GPU_FIGURES, gpu_figures, run_gpu
from benchmarks.session import Bench
from benchmarks.watch import bench_env

__all__ = ["main"]

# Seconds kept for what follows the tests (rollout, one warm pair, the rank state).
_AFTER_TESTS_S = 150


def _pytest(record: dict[str, Any], out: Path, timeout_s: float, workers: int) -> dict[str, Any]:
    """The GPU tests on the warm kernel cache of our side; their counts and skip reasons."""
    measured = out / "measured.txt"
    measured.unlink(missing_ok=True)
    extra = {
        "MJLAB_HPC_REQUIRE_GPU": "1",
        "PYTHONUNBUFFERED": "1",
        "MJLAB_HPC_GPU_REPORT": str(measured.resolve()),
    }
    if cache := record.get("caches", {}).get("ours"):
        extra["WARP_CACHE_PATH"] = cache
    log = out / "pytest.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/gpu",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        "--dist",
        "load",
        "-rsfE",
        "--timeout",
        str(int(timeout_s)),
        "--junitxml",
        str(out / "junit.xml"),
    ]
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd,
                env=bench_env(extra, gpus=True),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout_s + 30,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    return {
        "exit": code,
        "seconds": round(time.monotonic() - t0, 1),
        "counts": counts,
        "skipped": re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.MULTILINE),
        "failed": re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.MULTILINE),
        "measured": measured.read_text().splitlines() if measured.exists() else [],
        "log": str(log),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check-results"))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="seconds for everything; the tests get what the figures leave",
    )
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument(
        "--iterations",
        type=int,
        default=6,
        help="measured iterations of each warm run after the first",
    )
    parser.add_argument("--pairs", type=int, default=1, help="warm pairs (make bench: 3)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    shutil.rmtree(args.out / "runs", ignore_errors=True)  # an earlier check's runs
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(out=args.out, iterations=args.iterations, gpu_repeats=args.pairs)
    bench = Bench(cfg, say=lambda line: print(line, flush=True))
    tests: dict[str, Any] = {}

    def after_cold(record: dict[str, Any]) -> None:
        left = args.budget_s - (time.monotonic() - t0) - _AFTER_TESTS_S
        print(
            f"GPU tests: pytest -m gpu tests/gpu on {args.workers} workers, {left:.0f} s",
            flush=True,
        )
        tests.update(_pytest(record, args.out, max(left, 60.0), args.workers))

    record = run_gpu(bench, after_cold=after_cold)
    figures = {f.key: f.summary() for f in gpu_figures(cfg, record)}
    elapsed = time.monotonic() - t0
    (args.out / "gpu-check.json").write_text(
        json.dumps(
            {
                "seconds": round(elapsed, 1),
                "record": record,
                "tests": tests,
                "figures": figures,
                "failures": bench.failures,
            },
            indent=1,
            default=str,
        )
    )
    return _report(record, tests, figures, bench.failures, elapsed)


def _report(
    record: dict[str, Any],
    tests: dict[str, Any],
    figures: dict[str, dict[str, Any]],
    failures: list[str],
    elapsed: float,
) -> int:
    print(f"\n== make gpu-check: {record.get('device', {}).get('name', 'no GPU')}, {elapsed:.0f} s")
    if "skipped" in record:
        print(f"skipped everything: {record['skipped']}")
        return 1
    counts = tests.get("counts", {})
    print(
        "tests: "
        + ", ".join(f"{n} {k}" for k, n in counts.items())
        + f" in {tests.get('seconds')} s"
    )
    for line in tests.get("measured", []):
        print(f"  measured: {line}")
    for line in tests.get("failed", []):
        print(f"  FAILED {line}")
    for line in tests.get("skipped", []):
        print(f"  skipped: {line}")
    print("figures (median of the samples; target):")
    for key in GPU_FIGURES:
        f = figures.get(key)
        if f is None or f.get("median") is None:
            print(f"  {key}: not measured" + ("" if key in figures else " (its part was skipped)"))
            continue
        target = ""
        if f["target"] is not None:
            verdict = "met" if f["met"] else "MISSED"
            target = f" (target {f['direction']} {f['target']}: {verdict})"
        print(f"  {f['label']}: {f['median']:.3g} over {f['n']} sample(s){target}")
    for failure in failures:
        print(f"  failed: {failure.splitlines()[0]}")
    bad = counts.get("failed", 0) or counts.get("error", 0) or tests.get("exit") not in (0, 5)
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench-kernels` / `python -m benchmarks.kernel_cache`: a new node's first iteration.

Three 1-node cartpole jobs on the Slurm cluster this shell talks to (`make bench-kernels`
brings up a test cluster of 3 nodes), one after the other, each on a node of its own and with
a home of its own (as nodes whose homes are not shared): `cold` with the default
`--kernel-cache auto` and a new log root compiles every kernel; `warm` runs on another node
with the same log root and loads what `cold` compiled; `node` runs on the third node with
`--kernel-cache node` (Warp's per-node cache in the home, as before), which compiles again.
Each figure is the seconds from the job's start (sacct's Start) to its first iteration
(progress.jsonl). Prints a table and writes `<out>/kernel_cache.json`; exit 1 when a job
failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import read_jsonl
from benchmarks.watch import bench_env, cli
from mjlab_hpc.rundir.layout import KERNEL_CACHE_DIR, RunDir
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.slurm.client import SlurmClient

__all__ = ["main", "run_job"]

TRAIN = ["cartpole", "--num-envs", "64", "--torch-threads", "1", "--max-iterations", "3"]
JOB = ["--nodes", "1", "--tasks-per-node", "1", "--gpus-per-node", "0", "--time", "10"]
#: (name, node, --kernel-cache)
JOBS = (("cold", "node1", "auto"), ("warm", "node2", "auto"), ("node", "node3", "node"))


def run_job(name: str, node: str, cache: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Submit one job on `node` with a fresh home and return its start-to-first-iteration."""
    home = work / f"home-{name}"
    home.mkdir(parents=True)
    env = {**env, "HOME": str(home)}
    cmd = [
        cli("mjlab-submit"),
        *TRAIN,
        *JOB,
        "--log-root",
        str(work / "logs"),
        "--kernel-cache",
        cache,
        "--run-name",
        name,
        "--sbatch-arg",
        f"nodelist={node}",
        "--follow",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    runs = list((work / "logs" / "cartpole").glob(f"*_{name}"))
    if proc.returncode != 0 or len(runs) != 1:
        raise RuntimeError(f"{name}: mjlab-submit exited {proc.returncode}: {proc.stderr[-800:]}")
    first = read_jsonl(RunDir(runs[0]).progress)[:1]
    job = (read_record(runs[0]).job_ids or ("",))[0]
    started = SlurmClient(env=env).run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "Start"])
    if not first or started is None or not started.stdout.strip():
        raise RuntimeError(f"{name}: job {job} left no first iteration in {runs[0]}")
    start = dt.datetime.fromisoformat(started.stdout.split()[0]).timestamp()
    compiled_home = sum(1 for _ in home.rglob("wp_*"))
    return {
        "job": name,
        "node": node,
        "kernel_cache": cache,
        "start_to_first_iteration_s": round(float(first[0]["time"]) - start, 1),
        "modules_compiled_into_home": compiled_home,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three jobs and print the cold / warm ratio."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_cache")
    parser.add_argument("--out", default="bench-results", help="where kernel_cache.json goes")
    parser.add_argument("--work", default=None, help="run folder (default: <out>/kernels)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    work = Path(args.work or out / "kernels") / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    # Warp's own variable would override the default under test; SLURM_CONF names the cluster.
    env = {k: v for k, v in bench_env().items() if k not in ("WARP_CACHE_PATH", "XDG_CACHE_HOME")}
    env["SLURM_CONF"] = os.environ.get("SLURM_CONF", "")
    rows = []
    try:
        for name, node, cache in JOBS:
            print(f"[kernels] {name}: {node}, --kernel-cache {cache} ...", flush=True)
            rows.append(run_job(name, node, cache, work, env))
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        print(f"[kernels] failed: {exc}", file=sys.stderr)
        return 1
    figures = {r["job"]: r["start_to_first_iteration_s"] for r in rows}
    ratio = round(figures["cold"] / figures["warm"], 2) if figures["warm"] else None
    cache = next((work / "logs" / KERNEL_CACHE_DIR).glob("*/*"), None)
    modules = sum(1 for p in cache.iterdir() if p.name.startswith("wp_")) if cache else 0
    result = {"jobs": rows, "cold_over_warm": ratio, "modules_in_cache": modules}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_cache.json").write_text(json.dumps(result, indent=1))
    print(f"{'job':<6} {'node':<6} {'--kernel-cache':<15} {'start -> 1st iteration':>24}")
    for r in rows:
        s = r["start_to_first_iteration_s"]
        print(f"{r['job']:<6} {r['node']:<6} {r['kernel_cache']:<15} {s:>22.1f} s")
    print(f"cold / warm: {ratio}; {modules} modules in the cache under the log root")
    print(f"[kernels] {out / 'kernel_cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench-kernels` / `python -m benchmarks.kernel_cache`: a new log root's first iteration.

Three 1-node cartpole jobs on the Slurm cluster this shell talks to (`make bench-kernels`
brings up a test cluster of 3 nodes), one after the other, each on a node of its own and in a
new log root, with the default `--kernel-cache auto`: `cold` compiles every kernel into a new
home's cache; `warm` runs on another node with the same home (as where homes are shared) and
loads them; `site` runs on the third node with a new home of its own (homes not shared) and
the first home's kernel folder named as a site's shared one (--kernel-cache), and loads them
too. Each figure is the seconds from the job's start (sacct's Start) to its first iteration
(progress.jsonl); cold / warm is the ratio. Prints a table and writes
`<out>/kernel_cache.json`; exit 1 when a job failed.
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
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.slurm.client import SlurmClient

__all__ = ["main", "run_job"]

TRAIN = ["cartpole", "--num-envs", "64", "--torch-threads", "1", "--max-iterations", "3"]
JOB = ["--nodes", "1", "--tasks-per-node", "1", "--gpus-per-node", "0", "--time", "10"]
#: (name, node, home, --kernel-cache); `site` names the first home's folder as a site's.
JOBS = (
    ("cold", "node1", "home-a", "auto"),
    ("warm", "node2", "home-a", "auto"),
    ("site", "node3", "home-b", "home-a/.cache/mjlab-hpc/kernels"),
)


def _modules(work: Path) -> set[Path]:
    """Every compiled module under `work` (Warp's folders `wp_<module>_<hash>`)."""
    return {p for p in work.rglob("wp_*") if p.is_dir()}


def run_job(
    name: str, node: str, home: Path, cache: str, work: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Submit one job on `node` with `home` and a new log root; return its start to first
    iteration and how many modules it compiled (into any cache under `work`)."""
    home.mkdir(parents=True, exist_ok=True)
    before = _modules(work)
    env = {**env, "HOME": str(home)}
    logs = work / f"logs-{name}"
    cmd = [
        cli("mjlab-submit"),
        *TRAIN,
        *JOB,
        "--log-root",
        str(logs),
        "--kernel-cache",
        cache,
        "--run-name",
        name,
        "--sbatch-arg",
        f"nodelist={node}",
        "--follow",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    runs = list((logs / "cartpole").glob(f"*_{name}"))
    if proc.returncode != 0 or len(runs) != 1:
        raise RuntimeError(f"{name}: mjlab-submit exited {proc.returncode}: {proc.stderr[-800:]}")
    first = read_jsonl(RunDir(runs[0]).progress)[:1]
    job = (read_record(runs[0]).job_ids or ("",))[0]
    started = SlurmClient(env=env).run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "Start"])
    if not first or started is None or not started.stdout.strip():
        raise RuntimeError(f"{name}: job {job} left no first iteration in {runs[0]}")
    start = dt.datetime.fromisoformat(started.stdout.split()[0]).timestamp()
    return {
        "job": name,
        "node": node,
        "home": home.name,
        "kernel_cache": cache,
        "start_to_first_iteration_s": round(float(first[0]["time"]) - start, 1),
        "modules_compiled": len(_modules(work) - before),
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
        for name, node, home, cache in JOBS:
            folder = str(work / cache) if cache != "auto" else cache
            print(f"[kernels] {name}: {node}, {home}, --kernel-cache {folder} ...", flush=True)
            rows.append(run_job(name, node, work / home, folder, work, env))
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        print(f"[kernels] failed: {exc}", file=sys.stderr)
        return 1
    figures = {r["job"]: r["start_to_first_iteration_s"] for r in rows}
    ratio = round(figures["cold"] / figures["warm"], 2) if figures["warm"] else None
    cache = next((work / JOBS[2][3]).glob("*/*"), None)
    modules = sum(1 for p in cache.iterdir() if p.name.startswith("wp_")) if cache else 0
    result = {"jobs": rows, "cold_over_warm": ratio, "modules_in_cache": modules}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_cache.json").write_text(json.dumps(result, indent=1))
    print(f"{'job':<6} {'node':<6} {'home':<7} {'compiled':>8} {'start -> 1st iteration':>24}")
    for r in rows:
        s = r["start_to_first_iteration_s"]
        compiled = r["modules_compiled"]
        print(f"{r['job']:<6} {r['node']:<6} {r['home']:<7} {compiled:>8} {s:>22.1f} s")
    print(f"cold / warm: {ratio}; {modules} modules in the first home's cache")
    print(f"[kernels] {out / 'kernel_cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

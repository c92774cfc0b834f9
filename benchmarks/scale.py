"""`make scale` / `python -m benchmarks.scale`: what grows with the world size.

It runs one tiny training job per world size through the real `mjlab-submit` path, CPU ranks
spread over at most `--max-nodes` nodes. The Slurm cluster is the one this shell talks to
(`SLURM_CONF`; `make scale` brings up one of 8 nodes). Per world size it reads:

- submit -> first iteration: `mjlab-submit` started to the first line of progress.jsonl;
- rendezvous: from the last rank's call to join the process group to every rank joined, and
  how far apart the ranks' calls were (each rank logs `process group of N ranks: called at T,
  joined in S s`);
- collectives per iteration and their time (rank 0's progress.jsonl: `collectives`,
  `collective_s`, waiting for the slowest rank included);
- checkpoint size, the ranks' state writes and the publication (the writer logs
  `checkpoint model_<n>.pt: B bytes, ranks' states written in G s, published in W s`);
- peak RSS of every rank (`VmHWM` of the rank processes, polled while they run);
- that the ranks ended bit-identical (summary.json's parameter digests of every rank).

It prints a table and writes `<out>/scale.json` (sizes run again replace their entries, so
the sizes can be measured in several calls). Exit code 1 when a job failed or ranks diverged.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import read_jsonl
from benchmarks.watch import bench_env, cli, find_run_dir, kill_job, rank_pids
from mjlab_hpc.rundir.layout import PROGRESS, SUBMITIT_DIR

__all__ = ["layout", "main", "measure_size", "peak_rss_mib", "print_table", "rank_log_figures"]

SIZES = (1, 2, 4, 8, 16, 32)
_JOINED = re.compile(r"process group of (\d+) ranks: called at ([\d.]+), joined in ([\d.]+) s")
_CHECKPOINT = re.compile(
    r"checkpoint (model_\d+\.pt): (-?\d+) bytes, ranks' states written in ([\d.]+) s, "
    r"published in ([\d.]+) s"
)
# A rank of this job is taken to need this much private memory until one was measured.
_RSS_GUESS_MIB = 450.0


def layout(world: int, max_nodes: int) -> tuple[int, int]:
    """Return (nodes, tasks per node) for `world` ranks on at most `max_nodes` nodes.

    It takes as many nodes as possible, with the same number of ranks on each.
    """
    nodes = max(n for n in range(1, min(world, max_nodes) + 1) if world % n == 0)
    return nodes, world // nodes


def peak_rss_mib(pid: int) -> tuple[float, float] | None:
    """Return the peak resident memory (VmHWM) of a live process and its private part now, in MiB.

    The private part (RssAnon) is memory no other rank shares, unlike the pages of torch's
    libraries.
    """
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    hwm = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    anon = re.search(r"^RssAnon:\s+(\d+) kB", text, re.MULTILINE)
    if not hwm or not anon:
        return None
    return int(hwm.group(1)) / 1024, int(anon.group(1)) / 1024


def _python_only(pids: Sequence[int]) -> list[int]:
    """The rank processes among `pids`: srun's command line names submitit's module too."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if "python" in Path(argv0.decode(errors="replace")).name:
                out.append(pid)
    return out


def available_mib() -> float:
    """MemAvailable of this machine, in MiB."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(m.group(1)) / 1024 if m else 0.0


def rank_log_figures(run: Path, world: int) -> dict[str, Any]:
    """Rendezvous and checkpoint figures from the ranks' logs."""
    calls: list[float] = []
    joins: list[float] = []
    checkpoints: list[dict[str, Any]] = []
    for k in range(world):
        path = run / "logs" / f"rank{k}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        m = _JOINED.search(text)
        if m:
            calls.append(float(m.group(2)))
            joins.append(float(m.group(2)) + float(m.group(3)))
        if k == 0:
            checkpoints = [
                {"file": c[0], "bytes": int(c[1]), "gather_s": float(c[2]), "write_s": float(c[3])}
                for c in _CHECKPOINT.findall(text)
            ]
    out: dict[str, Any] = {"checkpoints": checkpoints}
    if len(calls) == world and world > 1:
        out["rendezvous_s"] = max(joins) - max(calls)
        out["arrival_spread_s"] = max(calls) - min(calls)
        out["first_call_at"] = min(calls)
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure_size(
    world: int, max_nodes: int, out: Path, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """Run one job of `world` ranks through mjlab-submit --follow and read its figures."""
    nodes, per_node = layout(world, max_nodes)
    log_root = out / "scale-runs" / f"world{world}"
    if log_root.exists():
        shutil.rmtree(log_root)
    log_root.mkdir(parents=True)
    cmd = [
        cli("mjlab-submit"),
        "cartpole",
        "--executor",
        "slurm",
        "--nodes",
        str(nodes),
        "--tasks-per-node",
        str(per_node),
        "--gpus-per-node",
        "0",
        "--num-envs",
        str(args.num_envs),
        "--max-iterations",
        str(args.iterations),
        "--save-interval",
        str(args.save_interval),
        "--torch-threads",
        "1",
        "--dist-timeout-s",
        "900",
        "--hang-timeout-s",
        "600",
        "--time",
        "30",
        "--log-root",
        str(log_root),
        "--follow",
        *(["--partition", args.partition] if args.partition else []),
    ]
    peaks: dict[int, float] = {}
    private: dict[int, float] = {}
    submitted = time.time()
    with open(log_root / "submit.out", "w") as output:
        proc = subprocess.Popen(
            cmd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + args.timeout_s
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks: no end within {args.timeout_s:.0f} s")
                run = find_run_dir(log_root)
                if run is not None:
                    for pid in _python_only(rank_pids(run / SUBMITIT_DIR)):
                        rss = peak_rss_mib(pid)
                        if rss is not None:
                            peaks[pid] = max(peaks.get(pid, 0.0), rss[0])
                            private[pid] = max(private.get(pid, 0.0), rss[1])
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                # The job outlives its follower: cancel it (no requeue, no process left).
                run = find_run_dir(log_root)
                if run is not None:
                    subprocess.run(
                        [cli("mjlab-hpc"), "cancel", str(run)],
                        env=env,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        timeout=120,
                        check=False,
                    )
                kill_job(proc)
    run = find_run_dir(log_root)
    result: dict[str, Any] = {
        "world_size": world,
        "nodes": nodes,
        "tasks_per_node": per_node,
        "returncode": proc.returncode,
        "run_dir": str(run) if run else None,
    }
    if run is None:
        return result
    records = read_jsonl(run / PROGRESS)
    measured = [r for r in records if int(r["iteration"]) >= 2]
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    digests = summary.get("param_digest_per_rank") or []
    logs = rank_log_figures(run, world)
    ckpts = logs.pop("checkpoints")
    iteration_s = [float(r["collect_s"]) + float(r["learn_s"]) for r in measured]
    result.update(
        {
            "iterations": len(records),
            "submit_to_first_iteration_s": (
                float(records[0]["time"]) - submitted if records else None
            ),
            "submit_to_process_group_s": (
                logs["first_call_at"] - submitted if "first_call_at" in logs else None
            ),
            "rendezvous_s": logs.get("rendezvous_s"),
            "arrival_spread_s": logs.get("arrival_spread_s"),
            "iteration_s": _median(iteration_s),
            "collectives_per_iteration": sorted({int(r["collectives"]) for r in measured}),
            "collective_s": _median([float(r["collective_s"]) for r in measured]),
            "collective_share": _median(
                [
                    float(r["collective_s"]) / s
                    for r, s in zip(measured, iteration_s, strict=True)
                    if s > 0
                ]
            ),
            "checkpoint_bytes": ckpts[-1]["bytes"] if ckpts else None,
            "checkpoint_gather_s": _median([c["gather_s"] for c in ckpts]),
            "checkpoint_write_s": _median([c["write_s"] for c in ckpts]),
            "checkpoints": ckpts,
            "peak_rss_mib": {
                "median": _median(list(peaks.values())),
                "max": max(peaks.values(), default=None),
                "ranks_seen": len(peaks),
                "private_max": max(private.values(), default=None),
            },
            "distinct_param_digests": len(set(digests)),
            "ranks_in_sync": bool(digests) and len(digests) == world and len(set(digests)) == 1,
        }
    )
    return result


@contextlib.contextmanager
def _held(lock: str | None) -> Iterator[None]:
    """An exclusive flock on `lock` (a machine shared with other measurements), if named."""
    if not lock:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fmt(value: Any, spec: str) -> str:
    return format("-", f">{spec.split('.')[0]}") if value is None else format(value, spec)


def print_table(results: Sequence[dict[str, Any]]) -> None:
    """One line per world size."""
    head = (
        f"{'ranks':>5} {'nodes':>5} {'first it s':>10} {'rdv s':>6} {'spread s':>8} "
        f"{'iter s':>7} {'coll/it':>7} {'coll s':>7} {'share':>6} {'ckpt KB':>8} "
        f"{'gather s':>8} {'write s':>7} {'RSS MiB':>8} {'private':>7} "
        f"{'in sync':>7}"
    )
    print(head)
    for r in sorted(results, key=lambda r: r["world_size"]):
        if "skipped" in r:
            print(f"{r['world_size']:>5} skipped: {r['skipped']}")
            continue
        ckpt = r.get("checkpoint_bytes")
        print(
            f"{r['world_size']:>5} {r['nodes']:>5} "
            f"{_fmt(r.get('submit_to_first_iteration_s'), '10.1f')} "
            f"{_fmt(r.get('rendezvous_s'), '6.3f')} {_fmt(r.get('arrival_spread_s'), '8.2f')} "
            f"{_fmt(r.get('iteration_s'), '7.3f')} "
            f"{','.join(map(str, r.get('collectives_per_iteration') or [])) or '-':>7} "
            f"{_fmt(r.get('collective_s'), '7.3f')} {_fmt(r.get('collective_share'), '6.2f')} "
            f"{_fmt(ckpt / 1024 if ckpt else None, '8.1f')} "
            f"{_fmt(r.get('checkpoint_gather_s'), '8.3f')} "
            f"{_fmt(r.get('checkpoint_write_s'), '7.3f')} "
            f"{_fmt((r.get('peak_rss_mib') or {}).get('max'), '8.0f')} "
            f"{_fmt((r.get('peak_rss_mib') or {}).get('private_max'), '7.0f')} "
            f"{r.get('ranks_in_sync', '-')!s:>7}"
        )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    p.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help="world sizes, comma-separated (default %(default)s)",
    )
    p.add_argument("--max-nodes", type=int, default=8, help="nodes at most (default 8)")
    p.add_argument("--num-envs", type=int, default=16, help="envs per rank (default 16)")
    p.add_argument("--iterations", type=int, default=8, help="PPO iterations (default 8)")
    p.add_argument("--save-interval", type=int, default=4, help="checkpoint every N (default 4)")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the default)")
    p.add_argument("--out", default="bench-results", help="folder of scale.json")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per job (default 900)")
    p.add_argument(
        "--lock", default=None, help="an exclusive flock held during each job (shared machines)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point; 0 when every job completed with its ranks bit-identical."""
    args = _parse(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        print(f"--sizes {args.sizes}: comma-separated integers, e.g. 1,2,4", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.max_nodes < 1:
        print("--sizes and --max-nodes: positive integers", file=sys.stderr)
        return 2
    try:
        answers = (
            shutil.which("sinfo") is not None
            and subprocess.run(
                ["sinfo", "-h"], capture_output=True, timeout=30, check=False
            ).returncode
            == 0
        )
    except subprocess.TimeoutExpired:
        answers = False
    if not answers:
        print(
            "no Slurm cluster answers here (sinfo -h failed): run `make scale`, which starts "
            "a test cluster, or run this on a cluster's login node (SLURM_CONF set)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scale.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    by_size = {int(r["world_size"]): r for r in previous.get("results", [])}
    # SLURM_CONF is kept: bench_env drops the launcher's SLURM_* variables.
    env = bench_env({k: v for k, v in os.environ.items() if k == "SLURM_CONF"})
    ok = True
    for world in sizes:
        seen = [
            r["peak_rss_mib"]["private_max"]
            for r in by_size.values()
            if (r.get("peak_rss_mib") or {}).get("private_max")
        ]
        need = world * max([_RSS_GUESS_MIB, *seen]) * 1.3 + 1024
        with _held(args.lock):
            free = available_mib()
            if need > free:
                result = {"world_size": world, "skipped": f"needs ~{need:.0f} MiB, {free:.0f} free"}
            else:
                print(f"[scale] {world} rank(s) ...", flush=True)
                result = measure_size(world, max_nodes=args.max_nodes, out=out, args=args, env=env)
        by_size[world] = result
        failed = "skipped" not in result and (
            result["returncode"] != 0 or not result.get("ranks_in_sync")
        )
        ok = ok and not failed
        doc = {
            "machine": {"cpus": os.cpu_count(), "mem_available_mib": round(available_mib())},
            "settings": {k: v for k, v in vars(args).items() if k != "lock"},
            "results": [by_size[k] for k in sorted(by_size)],
        }
        path.write_text(json.dumps(doc, indent=1))
    print_table(list(by_size.values()))
    print(f"[scale] {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

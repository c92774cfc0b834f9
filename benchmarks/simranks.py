"""The ranks of a job without training, for counting what they cost the filesystem.

`simulate(world, per_node, folder)` runs `python -m benchmarks.simranks` under strace (from its
start, `--seccomp-bpf`) and counts its operations on the run directory (`benchmarks.fsops`).
That command forks `world` light processes after its imports, each a rank of the real
machinery on `world // per_node` simulated nodes (named `sim<i>`): its start and end records,
the hang watchdog with its heartbeats (`rank/watchdog.py`, the default 2 s beat), rank 0 as
the run's writer (lease lock, a progress line per iteration), and a checkpoint every
`SAVE_EVERY` iterations (each rank's state written, the writer publishing them and the model)
during which the watchdog is paused and, past a quarter of the hang limit, watches the other
ranks. Iterations only sleep, in lockstep on a shared clock (the collectives' effect). Rank 0's
process holds a TCPStore, as under torch.distributed's env:// rendezvous.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["simulate"]

ITERATION_S = 1.0
SAVE_EVERY = 15
# Longer than a quarter of the hang limit: the watchdog watches the others for a few beats.
CHECKPOINT_S = 7.0
HANG_TIMEOUT_S = 20.0
SECONDS = 45.0
# Not counted at either end: the ranks' starts (imports, records) and ends.
_MARGIN_S = 3.0


def simulate(world: int, per_node: int, out: Path, seconds: float = SECONDS) -> dict[str, Any]:
    """Count the operations on the run directory of `world` simulated ranks (its trace kept
    in `out`), per second."""
    from benchmarks.fsops import strace_command

    folder = out / f"world{world}-per{per_node}"
    with contextlib.suppress(FileNotFoundError):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    run = folder / "run"
    (run / "logs").mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.simranks", str(run), str(world), str(per_node)]
    cmd += ["--seconds", str(seconds), "--roles", str(folder / "roles.json")]
    subprocess.run([*strace_command(folder / "strace.txt", follow_start=True), *cmd], check=False)
    return counted(folder, world, per_node)


def counted(folder: Path, world: int, per_node: int) -> dict[str, Any]:
    """The counts of a simulation kept in `folder` (its trace, roles and window)."""
    from benchmarks.fsops import count, parse_trace

    done = json.loads((folder / "roles.json").read_text())
    roles = {int(pid): role for pid, role in done["roles"].items()}
    with open(folder / "strace.txt", errors="replace") as lines:
        items = parse_trace(lines, done.get("run") or str((folder / "run").resolve()))
        counts = count(items, roles, {}, tuple(done["window"]))
    result = {"ranks": world, "nodes": -(-world // per_node), "per_node": per_node, "launch": "sim"}
    if done["failed"]:
        result["failed"] = f"{done['failed']} rank(s) failed; counted until the first ended"
    return {**result, **counts.as_dict()}


def _role(rank: int, per_node: int) -> str:
    return "rank 0" if rank == 0 else "first of a node" if rank % per_node == 0 else "ranks"


def _store(rank: int, port: int) -> Any:
    """Rank 0 holds the job's TCPStore (as env:// makes it); None for the others."""
    if rank != 0:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def _watchdog(
    run: Any, rank: int, world: int, host: str, hosts: list[str], log: Any, port: int
) -> Any:
    import inspect

    from mjlab_hpc.rank.watchdog import Watchdog

    where: dict[str, Any] = {}
    if "store" in inspect.signature(Watchdog).parameters:  # (older ones: one file per rank)
        from mjlab_hpc.rank.beats import StoreAddress

        where = {"hosts": hosts, "store": StoreAddress("127.0.0.1", port, "mjlab-hpc/sim/0")}
    return Watchdog(
        run,
        rank=rank,
        world_size=world,
        timeout_s=HANG_TIMEOUT_S,
        rank_log=log,
        host=host,
        **where,
    )


def _rank(
    rank: int,
    world: int,
    per_node: int,
    run_dir: str,
    t0: float,
    iterations: int,
    port: int,
    states: Any,
    done: Any,
    last: Any,
) -> None:
    """One simulated rank, from its start record to its end record."""
    from mjlab_hpc.rundir.checkpoint import publish_rank_states, write_rank_state
    from mjlab_hpc.rundir.ends import RankExit, RankStart, record_end, record_start
    from mjlab_hpc.rundir.layout import RunDir
    from mjlab_hpc.rundir.writer import RunWriter

    run = RunDir(Path(run_dir))
    hosts = [f"sim{r // per_node:03d}" for r in range(world)]
    store = _store(rank, port)
    start = record_start(
        run, RankStart(run.path.name, rank, world, hosts[rank], os.getpid(), "cpu", time.time())
    )
    writer = RunWriter.acquire(run, rank=0) if rank == 0 else None
    with (
        open(run.rank_log(rank), "a") as log,
        _watchdog(run, rank, world, hosts[rank], hosts, log, port) as dog,
    ):
        for it in range(1, iterations + 1):
            due = t0 + it * ITERATION_S
            time.sleep(max(0.0, due - time.time()))
            dog.progress(it)
            if writer is not None:
                writer.append_line(run.progress, json.dumps({"iteration": it, "time": time.time()}))
            if it % SAVE_EVERY:
                continue
            with dog.paused():
                checkpoint = run.checkpoint(it)
                written = write_rank_state(checkpoint, rank, world, {"it": it}, {"iteration": it})
                states.put((rank, written))
                if writer is not None:
                    got = dict(states.get(timeout=600) for _ in range(world))
                    publish_rank_states(checkpoint, [got[r] for r in range(world)], writer.check)
                    writer.save_checkpoint(checkpoint, {"it": it})
                done.wait(timeout=600)  # every rank waits for the writer (a collective)
                time.sleep(max(0.0, due + CHECKPOINT_S - time.time()))
            t0 = time.time() - it * ITERATION_S
        last[rank] = time.time()
        dog.disarm()
    record_end(run, start, RankExit(how="completed", detail="simulated", at=time.time()))
    if writer is not None:
        writer.release()
    del store


def main(argv: list[str] | None = None) -> int:
    """Fork the ranks, wait for them, and write their roles and the counted window."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.simranks")
    p.add_argument("run_dir")
    p.add_argument("world", type=int)
    p.add_argument("per_node", type=int)
    p.add_argument("--seconds", type=float, default=SECONDS)
    p.add_argument("--roles", required=True)
    args = p.parse_args(argv)
    import torch  # (imported once, before the fork: the ranks share its pages)
    import torch.distributed  # noqa: F401

    import mjlab_hpc.rank.watchdog
    import mjlab_hpc.rundir.writer  # noqa: F401

    ctx = multiprocessing.get_context("fork")
    states, done = ctx.Queue(), ctx.Barrier(args.world)
    t0 = time.time() + 2.0 + 0.02 * args.world  # every rank forked and started by then
    iterations = round(args.seconds / ITERATION_S)
    last = ctx.Array("d", args.world)  # when each rank's last iteration ended
    port = 20000 + os.getpid() % 20000
    procs = {}
    for rank in range(args.world):
        proc = ctx.Process(
            target=_rank,
            args=(
                rank,
                args.world,
                args.per_node,
                args.run_dir,
                t0,
                iterations,
                port,
                states,
                done,
                last,
            ),
        )
        proc.start()
        procs[proc.pid] = (rank, proc)
    sentinels = {proc.sentinel: proc for _, proc in procs.values()}
    multiprocessing.connection.wait(list(sentinels))
    first_end = time.time()  # (a rank that fails ends before the others)
    failed = 0
    for _, proc in procs.values():
        proc.join()
        failed += proc.exitcode != 0
    roles = {pid: _role(rank, args.per_node) for pid, (rank, _) in procs.items()}
    # Up to the ranks' last iterations, or to the first rank's end when one failed.
    window = (t0 + _MARGIN_S, (first_end if failed else min(last)) - 0.5)
    run = str(Path(args.run_dir).resolve())  # (as the trace names it, wherever it is moved)
    done = {"run": run, "roles": roles, "window": window, "failed": failed}
    Path(args.roles).write_text(json.dumps(done))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Binding CPU ranks to their own cores (`MJLAB_HPC_PIN_CPUS=1`): in a real child process with
real threads, only inside the CPUs the process may use, and only when asked and safe."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any

import pytest

from mjlab_hpc.rank.workload import PIN_CPUS_ENV, pin_cpus


def child(rank: int, world: int, env: dict[str, str], cpus: set[int] | None, out: Any) -> None:
    """Start a thread, pin as local rank `rank` of `world`, start another thread, and send
    what pin_cpus returned and every thread's CPUs."""
    if cpus is not None:  # as a cgroup or taskset would restrict the job
        os.sched_setaffinity(0, cpus)
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    got = pin_cpus(rank, world, env)
    threading.Thread(target=stop.wait, daemon=True).start()
    threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    out.send({"got": got, "threads": threads})


def run_child(rank: int, world: int, env: dict[str, str], cpus: set[int] | None = None) -> dict:
    # A forked process: a real one (its own threads and affinity) without a fresh torch import.
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(rank, world, env, cpus, send))
    proc.start()
    got = receive.recv() if receive.poll(30) else None
    proc.join(30)
    assert proc.exitcode == 0 and got is not None, proc.exitcode
    return got


ALLOWED = sorted(os.sched_getaffinity(0))
ON = {PIN_CPUS_ENV: "1"}


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 allowed CPUs")
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_gets_its_own_slice_on_every_thread(rank: int) -> None:
    per = len(ALLOWED) // 2
    mine = ALLOWED[rank * per : (rank + 1) * per]
    out = run_child(rank, 2, ON)
    assert out["got"] == mine
    assert len(out["threads"]) >= 3  # main, one thread started before, one after
    assert all(cpus == mine for cpus in out["threads"].values()), out


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 allowed CPUs")
def test_never_outside_the_allowed_set() -> None:
    only = {ALLOWED[-1]}  # as a cgroup or taskset would restrict the job
    out = run_child(0, 2, ON, cpus=only)  # 2 ranks, 1 CPU: left alone
    assert out["got"] is None
    assert all(cpus == sorted(only) for cpus in out["threads"].values())


@pytest.mark.parametrize(
    ("env", "rank", "world"),
    [
        ({}, 0, 2),  # opt-in: off unless asked
        ({PIN_CPUS_ENV: "0"}, 1, 2),
        ({**ON, "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, 0, 2),  # srun bound the task already
        (ON, 0, 1),  # a single rank has the machine to itself
        (ON, 0, len(ALLOWED) + 1),  # more ranks than CPUs: no core of its own
    ],
)
def test_left_alone(env: dict[str, str], rank: int, world: int) -> None:
    before = os.sched_getaffinity(0)
    assert pin_cpus(rank, world, env) is None
    assert os.sched_getaffinity(0) == before

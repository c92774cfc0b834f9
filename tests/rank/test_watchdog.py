"""The hang watchdog's pieces, without training.

Covers its limit, heartbeats and the diagnosis it writes, fault injection's syntax, and the
healer's decisions on recorded faults.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mjlab_hpc.launch.heal import decide, find_fault, restart_here
from mjlab_hpc.ops.status import collect
from mjlab_hpc.procs import ProcessId
from mjlab_hpc.rank.beats import NodeBoard, StoreAddress
from mjlab_hpc.rank.watchdog import FaultInjection, Watchdog, hang_limit_s, parse_faults
from mjlab_hpc.rundir.ends import (
    Exit,
    RankExit,
    RankStart,
    latest_world_size,
    rank_ends,
    record_end,
    record_start,
    run_outcome,
    start_hosts,
)
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import (
    Hang,
    NodeBeat,
    RankBeat,
    read_hang,
    read_node_beat,
    write_hang,
)


def test_hang_limit_never_below_five_slowest_iterations() -> None:
    assert hang_limit_s(timeout_s=120, slowest_iteration_s=1.0) == 120
    assert hang_limit_s(timeout_s=120, slowest_iteration_s=60.0) == 300  # slow is not hung
    assert hang_limit_s(timeout_s=5, slowest_iteration_s=0.2) == 5


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("kill@12:rank1:once", (FaultInjection("kill", 12, rank=1, once=True),)),
        ("raise@3", (FaultInjection("raise", 3, rank=0, once=False),)),
        (
            "kill@5:rank1:once, stop@10:rank1:once",
            (
                FaultInjection("kill", 5, rank=1, once=True),
                FaultInjection("stop", 10, rank=1, once=True),
            ),
        ),
        ("slow@1:rank1:once", (FaultInjection("slow", 1, rank=1, once=True),)),
        (
            "stop@10:checkpoint:once",
            (FaultInjection("stop", 10, rank=0, once=True, in_checkpoint=True),),
        ),
        ("", ()),
    ],
)
def test_fault_injection_syntax(text: str, parsed: tuple[FaultInjection, ...]) -> None:
    assert parse_faults({"MJLAB_HPC_FAULT": text}) == parsed


@pytest.mark.parametrize(
    "bad",
    ["kill", "kill@x", "boom@3", "kill@3:rank", "raise@3:twice", "slow@3:checkpoint"],
)
def test_fault_injection_refuses_typos(bad: str) -> None:
    with pytest.raises(ValueError, match="KIND@ITERATION"):
        parse_faults({"MJLAB_HPC_FAULT": bad})


def _beat_of(run: RunDir, host: str, rank: int, iteration: int, seq: int, at: float = 0) -> None:
    """Write `host`'s heartbeat as its writer would: rank `rank` (pid rank) at `iteration`,
    its count `seq`, by a clock that says `at` (0: this one's)."""
    process = ProcessId(pid=rank, started=1.0, machine="m")
    node = NodeBeat(host, rank, seq, (RankBeat(rank, host, process, iteration, seq),))
    data = json.loads(node.to_bytes())
    run.node_beat(host).write_text(json.dumps({**data, "at": at or data["at"]}))


def test_heartbeat_and_diagnosis_name_the_stalled_rank(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.heartbeats.mkdir(parents=True)
    _beat_of(run, "node2", rank=1, iteration=7, seq=4)  # and never again: frozen
    log = io.StringIO()
    with Watchdog(
        run,
        rank=0,
        world_size=2,
        timeout_s=None,
        rank_log=log,
        host="node1",
        beat_s=0.2,
        hosts=("node1", "node2"),
    ) as dog:
        dog.progress(8)
        own = read_node_beat(run, "node1")
        hang = dog._diagnose(waited=30.0, limit=20.0)
    assert own is not None and (own.writer, own.host) == (0, "node1"), own
    assert [(b.rank, b.process and b.process.pid) for b in own.ranks] == [(0, os.getpid())]
    assert hang.stalled == (1,) and hang.hosts == ("node2",) and hang.frozen_hosts == ("node2",)
    assert "rank 1 on node2 (pid 1): iteration 7" in hang.detail and "<- stalled" in hang.detail
    # One file per node in the run directory, none per rank.
    assert sorted(p.name for p in run.heartbeats.iterdir()) == [
        "node-node1.json",
        "node-node2.json",
    ]


T0 = dt.datetime(2026, 11, 23, 10, 0).timestamp()


def _started(
    run: RunDir, rank: int, size: int = 2, at: float = 0.0, host: str = "", start_id: str = ""
) -> RankStart:
    """Rank `rank` starts (of `size` ranks) `at` s after T0, on h<rank> unless `host`."""
    start = RankStart(
        run=run.path.name,
        rank=rank,
        world_size=size,
        node=host or f"h{rank}",
        pid=1,
        device="cpu",
        at=T0 + at,
        start_id=start_id or None,
    )
    return record_start(run, start)


def _ended(
    run: RunDir, start: RankStart, how: Exit, at: float, detail: str = "", peer=False
) -> None:
    end = RankExit(how=how, detail=detail or how, at=T0 + at, peer_lost=peer)
    record_end(run, start, end)


def _crash(run: RunDir) -> None:
    _ended(run, _started(run, 0), "failed", 9, "RuntimeError: Connection reset by peer", True)
    _ended(run, _started(run, 1, at=1), "failed", 5, "ValueError: reward is nan at step 1234")
    run.progress.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3)))


def test_healer_names_the_cause_and_stops_a_crash_loop(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _crash(run)
    fault = find_fault(run.path)
    assert fault is not None and (fault.reason, fault.ranks, fault.iteration) == ("crash", (1,), 3)
    assert "ValueError: reward is nan" in fault.error and fault.suspect_nodes == ()  # code
    first = decide(run.path, max_restarts=3)
    assert first.requeue and first.entry.kind == "requeue"
    run.record.write_text(json.dumps({"faults": [first.entry.to_json()]}))
    again = decide(run.path, max_restarts=3)  # same error, same iteration: a loop
    assert not again.requeue and "same failure at iteration 3" in again.why
    run.progress.write_text(json.dumps({"iteration": 4}) + "\n")  # another iteration: transient
    assert decide(run.path, max_restarts=3).requeue
    assert not decide(run.path, max_restarts=1).requeue  # 1 crash restart used already
    restart_here(first)  # a restart in the allocation counts as much as a requeue
    run.record.write_text(json.dumps({"faults": [first.entry.to_json()]}))
    assert first.entry.kind == "in-allocation" and not decide(run.path, max_restarts=1).requeue


def test_a_killed_rank_is_attributed_to_its_node(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _ended(run, _started(run, 0), "failed", 9, "RuntimeError: peer lost", peer=True)
    _started(run, 1, at=1)  # and nothing more: killed
    fault = find_fault(run.path)
    assert fault is not None and fault.suspect_nodes == ("h1",) and fault.ranks == (1,)


def test_nothing_to_heal_after_a_stop(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for rank in (0, 1):
        _ended(run, _started(run, rank), "stopped", 9, "stopped at iteration 3")
    assert decide(run.path, max_restarts=3).fault is None


def test_the_first_iteration_stands_in_until_one_is_timed(tmp_path: Path) -> None:
    """A slow regime is no hang: the first iteration (compilation included) bounds the limit
    until the second one is timed; from then on the slowest timed iteration does."""
    dog = Watchdog(RunDir(tmp_path), rank=0, world_size=1, timeout_s=10, rank_log=io.StringIO())
    dog._last -= 50  # the first iteration took 50 s
    dog.progress(1)
    assert hang_limit_s(10, dog._slowest) == pytest.approx(250, abs=1)
    dog._last -= 2
    dog.progress(2)
    assert dog._slowest == pytest.approx(2, abs=0.5)
    dog._last -= 3
    dog.progress(3)
    assert dog._slowest == pytest.approx(3, abs=0.5)
    assert hang_limit_s(10, dog._slowest) == pytest.approx(15, abs=2.5)


def test_a_start_that_never_logged_is_a_crash_of_this_start(tmp_path: Path) -> None:
    """Rank records older than the start the healer looks at are an earlier start's: their
    stop must not hide a start that died before it could record its start."""
    run = RunDir(tmp_path)
    for rank in (0, 1):
        _ended(run, _started(run, rank), "stopped", 9, "stopped at iteration 3")
    assert find_fault(run.path) is None  # as the earlier start ended
    fault = find_fault(run.path, since=time.time())
    assert fault is not None and fault.reason == "crash" and "no rank started" in fault.error


def test_a_hang_record_of_an_earlier_start_is_not_this_starts_ending(tmp_path: Path) -> None:
    """A hang.json no heal read (a stop came first) names its start: the next start's crash is
    a crash, not the old hang; one whose figures are out of range is left out, never a heal
    that fails for good."""
    run = RunDir(tmp_path)
    _crash(run)
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    old = Hang(0, 2, 30.0, 20.0, (1,), ("h1",), "stalled", at=time.time() - 600, start="7_1")
    write_hang(run, old)
    hang = find_fault(run.path, start="7_1")
    assert hang is not None and hang.reason == "hang" and hang.suspect_nodes == ()
    assert find_fault(run.path, since=time.time()).reason == "crash"  # type: ignore[union-attr]
    crash = find_fault(run.path, start="7_2")
    assert crash is not None and crash.reason == "crash"
    forged = json.loads(old.to_bytes())
    run.hang_record.write_text(json.dumps({**forged, "waited_s": 1e12, "start": ""}))
    assert find_fault(run.path).reason == "crash"  # type: ignore[union-attr]


def test_a_cancel_before_a_resume_does_not_stop_healing(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _crash(run)
    (run.path / "cancelled.json").write_text(json.dumps({"at": "2026-11-23T09:00:00+00:00"}))
    run.record.write_text(json.dumps({"starts": [{"at": "2026-11-23T09:30:00+00:00"}]}))
    assert decide(run.path, max_restarts=3).requeue  # cancelled, then resumed: heals
    (run.path / "cancelled.json").write_text(json.dumps({"at": "2026-11-23T10:30:00+00:00"}))
    assert not decide(run.path, max_restarts=3).requeue  # cancelled during this start


def test_a_slow_rank_sleeps_its_iteration_from_then_on_and_once_only_in_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunDir(tmp_path)
    run.heartbeats.mkdir(parents=True)
    slept: list[float] = []
    monkeypatch.setattr("mjlab_hpc.rank.watchdog.time.sleep", slept.append)
    once = FaultInjection("slow", 3, rank=1, once=True)
    for iteration in (2, 3, 4):
        once.fire_if_due(run, rank=1, iteration=iteration, iteration_s=0.3)
        once.fire_if_due(run, rank=0, iteration=iteration, iteration_s=0.3)  # another rank: never
    assert slept == [0.3, 0.3]  # from iteration 3 on, as long as the iteration took
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # a later start (a new srun step)
    once.fire_if_due(run, rank=1, iteration=5, iteration_s=0.3)
    every_start = FaultInjection("slow", 3, rank=1, once=False)
    every_start.fire_if_due(run, rank=1, iteration=5, iteration_s=0.01)
    assert slept == [0.3, 0.3, 0.05]  # not once: every start, at least 50 ms


def test_the_ranks_of_a_start_before_fewer_ranks_are_not_this_starts(tmp_path: Path) -> None:
    """A run that went on with fewer ranks (--min-nodes) keeps the records of the ranks that
    are gone: rank 1 hung in the 2-rank start, rank 0 completed the 1-rank start after it."""
    run = RunDir(tmp_path)
    _ended(run, _started(run, 1, at=1), "hung", 5, "hung after iteration 6")
    _ended(run, _started(run, 0, size=1, at=20), "completed", 40, "completed 12 iterations")
    ends = rank_ends(run.path)
    assert [(e.rank, e.how, e.world_size) for e in ends] == [(0, "completed", 1)]
    assert latest_world_size(ends) == 1 and run_outcome(run.path).state != "failed"
    # The job's next start on 2 ranks: rank 1 fails first.
    _ended(run, _started(run, 1, at=60), "failed", 65, "RuntimeError: x")
    assert start_hosts(run.path, 1) == ["h1", "h1"] and start_hosts(run.path, 0) == ["h0"]
    assert [(e.rank, e.how) for e in rank_ends(run.path)] == [(0, "completed"), (1, "failed")]


def test_a_frozen_rank_is_one_whose_heartbeat_stops_changing_whatever_its_clock(
    tmp_path: Path,
) -> None:
    """Rank 1's node clock is an hour behind, but its heartbeat goes on changing: alive. Rank
    2's clock is an hour ahead (its last heartbeat looks fresh by ours), but its heartbeat no
    longer changes: frozen, and its node named."""
    run = RunDir(tmp_path)
    run.heartbeats.mkdir(parents=True)
    _beat_of(run, "node3", rank=2, iteration=7, seq=9, at=time.time() + 3600)
    stop = threading.Event()

    def alive_behind() -> None:
        n = 0
        while not stop.wait(0.2):
            n += 1
            _beat_of(run, "node2", rank=1, iteration=7, seq=n, at=time.time() - 3600)

    beating = threading.Thread(target=alive_behind, daemon=True)
    beating.start()
    try:
        log = io.StringIO()
        hosts = ("node1", "node2", "node3")
        with Watchdog(
            run,
            rank=0,
            world_size=3,
            timeout_s=None,
            rank_log=log,
            beat_s=0.25,
            hosts=hosts,
            host="node1",
        ) as dog:
            dog.progress(8)
            hang = dog._diagnose(waited=30.0, limit=20.0)
    finally:
        stop.set()
        beating.join()
    assert hang.frozen == (2,) and hang.frozen_hosts == ("node3",), hang
    assert "rank 2 on node3 (pid 2): iteration 7, heartbeat unchanged" in hang.detail


def test_two_ranks_dying_at_once_are_both_named_and_a_kill_of_all_suspects_none(
    tmp_path: Path,
) -> None:
    """Ranks 1 and 2 (on h1 and h2) ended without a word while rank 0 lived on to record the
    lost peer: both are the fault, both nodes suspects. When no rank recorded its end, on
    several nodes (the whole job killed from outside), no node is suspected."""
    run = RunDir(tmp_path)
    _ended(run, _started(run, 0, size=3), "failed", 9, "RuntimeError: peer lost", peer=True)
    for rank in (1, 2):
        _started(run, rank, size=3)
    fault = find_fault(run.path)
    assert fault is not None and fault.ranks == (1, 2) and fault.suspect_nodes == ("h1", "h2")
    assert "rank 1 on h1, rank 2 on h2 ended without an exit record" in fault.error
    run.rank_end(0, 1).unlink()  # rank 0 too ended without a word
    fault = find_fault(run.path)
    assert fault is not None and fault.ranks == (0, 1, 2) and fault.suspect_nodes == ()
    assert "on 3 nodes: killed from outside the ranks" in fault.error
    for rank in (1, 2):  # their next start, all on h0: that node may be what killed them
        _started(run, rank, size=3, at=30, host="h0")
    _started(run, 0, size=3, at=30, host="h0")
    fault = find_fault(run.path)
    assert fault is not None and fault.suspect_nodes == ("h0",), fault


def test_this_srun_steps_ranks_are_found_by_its_name_not_by_clocks(tmp_path: Path) -> None:
    """The batch script names each srun step (`_MJLAB_HPC_START`); the ranks record it in
    their start records. Records of an earlier step are not this step's, whatever their
    times."""
    run = RunDir(tmp_path)
    for rank in (0, 1):
        ahead = 12 * 3600.0  # the nodes' clocks far ahead (a time past tomorrow is no record)
        start = _started(run, rank, at=ahead, start_id="42.0.1")
        _ended(run, start, "stopped", ahead + 9, "stopped at iteration 3")
    assert [e.start_id for e in rank_ends(run.path)] == ["42.0.1", "42.0.1"]
    assert find_fault(run.path, start="42.0.1") is None
    fault = find_fault(run.path, start="42.0.2")  # the next step: its ranks never logged
    assert fault is not None and "no rank started" in fault.error


def test_a_rank_frozen_in_a_checkpoint_write_is_named_within_the_limit(tmp_path: Path) -> None:
    """Rank 0 waits in a checkpoint write (paused: its own wait is no hang). Rank 1's
    heartbeat goes on changing through a long write: no hang. Then rank 1's heartbeat stops
    (frozen in the write): rank 0's watchdog names rank 1 and its node within the limit, with
    the phase, and exits 4 (in a child process: the watchdog ends its process). A 2-s limit:
    a loaded machine may hold this test's beats back a second."""
    import multiprocessing

    run = RunDir(tmp_path)
    run.heartbeats.mkdir(parents=True)

    def rank0() -> None:
        with Watchdog(
            run,
            rank=0,
            world_size=2,
            timeout_s=2.0,
            rank_log=io.StringIO(),
            host="node1",
            hosts=("node1", "node2"),
        ) as dog:
            dog.progress(9)
            dog.progress(10)
            with dog.paused():
                time.sleep(60)

    child = multiprocessing.get_context("fork").Process(target=rank0)
    t0 = time.monotonic()
    child.start()
    n = 0
    try:
        while time.monotonic() - t0 < 5.0:  # past twice the limit, beating: a long write, no hang
            n += 1
            _beat_of(run, "node2", rank=1, iteration=10, seq=n)
            time.sleep(0.1)
        assert child.is_alive() and not run.hang_record.exists()
        frozen_at = time.monotonic()  # rank 1 stops beating
        child.join(timeout=10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 4
    named_s = time.monotonic() - frozen_at
    hang = read_hang(run)
    assert hang is not None and hang.frozen == (1,) and hang.frozen_hosts == ("node2",), hang
    assert hang.during == "in the checkpoint write" and named_s < 2.0 + 1.0, named_s
    fault = find_fault(run.path)
    assert fault is not None and (fault.reason, fault.ranks, fault.suspect_nodes) == (
        "hang",
        (1,),
        ("node2",),
    )
    assert "after iteration 10, in the checkpoint write (limit 2.0 s): rank(s) 1" in fault.error


def test_every_fault_of_a_start_is_named(tmp_path: Path) -> None:
    """Rank 0 raised and rank 1 was killed by a signal 12 ms later, on another node; rank 2
    lost its peers (a consequence): the fault names ranks 0 and 1 with both nodes, rank 0's
    error first, and suspects rank 1's node only (an exception is no node's fault)."""
    run = RunDir(tmp_path)
    _ended(run, _started(run, 0, size=3), "failed", 5, "RuntimeError: injected fault")
    _started(run, 1, size=3)
    run.rank_log(1).parent.mkdir(parents=True, exist_ok=True)
    run.rank_log(1).write_text("")
    os.utime(run.rank_log(1), (T0 + 5.012, T0 + 5.012))
    _ended(run, _started(run, 2, size=3), "failed", 6, "RuntimeError: peer lost", peer=True)
    fault = find_fault(run.path)
    assert fault is not None and fault.reason == "crash", fault
    assert (fault.ranks, fault.hosts, fault.suspect_nodes) == ((0, 1), ("h0", "h1"), ("h1",))
    assert fault.error.startswith("rank 0 on h0 failed: RuntimeError: injected fault; ")
    assert "rank 1 on h1 ended without an exit record (killed by a signal" in fault.error
    heal = decide(run.path, max_restarts=3)
    assert heal.requeue and heal.exclude == ["h1"], heal
    run.record.write_text(json.dumps({"state": "failed"}))  # not healed: status names both
    (row,) = collect([run.path]).rows
    assert row.state == "FAILED" and row.cause_rank == 0, row
    assert row.cause and row.cause.startswith("rank 0 on h0 failed: RuntimeError"), row
    assert "; rank 1 on h1 ended without an exit record" in row.cause, row


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_process(
    run: RunDir,
    rank: int,
    hosts: tuple[str, ...],
    stall: Any,
    port: int | None = None,
    pause: bool = False,
) -> Any:
    """A rank in a child process: its watchdog (limit 2 s, beats every 0.5 s), iterations
    every 50 ms until `stall` is set, then stuck (in a checkpoint write with `pause`, else in
    a collective). With `port`, the job's store there (rank 0 holds it, as env:// does)."""
    import multiprocessing
    from datetime import timedelta

    import torch.distributed as dist

    def main() -> None:
        server = (
            dist.TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )
            if port is not None and rank == 0
            else None
        )
        store = StoreAddress("127.0.0.1", port, "test") if port is not None else None
        with Watchdog(
            run,
            rank=rank,
            world_size=len(hosts),
            timeout_s=2.0,
            rank_log=io.StringIO(),
            host=hosts[rank],
            hosts=hosts,
            store=store,
        ) as dog:
            it = 0
            while not stall.is_set():
                it += 1
                dog.progress(it)
                time.sleep(0.05)
            with dog.paused() if pause else contextlib.nullcontext():
                time.sleep(60)
        del server

    return multiprocessing.get_context("fork").Process(target=main)


def _armed(run: RunDir, hosts: tuple[str, ...]) -> bool:
    beats = [read_node_beat(run, h) for h in dict.fromkeys(hosts)]
    ranks = {b.rank: b.iteration for beat in beats if beat for b in beat.ranks}
    return len(ranks) == len(hosts) and min(ranks.values()) >= 3


def _freeze(run: RunDir, procs: list[Any], frozen: int, hosts: tuple[str, ...], stall: Any) -> None:
    """Start the ranks; once all are past iteration 3, SIGSTOP rank `frozen` and stall the
    others; wait for them to end (a watchdog ends its process); the frozen one is killed."""
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while not _armed(run, hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(procs[frozen].pid, signal.SIGSTOP)
        stall.set()
        for r, p in enumerate(procs):
            if r != frozen:
                p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # (SIGKILL ends a stopped process: it never runs again)
                p.join()


def test_the_frozen_writer_of_a_node_is_named_by_its_node_mates(tmp_path: Path) -> None:
    """Three ranks on one node; rank 0 writes the node's heartbeat. SIGSTOP of rank 0 while
    the others wait for it: rank 1 takes over the node's heartbeat (rank 0's beat stopped)
    and both name rank 0 alone, on its node; one record of the hang, both exit 4."""
    import multiprocessing

    run, hosts = RunDir(tmp_path), ("nodeA",) * 3
    stall = multiprocessing.get_context("fork").Event()
    procs = [_rank_process(run, r, hosts, stall) for r in range(3)]
    _freeze(run, procs, 0, hosts, stall)
    assert [p.exitcode for p in procs[1:]] == [4, 4]
    hang = read_hang(run)
    assert hang is not None and (hang.frozen, hang.frozen_hosts) == ((0,), ("nodeA",)), hang
    beat = read_node_beat(run, "nodeA")
    assert beat is not None and beat.writer in (1, 2), beat
    assert sorted(p.name for p in run.heartbeats.iterdir()) == ["hang.json", "node-nodeA.json"]


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_frozen_rank_of_another_node_is_named_through_the_store_or_its_files(
    tmp_path: Path, frozen: int
) -> None:
    """Ranks 0 (nodeA, holding the store) and 1 (nodeB). Rank 1 frozen: rank 0 reads
    nodeB's beat from the store and names rank 1. Rank 0 frozen while rank 1 is in a
    checkpoint write: the store (in rank 0's process) never answers, rank 1 reads nodeA's
    heartbeat file instead and names rank 0, in the write, within the limit."""
    import multiprocessing

    import torch.distributed  # noqa: F401  (before the fork: the children share it)

    run, hosts, port = RunDir(tmp_path), ("nodeA", "nodeB"), _free_port()
    stall = multiprocessing.get_context("fork").Event()
    pause = frozen == 0
    procs = [_rank_process(run, r, hosts, stall, port, pause) for r in range(2)]
    t0 = time.monotonic()
    _freeze(run, procs, frozen, hosts, stall)
    named_s = time.monotonic() - t0
    watcher = 1 - frozen
    assert procs[watcher].exitcode == 4
    hang = read_hang(run)
    assert hang is not None and hang.rank == watcher, hang
    assert (hang.frozen, hang.frozen_hosts) == ((frozen,), (hosts[frozen],)), hang
    view = NodeBoard(run, hosts[watcher]).read_view()
    assert view is not None and view.via == ("files" if frozen == 0 else "store"), view
    if pause:
        assert hang.during == "in the checkpoint write" and hang.waited_s < 2 + 2, hang
    assert named_s < 60


def test_a_killed_starts_board_is_swept_after_a_week_and_a_live_one_kept(tmp_path: Path) -> None:
    """A rank killed outright never leaves its node board (in /dev/shm): the next start on the
    host removes the boards no rank wrote for a week, and keeps the others."""
    boards = {}
    for name in ("killed", "live", "ends"):
        board = boards[name] = NodeBoard(RunDir(tmp_path / name), "nodeA")
        board.open()
        board.write_beat(RankBeat(0, "nodeA", None, 3, 1))
    week_ago = time.time() - 8 * 86400
    for f in [boards["killed"].path, *boards["killed"].path.iterdir()]:
        os.utime(f, (week_ago, week_ago))
    boards["ends"].leave(0)  # the last rank of a node that ends takes its board with it
    assert not boards["ends"].path.exists()
    (following := NodeBoard(RunDir(tmp_path / "next"), "nodeA")).open()
    assert not boards["killed"].path.exists()
    assert boards["live"].read_beat(0) is not None
    for board in (boards["live"], following):
        board.leave(0)
        assert not board.path.exists()

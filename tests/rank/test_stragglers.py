"""Stragglers are named (issue 31).

A rank whose iterations are consistently slower than the others' is reported in
`mjlab-hpc status`, `logs` and the rank logs, with its host and how much slower. One slow
iteration is not a straggler, and one that keeps up again is no longer named. The end-to-end
test slows rank 1 of a real two-rank job as a busy node would: it runs 30 ms of every 100
(SIGSTOP and SIGCONT from the test).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, wait_for, wait_for_iteration

from mjlab_hpc.rank.stragglers import RATIO, WINDOW, StragglerWatch, _median_without
from mjlab_hpc.rundir.durable import write_json_atomic
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import RunRecord, on_end, on_stragglers


def feed(watch: StragglerWatch, rows: list[list[float]], start: int = 1) -> list[bool]:
    return [watch.add(start + i, row) for i, row in enumerate(rows)]


def test_a_rank_consistently_slower_is_named_once_and_dropped_when_it_keeps_up() -> None:
    watch = StragglerWatch(["n1", "n2", "n3"])
    changes = feed(watch, [[0.10, 0.21, 0.11]] * WINDOW)
    assert changes == [False] * (WINDOW - 1) + [True]
    (slow,) = watch.current
    assert (slow.rank, slow.host, slow.since) == (1, "n2", WINDOW)
    assert slow.describe().startswith(
        "rank 1 on n2 is 2.00x slower than the other ranks (0.210 s vs 0.105 s"
    )
    assert slow.as_dict()["ratio"] == 2.0  # against the median of 0.10 and 0.11
    assert feed(watch, [[0.10, 0.30, 0.11]] * 3, WINDOW + 1) == [False] * 3  # still the same
    assert watch.current[0].since == WINDOW
    changes = feed(watch, [[0.10, 0.10, 0.11]] * WINDOW, WINDOW + 4)
    assert True in changes and watch.current == []


def test_one_slow_iteration_small_differences_and_one_rank_are_no_stragglers() -> None:
    watch = StragglerWatch(["a", "b"])
    assert not any(feed(watch, [[0.1, 0.1]] * (WINDOW - 1) + [[0.1, 5.0]]))
    watch = StragglerWatch(["a", "b"])  # slower by more than RATIO, but by 10 ms
    assert not any(feed(watch, [[0.01, 0.02]] * WINDOW))
    watch = StragglerWatch(["a", "b"])
    assert not any(feed(watch, [[0.1, 0.1 * RATIO * 0.98]] * WINDOW))
    assert not any(feed(StragglerWatch(["a"]), [[1.0]] * WINDOW))


def test_the_median_of_the_others_is_the_median_without_each_value() -> None:
    rng = random.Random(0)
    for _ in range(500):
        ranked = sorted(rng.choice([0.1, 0.2, rng.random()]) for _ in range(rng.randint(2, 9)))
        for place in range(len(ranked)):
            rest = ranked[:place] + ranked[place + 1 :]
            assert _median_without(ranked, place) == pytest.approx(statistics.median(rest))


def test_a_run_that_ended_still_names_its_straggler(tmp_path: Path) -> None:
    """A run whose last start ended with a rank 2.5x slower than the other: status and logs
    still name it, as of when the run last trained (they said nothing once it had ended)."""
    watch = StragglerWatch(["node1", "node2"])
    feed(watch, [[0.2, 0.5]] * WINDOW)
    record = on_end(on_stragglers(RunRecord(), [s.as_dict() for s in watch.current]), WINDOW)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    write_json_atomic(run.record, record.to_json())
    said = "when it last trained, rank 1 on node2 is 2.50x slower than the other ranks (0.500 s"
    row = status_json(run)
    assert row["state"] == "COMPLETED" and row["stragglers"][0].startswith(said), row
    cmd = [BIN / "mjlab-hpc", "logs", str(run.path)]
    logs = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert f"straggler: {said}" in logs.stdout, logs.stdout + logs.stderr


def status_json(run: RunDir) -> dict:
    proc = subprocess.run(
        [BIN / "mjlab-hpc", "status", "--json", str(run.path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout)[0])


@pytest.mark.training
def test_a_throttled_rank_is_named_in_status_logs_and_rank_logs(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    cmd = [BIN / "mjlab-train", "cartpole", "--num-envs", "32", "--torch-threads", "1"]
    cmd += ["--num-procs", "2", "--max-iterations", "1000", "--log-root", str(root)]
    proc = subprocess.Popen(
        cmd,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stop = threading.Event()
    pid = None

    def throttle() -> None:
        while not stop.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.07)
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.03)

    try:
        run = wait_for_iteration(root, 2)
        start_line = re.search(r" host (\S+), pid (\d+)", run.rank_log(1).read_text())
        assert start_line, run.rank_log(1).read_text()
        host, pid = start_line.group(1), int(start_line.group(2))
        thread = threading.Thread(target=throttle, daemon=True)
        thread.start()
        row = wait_for(lambda: (r := status_json(run))["stragglers"] and r, 120, "a straggler")
        (text,) = row["stragglers"]
        assert text.startswith(f"rank 1 on {host} is "), text
        assert float(text.split(" is ")[1].split("x ")[0]) >= RATIO, text
        for rank in (0, 1):
            assert f"straggler: rank 1 on {host} is " in run.rank_log(rank).read_text()
        cmd = [BIN / "mjlab-hpc", "logs", str(run.path), "--lines", "1"]
        logs = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=60)
        assert f"straggler: rank 1 on {host} is " in logs.stdout, logs.stdout
        stop.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: status_json(run)["stragglers"] == [], 120, "rank 1 to keep up")
        assert "keeps up again" in run.rank_log(0).read_text()
    finally:
        stop.set()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the ranks checkpoint and stop
        proc.wait(timeout=120)

"""Run directories: decided once, never shared by two jobs, written by one writer."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from mjlab_hpc.ops.cancel import write_cancel_marker
from mjlab_hpc.rundir.layout import (
    RunDir,
    create_run_dir,
    latest_run,
    latest_run_record,
    record_latest_run,
    run_dir_for_key,
)
from mjlab_hpc.rundir.lock import LockTimeout, LockUsageError
from mjlab_hpc.rundir.state import cancel_marker
from mjlab_hpc.rundir.writer import RunWriter, once

SAME_SECOND = dt.datetime(2026, 11, 22, 4, 12, 58)


def _make(root: str, out: mp.Queue) -> None:
    out.put(str(create_run_dir(root, "exp", "r", now=SAME_SECOND)))


def _keyed(root: str, out: mp.Queue) -> None:
    out.put(str(run_dir_for_key(root, "exp", "r", "slurm-77")))


def race(target: object, root: Path, n: int = 16) -> list[str]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(str(root), out)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return [out.get(timeout=5) for _ in range(n)]


def test_launches_in_the_same_second_get_distinct_directories(tmp_path: Path) -> None:
    made = race(_make, tmp_path)
    assert len(set(made)) == 16
    names = sorted(Path(m).name for m in made)
    assert names[0] == "2026-11-22_04-12-58_r" and "2026-11-22_04-12-58_r-16" in names


def test_one_job_key_one_directory_under_a_race(tmp_path: Path) -> None:
    made = race(_keyed, tmp_path)
    assert len(set(made)) == 1
    # The losers removed the directories they made: one run directory remains.
    runs = [p for p in (tmp_path / "exp").iterdir() if not p.name.startswith(".")]
    assert [str(p) for p in runs] == [made[0]]


def test_second_writer_is_refused_and_named(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    first = RunWriter.acquire(run, rank=0, lease_s=3.0)
    try:
        with pytest.raises(LockTimeout, match="rank=0"):
            RunWriter.acquire(run, rank=0, lease_s=3.0, timeout_s=0.5)
        first.write_json(run.summary, {"ok": True})
    finally:
        first.release()
    second = RunWriter.acquire(run, rank=0, lease_s=3.0, timeout_s=1.0)
    second.release()
    # A released writer can no longer publish anything.
    with pytest.raises(LockUsageError):
        first.write_json(run.summary, {"stale": True})
    assert "stale" not in run.summary.read_text()


def test_latest_run_record(tmp_path: Path) -> None:
    a = create_run_dir(tmp_path, "exp", now=SAME_SECOND)
    b = create_run_dir(tmp_path, "exp", now=SAME_SECOND + dt.timedelta(seconds=5))
    assert latest_run(tmp_path, "exp") == b  # newest by name without a record
    record_latest_run(a)
    assert latest_run(tmp_path, "exp") == a
    assert latest_run(tmp_path, "missing") is None


def _once_worker(root: str, is_writer: bool, fail: bool, out: mp.Queue) -> None:
    run = RunDir(Path(root))
    writer = RunWriter.acquire(run, rank=0, lease_s=5.0) if is_writer else None

    def download() -> str:
        time.sleep(0.5)  # the others must wait for it
        with open(Path(root) / "calls.txt", "a") as f:
            f.write("x")
        if fail:
            raise OSError("registry unreachable")
        return "motion.npz"

    try:
        out.put(("ok", once(run, "motion", writer, download, timeout_s=30, poll_s=0.05)))
    except Exception as exc:
        out.put(("error", str(exc)))
    finally:
        if writer is not None:
            writer.release()


@pytest.mark.parametrize("fail", [False, True])
def test_side_effect_runs_once_on_the_writer(tmp_path: Path, fail: bool) -> None:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_once_worker, args=(str(tmp_path), k == 0, fail, out)) for k in range(5)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = [out.get(timeout=5) for _ in range(5)]
    assert (tmp_path / "calls.txt").read_text() == "x"  # ran exactly once
    if fail:
        assert all(kind == "error" and "registry unreachable" in msg for kind, msg in got)
    else:
        assert got == [("ok", "motion.npz")] * 5


def test_run_records_name_runs_so_a_copied_log_root_resolves_in_the_copy(tmp_path: Path) -> None:
    import shutil

    run = run_dir_for_key(tmp_path / "a", "exp", "r", "slurm-5")
    record_latest_run(run)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = tmp_path / "b" / "exp" / run.name
    assert run_dir_for_key(tmp_path / "b", "exp", "r", "slurm-5") == copy
    assert latest_run(tmp_path / "b", "exp") == copy.resolve()
    # A record written by 0.1.0 held the absolute path: it resolves in the copy too.
    latest_run_record(tmp_path / "b" / "exp").write_text(f"{run}\n")
    assert latest_run(tmp_path / "b", "exp") == copy.resolve()


def test_a_cancel_is_judged_by_the_runs_starts_not_by_clocks(tmp_path: Path) -> None:
    """`mjlab-hpc cancel` on a login node whose clock is an hour behind the nodes' still
    cancels the run's current start; a later start (a resume) is not cancelled."""
    record = tmp_path / "run.json"
    ahead = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).isoformat()
    record.write_text(json.dumps({"starts": [{"at": ahead}]}))
    write_cancel_marker(tmp_path, ["42"])
    assert cancel_marker(tmp_path) is not None
    record.write_text(json.dumps({"starts": [{"at": ahead}, {"at": ahead}]}))
    assert cancel_marker(tmp_path) is None

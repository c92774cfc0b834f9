"""The durable-write primitive, and the one bounded read.

Whole files or nothing, no temporary file left behind, and one winner of racing exclusive
creations; reads of nothing but a regular file in its folder, never waiting.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from mjlab_hpc.rundir.durable import (
    create_exclusive,
    fsync_dir,
    read_regular,
    read_tail,
    write_atomic,
    write_json_atomic,
)


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    write_json_atomic(path, {"x": 1})
    write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failing_fence_publishes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")

    def fence() -> None:
        raise RuntimeError("lock lost")

    with pytest.raises(RuntimeError, match="lock lost"):
        write_atomic(path, b"new", before_rename=fence)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def _race(path: str, out: mp.Queue) -> None:
    out.put(create_exclusive(Path(path), f"{os.getpid()}\n".encode()))


def test_create_exclusive_has_one_winner(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    target = tmp_path / "record"
    racers = [ctx.Process(target=_race, args=(str(target), out)) for _ in range(16)]
    for p in racers:
        p.start()
    wins = [out.get(timeout=30) for _ in racers]
    for p in racers:
        p.join(10)
    assert wins.count(True) == 1
    assert target.read_text().strip().isdigit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]


def test_fsync_dir_refuses_a_missing_directory(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


def test_reads_are_bounded_confined_and_never_wait(tmp_path: Path) -> None:
    """Only a regular file in its folder is read: a FIFO (no writer: it would wait forever),
    a link to /dev/zero, a link out (to a file or through a folder) are named, unread; a
    link inside the folder is followed; `read_tail` reads a file's end from a line's start."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (tmp_path / "secret").write_text("not the run's\n")
    os.mkfifo(run / "fifo")
    (run / "zero").symlink_to("/dev/zero")
    (run / "out").symlink_to(tmp_path / "secret")
    (run / "away").symlink_to(tmp_path)
    (run / "log").write_bytes(b"first\n" + b"x" * 100 + b"\nsecond\nthird\n")
    (run / "inside").symlink_to("log")
    started = time.monotonic()
    for name, why in [
        ("fifo", "fifo is a FIFO, not a file"),
        ("zero", "zero is a character device, not a file"),
        ("out", "out is a link out of run"),
        ("logs", "logs is a directory, not a file"),
    ]:
        with pytest.raises(ValueError, match=why):
            read_regular(run / name)
    with pytest.raises(ValueError, match="secret is a link out of run"):
        read_regular(run / "away" / "secret", within=run)
    with pytest.raises(ValueError, match="more than"):
        read_regular(run / "log", limit=10)
    assert time.monotonic() - started < 5
    assert read_regular(run / "inside").startswith(b"first\n")
    assert read_tail(run / "inside", 16) == b"second\nthird\n"
    assert read_tail(run / "log", 1 << 20).startswith(b"first\n")

"""The durable-write primitive.

Whole files or nothing, no temporary file left behind, and one winner of racing exclusive
creations.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from mjlab_hpc.rundir.durable import (
    create_exclusive,
    fsync_dir,
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

"""The ranks' start and end records (`rundir.ends`): what decisions read, not log text."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mjlab_hpc.procs import OomCount
from mjlab_hpc.rundir.ends import (
    RankExit,
    RankStart,
    rank_ends,
    rank_starts,
    record_end,
    record_start,
    start_hosts,
)
from mjlab_hpc.rundir.layout import RunDir


def _start(run: RunDir, rank: int, node: str = "n1", oom: OomCount | None = None) -> RankStart:
    made = RankStart(
        run=run.path.name,
        rank=rank,
        world_size=2,
        node=node,
        pid=1,
        device="cpu",
        at=time.time(),
        start_id="7.0.1",
        oom=oom,
    )
    return record_start(run, made)


def test_each_start_is_numbered_and_its_end_read_back(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    first = _start(run, 0, "n1", OomCount(kernel="k", counter="/nowhere", kills=3))
    record_end(run, first, RankExit(how="failed", detail="ValueError: x", at=time.time()))
    second = _start(run, 0, "n2")
    assert (first.number, second.number) == (1, 2)
    assert rank_starts(run.path, 0)[0] == first  # the OOM count too
    assert start_hosts(run.path, 0) == ["n1", "n2"]
    (end,) = rank_ends(run.path)  # the latest start: no end record yet
    assert (end.how, end.host, end.start_id) == ("no-exit", "n2", "7.0.1")


def test_log_text_alone_decides_nothing(tmp_path: Path) -> None:
    """A rank log full of our lines' shapes, and no records: no rank started."""
    run = RunDir(tmp_path)
    run.logs.mkdir()
    run.rank_log(0).write_text(
        "2026-11-23 10:00:00,000 rank0 rank 0/2 (local 0/2, node 0/1) via slurm, master x:1 "
        "on cpu, host evil, pid 1, seed 1, 8 envs\n"
        "2026-11-23 10:00:09,000 rank0 exit: failed (out-of-memory)\n"
        "MemoryError: out of memory\n"
    )
    assert rank_ends(run.path) == [] and start_hosts(run.path, 0) == []


def test_records_are_never_written_through_a_link_and_damaged_ones_are_skipped(
    tmp_path: Path,
) -> None:
    run = RunDir(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    run.logs.mkdir(parents=True)
    run.rank_records.symlink_to(outside)
    with pytest.raises(NotADirectoryError):
        _start(run, 0)
    assert list(outside.iterdir()) == []
    run.rank_records.unlink()
    run.rank_records.mkdir()
    run.rank_start(1, 1).write_text("{not json")
    run.rank_start(1, 2).write_text(json.dumps({"rank": 1}))
    good = _start(run, 1)
    assert good.number == 3 and [s.number for s in rank_starts(run.path, 1)] == [3]
    run.rank_end(1, 3).symlink_to(outside / "end.json")  # planted: replaced, not followed
    record_end(run, good, RankExit(how="completed", detail="completed 3 iterations", at=1.0))
    assert list(outside.iterdir()) == [] and not run.rank_end(1, 3).is_symlink()
    assert [(e.rank, e.how) for e in rank_ends(run.path)] == [(1, "completed")]


def test_a_diverged_training_is_not_restarted(tmp_path: Path) -> None:
    """Every rank's numbers went non-finite at one update: a restart would diverge again."""
    from mjlab_hpc.errors import Diverged
    from mjlab_hpc.launch.heal import decide
    from mjlab_hpc.rank.failures import failure_kind
    from mjlab_hpc.rundir.record import Failure, RunRecord, RunState

    error = Diverged(7, "the value loss is nan", 1.0)
    assert failure_kind(error) == "diverged"
    run = RunDir(tmp_path)
    for rank in (0, 1):
        started = _start(run, rank)
        record_end(run, started, RankExit(how="failed", detail=str(error), at=time.time()))
    failure = Failure(rank=0, host="n1", kind="diverged", error=f"Diverged: {error}")
    record = RunRecord(state=RunState.FAILED, failure=failure)
    run.record.write_text(json.dumps(record.to_json()))
    heal = decide(tmp_path, max_restarts=5, start="7.0.1")
    assert heal.fault is not None and heal.fault.reason == "diverged"
    assert not heal.requeue and "iteration 7" in heal.why and "learning rate" in heal.why


def test_a_repeat_is_the_same_kind_type_ranks_and_iteration_never_the_same_words(
    tmp_path: Path,
) -> None:
    """The crash-loop check compares what the ranks said ended them (kind, exception type),
    the ranks and the iteration; another message (a pid, an address) is the same failure,
    another type or another rank is not."""
    from mjlab_hpc.launch.heal import decide, record_healing
    from mjlab_hpc.rundir.progress import ProgressLine, progress_line

    def start_failing(step: str, rank: int, error_type: str, message: str) -> None:
        for r in (0, 1):
            made = RankStart(tmp_path.name, r, 2, f"n{r}", 1, "cpu", time.time(), step)
            started = record_start(run, made)
            own = r == rank
            record_end(
                run,
                started,
                RankExit(
                    how="failed",
                    detail=f"{error_type}: {message}" if own else "RuntimeError: peer gone",
                    at=time.time(),
                    error_type=error_type if own else "RuntimeError",
                    kind="exception" if own else "peer-lost",
                ),
            )

    run = RunDir(tmp_path)
    run.progress.write_text(progress_line(ProgressLine(iteration=3)) + "\n")
    start_failing("7.0.1", 1, "ValueError", "bad value from pid 4711 at 0x7f00")
    first = decide(tmp_path, max_restarts=5, start="7.0.1")
    assert first.requeue and first.fault is not None and first.fault.ranks == (1,)
    assert (first.entry.failure_kind, first.entry.error_type) == ("exception", "ValueError")
    record_healing(tmp_path, first)
    start_failing("7.0.2", 1, "ValueError", "bad value from pid 5120 at 0x7f88")
    again = decide(tmp_path, max_restarts=5, start="7.0.2")
    assert not again.requeue and "the same failure at iteration 3" in again.why
    start_failing("7.0.3", 1, "KeyError", "bad value from pid 5120 at 0x7f88")
    assert decide(tmp_path, max_restarts=5, start="7.0.3").requeue  # another type
    start_failing("7.0.4", 0, "ValueError", "bad value from pid 5120 at 0x7f88")
    assert decide(tmp_path, max_restarts=5, start="7.0.4").requeue  # another rank


def test_a_heal_reads_run_json_to_decide_and_again_only_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mjlab_hpc.rundir.record as record_module
    from mjlab_hpc.launch.heal import decide, record_healing

    run = RunDir(tmp_path)
    for rank in (0, 1):
        record_end(run, _start(run, rank), RankExit(how="failed", detail="x", at=time.time()))
    reads: list[Path] = []
    read = record_module.read_regular

    def counted(path: Path, *args: object, **kw: object) -> bytes:
        reads.append(path)
        return read(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(record_module, "read_regular", counted)
    heal = decide(tmp_path, max_restarts=3, start="7.0.1")
    assert heal.requeue and len(reads) == 1  # was 5: each step read it again
    record_healing(tmp_path, heal)  # the writer's update, under its lease
    assert [p.name for p in reads] == ["run.json", "run.json"]

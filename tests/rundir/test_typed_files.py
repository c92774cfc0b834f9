"""Every file of a run directory is a typed value, read and checked by one converter.

`data/main-d42f375/` holds real run directories written by main d42f375 (a 2-iteration
cartpole run on 2 CPU ranks whose rank 1 raised at iteration 1 and was healed, and a sweep of
two runs: one stopped by SIGHUP and cancelled, one cancelled while frozen), trimmed to their
records (no models; paths rewritten to /data/runs). Every reader of the package reads them
field by field. `data/main-138aa9f/` is a run of the main before (no rank records, no
checkpoint times): `report` says what its records lack.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from helpers import BIN, cli_env

from mjlab_hpc.convert import (
    Count,
    EpochS,
    Mismatch,
    NonNegative,
    Range,
    Seconds,
    describe,
    fits,
    load,
    parse_json,
)
from mjlab_hpc.ops.report import collect_report
from mjlab_hpc.rundir.ends import FAULT_ENDS, RankExit, rank_ends, rank_starts, read_end, record_end
from mjlab_hpc.rundir.layout import RunDir, latest_run, read_element, read_sweep
from mjlab_hpc.rundir.progress import (
    ProgressLine,
    progress_line,
    read_checkpoint_times,
    read_progress,
)
from mjlab_hpc.rundir.record import RunState, read_record, read_summary
from mjlab_hpc.rundir.state import cancel_marker
from mjlab_hpc.rundir.typed import read_lines
from mjlab_hpc.spec import TrainSpec

DATA = Path(__file__).parent / "data"
MAIN = DATA / "main-d42f375" / "logs" / "cartpole"
HEALED = MAIN / "2026-11-29_07-54-15"
STOPPED = MAIN / "2026-11-29_07-56-01_seed=1"
FROZEN = MAIN / "2026-11-29_07-56-01_seed=0"
SWEEP = MAIN / ".sweeps" / "2026-11-29_07-56-00"
PREVIOUS = DATA / "main-138aa9f" / "logs" / "cartpole" / "2026-11-29_08-10-43"


def test_every_reader_reads_what_main_wrote() -> None:
    record = read_record(HEALED, strict=True)
    assert record.state is RunState.COMPLETED and isinstance(record.spec, TrainSpec)
    assert (record.spec.num_envs, record.spec.save_interval, record.world_size) == (4, 1, 2)
    (fault,) = record.faults
    assert (fault.reason, fault.ranks, fault.iteration, fault.recomputed) == ("crash", (1,), 1, 1)
    unread: list[str] = []
    starts = [rank_starts(HEALED, rank, unread) for rank in (0, 1)]
    assert [len(s) for s in starts] == [2, 2] and starts[1][0].oom is not None
    first_ends = [read_end(HEALED, s[0], unread) for s in starts]
    assert [e.failure if e else None for e in first_ends] == ["peer-lost", "exception"]
    assert [e.how for e in rank_ends(HEALED, unread)] == ["completed", "completed"]
    progress = read_progress(RunDir(HEALED))
    assert [p.iteration for p in progress.values] == [1, 2] and progress.values[1].time
    times = read_checkpoint_times(RunDir(HEALED))
    assert [(c.iteration, c.stop) for c in times.values] == [(1, None), (2, None)]
    summary = read_summary(HEALED)
    assert summary is not None and summary.ranks_in_sync and summary.restart_reasons == ("crash",)
    assert unread == [] and progress.unread == () and times.unread == ()
    # The sweep and its stopped, cancelled element.
    element = read_element(STOPPED)
    assert element is not None and element.index == 1 and dict(element.overrides) == {"seed": "1"}
    sweep = read_sweep(SWEEP)
    assert sweep is not None and [e.index for e in sweep.elements] == [0, 1]
    assert dict(sweep.axes) == {"seed": ("0", "1")} and sweep.elements[1].run_dir is not None
    stopped = read_record(STOPPED, strict=True)
    assert stopped.state is RunState.STOPPED and stopped.restarts[0].reason == "hangup"
    cancelled = cancel_marker(STOPPED, stopped)
    assert cancelled is not None and cancelled.job_ids == ("16958",) and cancelled.starts == 1
    assert read_checkpoint_times(RunDir(STOPPED)).values[0].stop == "hangup"
    assert [e.how for e in rank_ends(FROZEN)] == ["no-exit"]  # killed while frozen


def test_what_main_wrote_is_written_back_alike(tmp_path: Path) -> None:
    """A line written now reads back to the same value, and reads as main's lines do."""
    ours = RunDir(tmp_path)
    lines = read_progress(RunDir(HEALED)).values
    ours.progress.write_text("".join(progress_line(p) + "\n" for p in lines))
    assert read_progress(ours).values == lines
    theirs = [json.loads(x) for x in RunDir(HEALED).progress.read_text().splitlines()]
    assert [json.loads(progress_line(p)) for p in lines] == theirs


def test_the_previous_mains_run_reports_what_its_records_lack() -> None:
    """138aa9f wrote no rank records and no checkpoint times: the report counts its starts
    from run.json and says why its phases are not told apart (it said `0 start(s)`)."""
    cost = collect_report(PREVIOUS)
    assert cost.starts == 2 and cost.faults == 1 and cost.iterations == 2
    (note,) = [n for n in cost.notes if "rank start and end records" in n]
    assert "an older mjlab-hpc" in note and "2 start(s)" in note


def test_resume_picks_the_run_written_last_not_the_largest_name(tmp_path: Path) -> None:
    """`--resume` without this user's `.latest_run` record: the run written last, whatever
    its name (a --run-name, a `-2` suffix)."""
    experiment = tmp_path / "cartpole"
    older = experiment / "2026-11-29_09-00-00_zz-named"
    newer = experiment / "2026-11-29_08-00-00"
    for run, at in ((older, time.time() - 3600), (newer, time.time())):
        run.mkdir(parents=True)
        (run / "run.json").write_text("{}")
        os.utime(run / "run.json", (at, at))
    assert latest_run(tmp_path, "cartpole") == newer.resolve()


def test_a_fault_leaves_a_marker_the_batch_scripts_watcher_finds_by_name(tmp_path: Path) -> None:
    from mjlab_hpc.rundir.ends import RankStart, record_start

    run = RunDir(tmp_path)
    for rank, how in enumerate(("completed", "stopped", *FAULT_ENDS)):
        start = record_start(run, RankStart(run.path.name, rank, 6, "n", 1, "cpu", time.time()))
        record_end(run, start, RankExit(how=how, detail=how, at=time.time()))  # type: ignore[arg-type]
    marked = sorted(p.name for p in run.rank_records.glob("*.fault"))
    assert marked == [f"rank{k}.1.fault" for k in range(2, 6)]


# The converter.


def test_json_values_are_checked_for_type_finiteness_and_range() -> None:
    assert load(EpochS, 1e9) == 1e9 and load(Count, 3) == 3
    for hint, value in ((EpochS, 1e20), (EpochS, -1.0), (Count, -1), (Count, True), (float, "x")):
        with pytest.raises(Mismatch):
            load(hint, value)
    with pytest.raises(Mismatch):
        load(float, math.nan)
    with pytest.raises(Mismatch, match="not an integer"):
        load(int, 1.5, "iteration")
    with pytest.raises(ValueError, match="no JSON number"):
        parse_json(b'{"at": NaN}')
    assert not fits(Annotated[int, Range(0, 10)], 11) and fits(int | None, None)
    assert load(float, 10**400 // 10**399) == 10.0
    with pytest.raises(Mismatch):
        load(float, 10**400)  # an int of 400 digits is no finite float
    # Finite but past any run: would overflow a float, a sum or a timedelta downstream.
    for hint, value in ((Count, 10**400), (Count, 2**60), (Seconds, 1e300), (NonNegative, 1e300)):
        with pytest.raises(Mismatch):
            load(hint, value)
    assert load(Count, 2**40) == 2**40 and load(Seconds, 86_400.0 * 365) == 86_400.0 * 365


def test_one_converter_reads_toml_and_command_line_text() -> None:
    """TOML spells None `"none"`; command-line text is strings in the command line's words."""
    assert load(int | None, "none", mode="toml") is None
    assert load(str | None, "none", mode="toml") == "none"  # the string, as before
    assert load(tuple[str, ...], ["a", "b"], mode="toml") == ("a", "b")
    assert load(bool, "yes", mode="text") is True and load(int, "-4", mode="text") == -4
    assert load(int | None, "None", mode="text") is None
    for text in ("\u0663", "1_0", "nan", "1e999"):
        with pytest.raises(Mismatch):
            load(int if text != "nan" else float, text, mode="text")
    assert load(Literal["iteration", "step"], "step", mode="text") == "step"
    assert describe(int | None, "toml") == 'an integer or "none"'
    assert describe(tuple[str, ...]) == "a list of strings"


def test_a_line_too_long_or_not_fitting_is_named_and_the_rest_read(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    good = progress_line(ProgressLine(iteration=1, time=time.time()))
    pad = "x" * (10 << 20)
    path.write_text(f'{good}\n{{"iteration": 2, "pad": "{pad}"}}\n{{"iteration": -1}}\n{good}\n')
    read = read_lines(ProgressLine, path, tmp_path)
    assert [p.iteration for p in read.values] == [1, 1]
    assert read.unread[0].startswith("progress.jsonl line 2 holds 10,485,")
    assert "progress.jsonl line 3 is damaged (its 'iteration' is -1" in read.unread[1]
    path.write_text(good + "\n" + good[:20])  # a torn last line: a writer in mid-append
    assert read_lines(ProgressLine, path, tmp_path).unread == ()


def test_a_newer_run_record_is_refused_in_one_line_and_never_rewritten(tmp_path: Path) -> None:
    log_root = tmp_path / "logs"
    run = log_root / "cartpole" / HEALED.name
    shutil.copytree(HEALED, run)
    value: dict[str, Any] = json.loads((run / "run.json").read_text())
    value |= {"schema": 99, "a_later_field": {"kept": True}}
    text = json.dumps(value)
    (run / "run.json").write_text(text)
    proc = subprocess.run(
        [
            *(str(BIN / "mjlab-submit"), "cartpole", "--resume", "--log-root", str(log_root)),
            *("--executor", "local", "--gpus-per-node", "0", "--dry-run"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in said, said[-2000:]
    assert "--resume:" in said and "written by a newer mjlab-hpc, its schema 99" in said
    assert (run / "run.json").read_text() == text and not list(run.glob("run.json.damaged-*"))


def test_times_two_hosts_disagree_on_stay_a_record(tmp_path: Path) -> None:
    """A recovery timed by a rank whose clock is behind the healer's was written below 0 by
    main (seen with the ranks an hour behind): such a record still reads, and this code
    writes None (not known) rather than a time below 0 that would make its record damaged."""
    import dataclasses

    from mjlab_hpc.rundir.record import Interruption, RunRecord, on_recovered

    value = json.loads((HEALED / "run.json").read_text())
    value["faults"][0]["recovery_s"] = -3575.68
    (tmp_path / "run.json").write_text(json.dumps(value))
    assert read_record(tmp_path, strict=True).faults[0].recovery_s == -3575.68
    ahead = Interruption(reason="crash", kind="requeue", iteration=3, at_s=time.time() + 3600)
    record = on_recovered(dataclasses.replace(RunRecord(), faults=(ahead,)), resumed_from=2)
    (tmp_path / "run.json").write_text(json.dumps(record.to_json()))
    (fault,) = read_record(tmp_path, strict=True).faults
    assert fault.recovered_at and fault.recovery_s is None and fault.recomputed == 1

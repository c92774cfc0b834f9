"""run.json as one typed record (rundir/record.py): records written before it had a type
read, and write back the same keys; a field of the wrong type is named; each event of a run
is a new record, the old one unchanged; one vocabulary of a run's state.

`data/run-138aa9f-completed.json` is the run.json of a real 2-iteration cartpole run by the
code at commit 138aa9f (the last before the type), paths made neutral. The stops and faults
below have the field sets that code wrote (rank/stop.py, launch/heal.py, rundir/state.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.rundir.layout import CANCEL_RECORD
from mjlab_hpc.rundir.record import (
    SCHEMA,
    Failure,
    Interruption,
    RunRecord,
    RunState,
    Start,
    StopEntry,
    on_end,
    on_fault,
    on_node_failed,
    on_preempted,
    on_recovered,
    on_start,
    on_stop,
    on_stop_answered,
    read_record,
)
from mjlab_hpc.rundir.state import record_state
from mjlab_hpc.spec import TrainSpec

COMPLETED = Path(__file__).parent / "data" / "run-138aa9f-completed.json"

# A stop as rank/stop.py wrote it (a requeue by Slurm at the time limit, in an srun step).
STOP = {
    "reason": "time-limit",
    "kind": "requeue",
    "signal": "SIGUSR2",
    "iteration": 7,
    "job_id": "12",
    "restart_count": 0,
    "signal_at": 1764340000.5,
    "checkpoint_at": 1764340001.25,
    "checkpoint_s": 0.75,
    "why": "the job's time limit is near",
    "start": "12.0",
    "recovered_at": "2026-11-28T14:00:09+00:00",
    "recovery_s": 8.5,
    "resumed_from": 7,
    "recomputed": 0,
}
# A stop for good outside Slurm: no job, no signal time.
STOP_FOR_GOOD = {
    "reason": "terminated",
    "kind": "stop",
    "signal": "SIGTERM",
    "iteration": 9,
    "job_id": None,
    "restart_count": 0,
    "signal_at": None,
    "checkpoint_at": 1764340100.0,
    "checkpoint_s": 0.5,
}
# A crash healed in the allocation on fewer nodes, as launch/heal.py wrote it.
FAULT = {
    "reason": "crash",
    "error": "rank 1 on node2 ended without an exit record",
    "ranks": [1],
    "hosts": ["node2"],
    "iteration": 3,
    "job_id": "12",
    "restart_count": 1,
    "at": "2026-11-28T14:01:00+00:00",
    "at_s": 1764340060.0,
    "healed_at": "2026-11-28T14:01:02+00:00",
    "signature": "crash|rank # on node# ended without an exit record",
    "kind": "in-allocation",
    "action": "restarted without the queue after a crash (1 of 10)",
    "excluded_nodes": ["node2"],
    "straggler_nodes": ["node3"],
    "not_excluded": "node4 not excluded: no spare",
    "world_size": [4, 2],
}
# The fault rundir/state.py added when a node died before the ranks recorded anything.
NODE_LOST = {
    "reason": "node-lost",
    "kind": "requeue",
    "nodes": ["node[1-2]"],
    "job_id": "12",
    "restart_count": 1,
    "iteration": 5,
    "at": "2026-11-28T14:02:00",
    "at_s": 1764340120.0,
    "action": "requeued by Slurm (NODE_FAIL)",
}
FAILURE = {
    "kind": "crash",
    "error": "rank 1 on node2 ended without an exit record",
    "rank": 1,
    "host": "node2",
    "at": "2026-11-28T14:03:00+00:00",
}
STRAGGLER = {
    "rank": 1,
    "host": "node2",
    "busy_s": 0.5,
    "others_s": 0.25,
    "ratio": 2.0,
    "since": 4,
    "text": "rank 1 on node2 is 2.00x slower",
}


def main_record() -> dict[str, Any]:
    return json.loads(COMPLETED.read_text())


def healed_record() -> dict[str, Any]:
    """A run that stopped, crashed, lost a node and failed: every entry kind, as main wrote."""
    record = main_record()
    start = record["starts"][0]
    again = {**start, "job_id": "12", "restart_count": 1, "resumed_from_iteration": 7}
    again |= {"checkpoint": "model_7.pt", "environments": "restored"}
    again["changed"] = {"max_iterations": [2, 20], "world_size": [4, 2]}
    again["skipped_checkpoints"] = [{"name": "model_8.pt", "why": "torn"}]
    record |= {
        "state": "failed",
        "starts": [start, again],
        "job_ids": ["12"],
        "restarts": [STOP, STOP_FOR_GOOD],
        "faults": [FAULT, NODE_LOST],
        "failure": FAILURE,
        "stragglers": [STRAGGLER],
        "skipped_checkpoints": again["skipped_checkpoints"],
        "stopped_at": "2026-11-28T14:00:02+00:00",
        "damaged_records": ["run.json.damaged-20261128-140000"],
    }
    record["effective"]["motion_file"] = "/data/motion.npz"
    return record


def write(run: Path, value: object) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps(value))
    return run


@pytest.mark.parametrize("make", [main_record, healed_record])
def test_a_record_main_wrote_reads_and_writes_back_the_same_keys(tmp_path: Path, make: Any) -> None:
    before = make()
    record = read_record(write(tmp_path, before), strict=True)
    # The settings are a TrainSpec: those the record predates are written at their defaults.
    spec = {**TrainSpec().to_dict(), **before["spec"]}
    assert record.to_json() == {**before, "spec": spec, "schema": SCHEMA}
    assert record.schema is None  # written before the schema


def test_fields_of_a_healed_run(tmp_path: Path) -> None:
    record = read_record(write(tmp_path, healed_record()), strict=True)
    assert record.state is RunState.FAILED and record.state == "failed"
    assert record.effective.num_envs == 4 and record.effective.motion_file == "/data/motion.npz"
    assert record.last_start.checkpoint == "model_7.pt"
    assert record.last_start.skipped_checkpoints[0].why == "torn"
    assert isinstance(record.restarts[0], StopEntry) and record.restarts[0].start == "12.0"
    assert record.faults[0].world_size == (4, 2) and record.resized_by_healer(2)
    assert not record.resized_by_healer(3)
    assert record.failure == Failure(**FAILURE)
    assert record.stragglers[0].host == "node2"
    # Oldest first, stops and faults together.
    reasons = [e.reason for e in record.interruptions]
    assert reasons == ["time-limit", "crash", "terminated", "node-lost"]
    assert record.requeues_so_far() == {"time-limit": 1, "crash": 1, "node-lost": 1}


def test_older_records_read(tmp_path: Path) -> None:
    """What the code before the type tolerated: no kind on a stop, no effective, no starts'
    changes, nulls where a list belongs, a state and nothing else."""
    old = {
        "state": "stopped",
        "spec": {"task": "cartpole"},
        "restarts": [{"reason": "preemption", "iteration": 4, "signal_at": 1.0}],
        "starts": [{"job_id": "7", "at": "2025-01-01T00:00:00+00:00"}],
        "faults": None,
        "stragglers": None,
    }
    record = read_record(write(tmp_path / "a", old), strict=True)
    assert record.restarts[0].kind is None and record.restarts[0].restarted
    assert record.requeues_so_far() == {"preemption": 1}
    assert record.last_start.environments == "new" and record.last_start.changed == {}
    assert record.effective.num_envs is None and record.faults == ()
    assert read_record(write(tmp_path / "b", {"state": "running"})).state is RunState.RUNNING
    assert read_record(tmp_path / "none") == RunRecord()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda r: r.update(state="sleeping"), "its 'state' is \"sleeping\", not one of running"),
        (lambda r: r.update(starts=3), "its 'starts' is 3, not a list"),
        (lambda r: r["starts"][0].update(job_id=5), "its 'starts[0].job_id' is 5, not a string"),
        (lambda r: r.update(faults=[FAULT, 1]), "its 'faults[1]' is 1, not a JSON object"),
        (lambda r: r["effective"].update(num_envs="4"), "its 'effective.num_envs' is \"4\""),
        (lambda r: r.update(world_size=True), "its 'world_size' is true, not an integer"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(tmp_path: Path, change: Any, said: str) -> None:
    value = main_record()
    change(value)
    run = write(tmp_path, value)
    with pytest.raises(DamagedRecord) as raised:
        read_record(run, strict=True)
    assert said in str(raised.value) and str(run / "run.json") in str(raised.value)
    assert "\n" not in str(raised.value)
    assert read_record(run) == RunRecord()  # not strict: no record, no traceback
    fresh = read_record(run, set_aside=True)
    (kept,) = tmp_path.glob("run.json.damaged-*")
    assert fresh == RunRecord(damaged_records=(kept.name,)) and not (run / "run.json").exists()
    assert json.loads(kept.read_text()) == value


def test_each_event_is_a_new_record_and_the_old_one_stays(tmp_path: Path) -> None:
    empty = RunRecord()
    settings = {"spec": TrainSpec(max_iterations=2), "effective": {"num_envs": 4}}
    where = {"launch_mode": "slurm", "num_nodes": 2, "device": "cpu", "code": {}}
    first = on_start(
        empty, Start(job_id="12"), **settings, **where, world_size=4, code_dir=tmp_path
    )
    assert empty == RunRecord() and first.state is RunState.RUNNING
    assert first.job_ids == ("12",) and first.last_start.at and first.started_at
    stop = StopEntry(reason="time-limit", kind="requeue", job_id="12", restart_count=0)
    stopped = on_stop(first, stop)
    assert stopped.state is RunState.STOPPED and first.restarts == ()
    preempted = on_preempted(
        on_stop(first, StopEntry(reason="requeue", why="x", job_id="12", restart_count=0)),
        "12",
        1,
    )
    assert (preempted.restarts[0].reason, preempted.restarts[0].why) == ("preemption", None)
    # A stop recorded as its signal says, then as Slurm answered (rank/stop.py).
    asked = StopEntry(reason="preemption", kind="requeue", job_id="12", restart_count=0)
    answered = StopEntry(reason="node-lost", kind="requeue", nodes=("node2",), job_id="12")
    told = on_stop_answered(on_stop(stopped, asked), asked, answered)
    assert told.restarts == (stop, answered) and told.state is RunState.STOPPED
    assert on_stop_answered(stopped, asked, answered) == stopped  # not recorded: as it was
    lost = on_node_failed(stopped, "12", 1, iteration=5, nodes=["node1"], ended="2026-01-01T00:00")
    assert lost.restarts[0].reason == "time-limit"  # not a preemption: left as it is
    lost = on_node_failed(first, "12", 1, iteration=5, nodes=["node1"], ended="2026-01-01T00:00")
    assert lost.faults[0].reason == "node-lost" and lost.faults[0].nodes == ("node1",)
    later = {**settings, "spec": TrainSpec(max_iterations=9)}
    again = on_start(
        lost, Start(job_id="12", restart_count=1), **later, **where, world_size=2, code_dir=tmp_path
    )
    assert again.last_start.changed == {"max_iterations": [2, 9], "world_size": [4, 2]}
    assert again.job_ids == ("12",) and len(again.starts) == 2
    recovered = on_recovered(again, resumed_from=3)
    assert recovered.faults[0].recomputed == 2 and again.faults[0].recomputed is None
    crash = Interruption(reason="crash", kind="failed", error="boom", ranks=(1,), hosts=("n2",))
    failed = on_fault(recovered, crash, requeued=False, failure=Failure(kind="crash", rank=1))
    assert failed.state is RunState.FAILED and failed.failure == Failure(kind="crash", rank=1)
    assert on_fault(recovered, crash, requeued=True).state is RunState.REQUEUED
    done = on_end(again, 9)
    assert done.state is RunState.COMPLETED and done.iterations == 9
    # What is written reads back the same.
    write(tmp_path / "run", failed.to_json())
    assert read_record(tmp_path / "run", strict=True) == dataclasses.replace(failed, schema=SCHEMA)


@pytest.mark.parametrize(
    ("state", "shown"),
    [
        ("completed", "COMPLETED"),
        ("failed", "FAILED"),
        ("stopped", "STOPPED"),
        ("interrupted", "INTERRUPTED"),
        ("running", "LOST"),  # no writer holds it
        ("requeued", "UNKNOWN"),
    ],
)
def test_one_vocabulary_of_a_runs_state(tmp_path: Path, state: str, shown: str) -> None:
    value = copy.deepcopy(main_record())
    value["state"] = state
    assert record_state(write(tmp_path, value)).state == shown
    assert RunState(state).status_name(writer_alive=True) in (shown, "RUNNING", None)
    (tmp_path / CANCEL_RECORD).write_text(json.dumps({"starts": 1}))
    assert record_state(tmp_path).state == "CANCELLED"


def test_one_restart_count() -> None:
    """Every start after the first is a restart (a start that failed before its writer recorded
    it too: then the faults count); summary.json and status read this one count."""
    starts = tuple(Start(job_id="7", restart_count=n) for n in (0, 0, 1))
    hang = Interruption(reason="hang", kind="in-allocation", at_s=1.0)
    lost = StopEntry(reason="node-lost", kind="requeue", signal_at=2.0)
    given_up = Interruption(reason="crash", kind="failed", at_s=3.0)
    record = RunRecord(starts=starts, faults=(hang, given_up), restarts=(lost,))
    assert record.restarts_told() == (2, ("hang", "node-lost"))
    assert RunRecord(starts=starts[:1], faults=(hang,)).restarts_told() == (1, ("hang",))
    assert RunRecord().restarts_told() == (0, ())

"""The processes a run started on this machine, known from what the run recorded.

A local job's controller is recorded by the launcher that starts it
(`submitit/<pid>_controller.json`), each rank in its node's heartbeat
(`logs/heartbeat/node-<host>.json`, `rundir.liveness`): its pid, start time and machine
(`procs.ProcessId`). Each carries the run in its environment
(`RUN_ENV`), which is checked where it can be read (the user's own processes; root's).
Processes are never found by their command lines: one that merely names the run's folder in
its arguments (a teammate's `tail`, an editor) is none of the run's.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.procs import ProcessId, environ_value, owner
from mjlab_hpc.rundir.durable import read_regular, write_json_atomic
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import NodeBeat

__all__ = ["CONTROLLER_SUFFIX", "RUN_ENV", "RunProcess", "record_controller", "run_processes"]

#: In the environment of a local job's controller and ranks: the run directory they work for.
RUN_ENV = "_MJLAB_HPC_RUN_DIR"
#: `<pid>_controller.json` in the run's submitit folder: a local job's controller.
CONTROLLER_SUFFIX = "_controller.json"


@dataclass(frozen=True)
class RunProcess:
    """A live process of this machine that the run recorded as its own."""

    pid: int
    role: Literal["controller", "rank"]
    """controller: the local executor's (it restarts the ranks); rank: a training process."""
    uid: int
    """The user it runs as (the run directory's owner)."""


def record_controller(folder: Path, pid: int) -> None:
    """Record the local job controller `pid`, just started for the submitit `folder`.

    A record that cannot be written costs only `cancel`'s knowing it (its ranks record
    themselves): the job it started runs on.
    """
    started = ProcessId.of(pid)
    if started is not None:
        record = {**started.as_dict(), "run": str(folder.parent)}
        with contextlib.suppress(OSError):
            write_json_atomic(folder / f"{pid}{CONTROLLER_SUFFIX}", record)


def run_processes(run_dir: Path) -> list[RunProcess]:
    """The run's recorded processes that still run on this machine.

    A record counts only when the run's owner wrote it, and a process only when it is the
    very one recorded (pid and start time), runs as the run's owner and, where its
    environment can be read, works for this run.
    """
    run = RunDir(run_dir)
    try:
        uid = run_dir.stat().st_uid
        here = run_dir.resolve()
    except OSError:
        return []
    records: list[tuple[Literal["controller", "rank"], Path]] = [
        *(("controller", p) for p in sorted(run.submitit.glob(f"*{CONTROLLER_SUFFIX}"))),
        *(("rank", p) for p in run.node_beats()),
    ]
    found: dict[int, RunProcess] = {}
    for role, path in records:
        for process in _recorded(path, uid, role):
            if process.pid in found or not process.running() or owner(process.pid) != uid:
                continue
            works_for = environ_value(process.pid, RUN_ENV)
            if works_for is not None and (not works_for or Path(works_for).resolve() != here):
                continue
            found[process.pid] = RunProcess(process.pid, role, uid)
    return list(found.values())


def _recorded(path: Path, uid: int, role: str) -> list[ProcessId]:
    """The processes a record names: a controller's, or a node's ranks (none: a record
    another user planted, or no record of ours)."""
    try:
        if path.lstat().st_uid != uid:
            return []
        raw = read_regular(path, 1 << 20)
    except (OSError, ValueError):
        return []
    if role == "rank":
        beat = NodeBeat.parse(raw)
        return [b.process for b in beat.ranks if b.process is not None] if beat else []
    with contextlib.suppress(ValueError):
        data = json.loads(raw)
        process = ProcessId.parse(data) if isinstance(data, dict) else None
        return [process] if process is not None else []
    return []

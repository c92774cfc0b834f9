"""Teammates who share a log root (group-owned, setgid): each run stays its user's.

Real unprivileged users (mjlab-alice, mjlab-bob). No write of ours follows a link a teammate
planted in a run; the team's folders keep each run its user's (sticky, private runs, a latest
run and keys of one's own); `mjlab-hpc cancel` signals only the processes the run recorded.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BIN, Team, runs_under, wait_for, wait_for_iteration

from mjlab_hpc.errors import EXIT_OK
from mjlab_hpc.procs import alive
from mjlab_hpc.rundir.layout import GROUP_WRITABLE_ENV, RunDir
from mjlab_hpc.rundir.liveness import NodeBeat
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.rundir.running import run_processes

SMALL = ["--num-envs", "16", "--torch-threads", "1"]


def _train(logs: str) -> list[object]:
    """mjlab-train of a small cartpole into the team's log root `logs` (one per test: the
    team's folder is the session's)."""
    return [BIN / "mjlab-train", "cartpole", *SMALL, "--log-root", logs]


SECRET = b"# alice's own file: never written by a run\n" * 3


def _text(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


def _as(team: Team, user: str, *argv: object, umask: int = 0o022) -> None:
    """Run a shell command as `user`; it must succeed."""
    proc = team.run(user, ["bash", "-c", " ".join(map(str, argv))], umask=umask)
    assert proc.returncode == 0, _text(proc)


def _secret(team: Team, name: str) -> Path:
    """A file of alice's outside every run (her home), with known bytes."""
    path = team.base / "home" / Team.USERS[0] / name
    path.write_bytes(SECRET)
    shutil.chown(path, user=Team.USERS[0], group=Team.GROUP)
    return path


def _durable_as(team: Team, user: str, code: str) -> subprocess.CompletedProcess[str]:
    """Python `code` run as `user` with mjlab_hpc.rundir.durable imported (d)."""
    script = f"from pathlib import Path\nimport mjlab_hpc.rundir.durable as d\n{code}"
    return team.run(user, [sys.executable, "-c", script])


def test_every_write_primitive_refuses_a_teammates_link(team: Team) -> None:
    """In a folder of alice's that bob may write (a run kept group-writable), bob's links at
    the names alice writes, and bob's link in place of a folder on the way: every write of
    alice is refused with a line naming the link, or replaces the link itself; her files
    outside stay byte for byte; temporaries are fresh names nobody could plant."""
    alice, bob = Team.USERS
    run = team.shared / "run"
    _as(team, alice, "mkdir -p", run / "logs/heartbeat", "&& chmod -R g+w", run, umask=0o002)
    bashrc = _secret(team, ".bashrc")
    for name in ("reserve", "log", "replaced", "fresh"):
        _as(team, bob, "ln -s", bashrc, run / name)
    heartbeats = run / "logs/heartbeat"
    _as(team, bob, "mv", heartbeats, run / "logs/old", "&& ln -s", bashrc.parent, heartbeats)
    refused = _durable_as(
        team,
        alice,
        f"""
run = Path({str(run)!r})
for call in (
    lambda: d.reserve(run / "reserve", 1 << 20),
    lambda: d.append(run / "log", b"line"),
    lambda: d.open_append(run / "log"),
    lambda: d.write_atomic(run / "logs/heartbeat/.bashrc", b"beat"),
    lambda: d.create_exclusive(run / "logs/heartbeat/key", b"x"),
):
    try:
        call()
        print("WROTE")
    except d.LinkRefused as exc:
        print(exc)
d.write_atomic(run / "replaced", b"new")
print("exclusive", d.create_exclusive(run / "fresh", b"x"))
print("temp", d.temp_path(run / "x").name, d.temp_path(run / "x").name)
""",
    )
    said = refused.stdout.splitlines()
    assert refused.returncode == 0 and "WROTE" not in said, _text(refused)
    assert said[:3] == [
        f"{run}/{name}: is a symbolic link of {bob} (-> {bashrc}): refused, a write never "
        "follows a link out of the run directory; remove the link"
        for name in ("reserve", "log", "log")
    ], said
    for line in said[3:5]:
        assert line.startswith(f"{run}/logs/heartbeat: a folder on the way is a symbolic link")
        assert f"of {bob} (heartbeat -> {bashrc.parent})" in line, line
    # A rename replaces the link, never what it points to; a name taken is not ours.
    assert (run / "replaced").read_bytes() == b"new" and not (run / "replaced").is_symlink()
    assert said[5] == "exclusive False"
    first, second = said[6].split()[1:]
    assert first != second and len(first.rsplit(".", 2)[-2]) == 16  # 64 random bits
    assert bashrc.read_bytes() == SECRET
    assert not list(bashrc.parent.glob(".*.tmp"))


@pytest.mark.training
def test_a_continuation_writes_nothing_through_planted_links(team: Team) -> None:
    """alice keeps her run group-writable (the documented opt-in); bob plants links to her
    files at the names her continuation writes or replaces. It completes, the reserve's
    refusal said; the files they point to are unchanged. Links at the rank log and
    progress.jsonl (written in place) stop the next start with a line naming the link."""
    alice, bob = Team.USERS
    opt_in = {GROUP_WRITABLE_ENV: "1"}
    logs, train = team.shared / "kept-open", _train("kept-open")
    first = team.run(alice, [*train, "--max-iterations", "1"], umask=0o002, extra=opt_in)
    assert first.returncode == 0, _text(first)
    (run,) = runs_under(logs)
    assert run.stat().st_mode & stat.S_IWGRP  # as her umask says: she opted in
    bashrc = _secret(team, ".bashrc")
    planted = {
        ".writer.reserve": bashrc,
        "summary.json": _secret(team, "summary"),
        "model_2.pt": _secret(team, "model"),
        "model_2.pt.sha256": _secret(team, "sidecar"),
        str(RunDir(run).node_beat(socket.gethostname()).relative_to(run)): _secret(team, "beat"),
    }
    for name, target in planted.items():
        _as(team, bob, "rm -f", run / name, "&& ln -s", target, run / name)
    resume = [*train, "--max-iterations", "2", "--resume"]
    second = team.run(alice, resume, umask=0o002, extra=opt_in)
    assert second.returncode == 0 and "done: 2 iterations" in second.stdout, _text(second)
    log = (run / "logs" / "rank0.log").read_text()
    assert f"no space reserved for the run's last records: {run}/.writer.reserve: is a " in log
    assert read_record(run).iterations == 2 and RunDir(run).checkpoint(2).is_file()
    for target in planted.values():
        assert target.read_bytes() == SECRET, target

    for name in ("logs/rank0.log", "progress.jsonl"):
        _as(team, bob, "mv", run / name, run / f"{name}.old", "&& ln -s", bashrc, run / name)
    third = team.run(alice, [*train, "--max-iterations", "3", "--resume"], extra=opt_in)
    said = _text(third)
    assert third.returncode != EXIT_OK and "Traceback" not in said, said
    assert f"{run}/logs/rank0.log: is a symbolic link of {bob} (-> {bashrc}): refused" in said
    assert bashrc.read_bytes() == SECRET


@pytest.mark.training
def test_a_team_log_root_keeps_each_run_its_users(team: Team) -> None:
    """alice's run in the team's root (umask 002): the folders are the team's but sticky, her
    run is hers alone. bob can neither rename it nor remove her latest-run record; his newer
    run is not what her --resume continues; a key bob planted, or one naming his run, is
    refused to her with a line."""
    alice, bob = Team.USERS
    logs, train = team.shared / "own", _train("own")
    mine = team.run(alice, [*train, "--max-iterations", "1"], umask=0o002)
    assert mine.returncode == 0, _text(mine)
    (run,) = runs_under(logs)
    experiment = run.parent
    for folder in (experiment, experiment / ".keys"):
        if folder.exists():
            mode = folder.stat().st_mode
            assert mode & stat.S_IWGRP and mode & stat.S_ISVTX, (folder, oct(mode))
    assert not run.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), oct(run.stat().st_mode)
    assert not (run / "logs").stat().st_mode & stat.S_IWGRP  # nor what the run made in it
    record = experiment / f".latest_run.{pwd.getpwnam(alice).pw_uid}"
    assert record.read_text() == f"{run.name}\n"
    for attack in (f"mv {run} {run}-x", f"rm -f {record}", f"touch {run}/planted"):
        refused = team.run(bob, ["bash", "-c", attack])
        err = refused.stderr
        assert refused.returncode != 0, attack
        assert "Operation not permitted" in err or "Permission denied" in err, err
    assert run.is_dir() and record.exists()

    theirs = team.run(bob, [*train, "--max-iterations", "1"], umask=0o002)
    assert theirs.returncode == 0, _text(theirs)
    (bobs,) = [r for r in runs_under(logs) if r != run]
    record.unlink()  # even without her record: her newest run, never bob's
    resumed = team.run(alice, [*train, "--max-iterations", "2", "--resume"], umask=0o002)
    assert resumed.returncode == 0, _text(resumed)
    assert read_record(run).iterations == 2 and read_record(bobs).iterations == 1

    key = [BIN / "mjlab-hpc", "run-dir", "--log-root", logs, "--experiment", "cartpole"]
    keys = experiment / ".keys"
    first = team.run(alice, [*key, "--key", "slurm-40"])  # her own key: the team's folder
    assert first.returncode == EXIT_OK and first.stdout.strip().startswith(str(experiment))
    assert keys.stat().st_mode & stat.S_ISVTX and keys.stat().st_mode & stat.S_IWGRP
    _as(team, bob, "echo", bobs.name, ">", keys / "slurm-41")
    _as(team, alice, "echo", bobs.name, ">", experiment / ".keys/slurm-42")
    for job, why in (("41", f"it was written by {bob}"), ("42", f"it names a run of {bob}")):
        lookup = team.run(alice, [*key, "--key", f"slurm-{job}"])
        said = _text(lookup)
        assert lookup.returncode != EXIT_OK and str(bobs) not in lookup.stdout, said
        assert f".keys/slurm-{job} is damaged ({why}, not {alice})" in said, said
        assert "Traceback" not in said


@pytest.mark.training
def test_cancel_signals_only_the_runs_recorded_processes(team: Team) -> None:
    """bob runs a process whose arguments name alice's run folder (as the old command-line
    match looked for). alice's cancel stops her run, not refused for bob's process; root's
    cancel afterwards does not touch bob's process either."""
    alice, bob = Team.USERS
    submit = [BIN / "mjlab-submit", "cartpole", "--executor", "local", "--gpus-per-node", "0"]
    submit += [*SMALL, "--max-iterations", "100000", "--log-root", "cancelled"]
    start = team.run(alice, submit, umask=0o002)
    assert start.returncode == 0, _text(start)
    run = wait_for_iteration(team.shared / "cancelled", 1, timeout=400).path
    recorded = run_processes(run)
    assert sorted(p.role for p in recorded) == ["controller", "rank"], recorded
    folder = str(run / "submitit")
    decoy = subprocess.Popen(
        team.argv(bob, [sys.executable, "-c", "import time; time.sleep(300)", folder, run]),
        env=team.env(bob),
        cwd=team.shared,
    )
    try:
        wait_for(lambda: alive(decoy.pid), 10, "bob's process")
        cancel = team.run(alice, [BIN / "mjlab-hpc", "cancel", run, "--grace-s", "60"])
        said = _text(cancel)
        assert cancel.returncode == EXIT_OK and "no process left" in said, said
        assert "run by" not in said
        assert decoy.poll() is None and run_processes(run) == []
        assert not any(alive(p.pid) for p in recorded)
        again = subprocess.run(
            [BIN / "mjlab-hpc", "cancel", run], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == EXIT_OK and "no process left to stop" in again.stdout
        assert decoy.poll() is None
        # What a rank is known by: its node's heartbeat's pid, start time and machine.
        (beats,) = RunDir(run).node_beats()
        beat = NodeBeat.parse(beats.read_bytes())
        assert beat is not None and [b.rank for b in beat.ranks] == [0], beat
        assert beat.ranks[0].process is not None, beat
    finally:
        os.kill(decoy.pid, signal.SIGKILL)
        decoy.wait()


class _Planted:
    """What a teammate pickles into a run's submitit folder: unpickling it runs a command."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.proof}",))


def test_a_planted_submitit_result_is_read_as_data(tmp_path: Path) -> None:
    """A result pickle in the run's folder never runs code: what it names stays inert, while
    submitit's own ("error", traceback) and ("success", dict) results read as ever."""
    import pickle
    from types import SimpleNamespace

    from mjlab_hpc.launch.executors import task_outcome

    proof = tmp_path / "ran"
    task = SimpleNamespace(paths=SimpleNamespace(result_pickle=tmp_path / "0_0_result.pkl"))
    for outcome in (("success", _Planted(proof)), ("success", [_Planted(proof)]), _Planted(proof)):
        task.paths.result_pickle.write_bytes(pickle.dumps(outcome))
        got = task_outcome(task)
        assert not proof.exists()
        assert got is None or got[0] == "success", got
    for outcome in (("error", "Traceback ...\nValueError: no"), ("success", {"requeued": True})):
        task.paths.result_pickle.write_bytes(pickle.dumps(outcome))
        assert task_outcome(task) == outcome
    task.paths.result_pickle.unlink()
    task.paths.result_pickle.symlink_to(proof)
    assert task_outcome(task) is None


def test_a_local_jobs_failures_come_from_its_results_as_data(tmp_path: Path) -> None:
    """A real submitit job's results, read without unpickling what they name: a rank that
    raised is named with its exception's line; one that returned is not a failure."""
    import submitit

    from mjlab_hpc.launch.local import rank_failures

    executor = submitit.LocalExecutor(tmp_path)
    failed, succeeded = executor.submit(int, "not a number"), executor.submit(dict, a=1)
    for job in (failed, succeeded):
        job.wait()
    (line,) = rank_failures(failed, 1)
    assert line.startswith("rank 0 failed: ValueError: invalid literal for int()"), line
    assert rank_failures(succeeded, 1) == []

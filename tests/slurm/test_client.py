"""The Slurm client with stand-in commands (the fast tier).

Covers how squeue and sacct answers merge, when a requeue is refused, and that a hanging
command is killed and counts as no answer. The real Slurm is used by the cluster tests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mjlab_hpc.procs import alive
from mjlab_hpc.slurm import client
from mjlab_hpc.slurm.client import SlurmClient


def stand_ins(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH starts with stand-ins for some Slurm commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_query_prefers_squeue_while_running_and_sacct_for_the_end(tmp_path: Path) -> None:
    env = stand_ins(
        tmp_path,
        squeue='echo "7|7|N/A|7|RUNNING|2|node[1-2]|gres/gpu:4|None"\n'
        'echo "8|8|N/A|8|COMPLETING|1|node1||None"\n',
        sacct='echo "7|7|PENDING|2|||None"\necho "8|8|CANCELLED by 0|1|gres/gpu=4|node1|None"\n'
        'echo "9|9|COMPLETED|1||node2|None"\n',
    )
    rows, accounting = SlurmClient(env=env).query(["7", "8", "9", "10"])
    assert accounting
    assert (rows["7"].state, rows["7"].source, rows["7"].gpus_per_node) == ("RUNNING", "squeue", 4)
    assert (rows["8"].state, rows["8"].source, rows["8"].gpus_per_node) == ("CANCELLED", "sacct", 4)
    assert rows["9"].state == "COMPLETED" and "10" not in rows


def test_query_without_accounting(tmp_path: Path) -> None:
    env = stand_ins(
        tmp_path,
        squeue='echo "7|7|N/A|7|RUNNING|1|node1||None"\n',
        sacct='echo "accounting storage is disabled" >&2; exit 1\n',
    )
    rows, accounting = SlurmClient(env=env).query(["7"])
    assert not accounting and rows["7"].state == "RUNNING"


def test_requeue_only_a_running_job(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    env = stand_ins(
        tmp_path,
        scontrol=f'echo "$@" >> {log}\n'
        'if [ "$1 $2" = "show job" ]; then echo "JobId=$3 JobState=$STATE Restarts=0"; fi\n',
    )
    assert SlurmClient(env={**env, "STATE": "CANCELLED"}).requeue("5")  # left cancelled
    assert "requeue" not in log.read_text()
    assert SlurmClient(env={**env, "STATE": "RUNNING"}).requeue("5")
    assert log.read_text().splitlines()[-1] == "requeue 5"


def test_a_hanging_command_is_no_answer_and_is_killed(tmp_path: Path) -> None:
    env = stand_ins(tmp_path, squeue=f"echo $$ > {tmp_path / 'pid'}\nexec sleep 60\n")
    t0 = time.monotonic()
    assert SlurmClient(env=env, timeout_s=0.5).squeue(["1"]) is None
    assert time.monotonic() - t0 < 10
    assert not alive(int((tmp_path / "pid").read_text()))
    assert SlurmClient(env={**env, "PATH": str(tmp_path / "empty")}).sacct(["1"]) is None


def test_arrays_are_asked_by_their_id_in_chunks_and_folded_rows_unfold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elements `9_0..9_5` are one id (`9`) on the command line; ids go QUERY_CHUNK per call;
    sacct's one row for elements that never started (`9_[3-5%2]`) answers for each of them."""
    log = tmp_path / "calls"
    env = stand_ins(
        tmp_path,
        squeue=f'echo "squeue $@" >> {log}\necho "9_0|9|0|10|RUNNING|1|node1||None"\n',
        sacct=f'echo "sacct $@" >> {log}\necho "9_0|10|RUNNING|1||node1|None"\n'
        'echo "9_[3-5%2]|9|PENDING|1|||None"\n',
    )
    monkeypatch.setattr(client, "QUERY_CHUNK", 2)
    ids = [f"9_{i}" for i in range(6)] + ["11", "12", "13"]
    rows = SlurmClient(env=env).query(ids)[0]
    assert rows["9_0"].state == "RUNNING" and rows["9_0"].source == "squeue"
    assert [rows[f"9_{i}"].state for i in (3, 4, 5)] == ["PENDING"] * 3
    assert "9_1" not in rows and "11" not in rows
    asked = [line.split(" -j ")[1].split()[0] for line in log.read_text().splitlines()]
    assert asked == ["11,12", "13,9", "11,12", "13,9"]  # squeue twice, then sacct twice


def test_squeue_failing_is_no_answer_but_unknown_ids_are_an_answer(tmp_path: Path) -> None:
    down = stand_ins(
        tmp_path,
        squeue="echo 'Unable to contact slurm controller' >&2; exit 1\n",
        sacct='echo "7|7|COMPLETED|1||node1|None"\n',
    )
    got = SlurmClient(env=down).answer(["7"])
    assert not got.queue and got.accounting and got.rows["7"].source == "sacct"
    forgot = stand_ins(tmp_path, squeue="echo 'Invalid job id specified' >&2; exit 1\n")
    assert SlurmClient(env=forgot).answer(["7"]).queue


# What Slurm 22.05's clients print with slurmctld stopped (tests/cluster/cluster.sh ctld-stop).
AWAY = "Unable to contact slurm controller (connect failure)"


@pytest.mark.parametrize(
    ("said", "away"),
    [
        (f"slurm_load_jobs error: {AWAY}", True),
        (f"srun: error: Unable to confirm allocation for job 7: {AWAY}", True),
        ("Unexpected message received for job 5", True),  # scontrol requeue, slurmctld stopped
        (
            "srun: error: Unable to create step for job 7: Socket timed out on send/recv operation",
            True,
        ),
        ("scontrol: error: Invalid job id specified", False),
        ("sbatch: error: Batch job submission failed: Invalid account", False),
        ("", False),
    ],
)
def test_controller_unreachable_is_told_from_a_refusal(said: str, away: bool) -> None:
    assert client.controller_unreachable(said) is away


def test_retry_bound_from_the_environment() -> None:
    assert client.retry_s({}) == client.RETRY_S == 180
    assert client.retry_s({client.RETRY_ENV: "30"}) == 30
    assert client.retry_s({client.RETRY_ENV: "0"}) == 0
    assert client.retry_s({client.RETRY_ENV: "soon"}) == client.RETRY_S


def test_a_command_is_tried_again_while_slurmctld_is_away(tmp_path: Path) -> None:
    """With retry_s, a command that needs slurmctld is tried again until it answers; without,
    it answers at once and later ones do not wait either; sbatch is never tried twice."""
    tries = tmp_path / "tries"
    away = (
        f'echo x >> {tries}\nif [ $(wc -l < {tries}) -lt 3 ]; then echo "{AWAY}" >&2; exit 1; fi\n'
    )
    env = stand_ins(tmp_path, scontrol=away + 'echo "JobId=$3 JobState=RUNNING"\n', sbatch=away)
    t0 = time.monotonic()
    assert SlurmClient(env=env, retry_s=30).job_state("5") == "RUNNING"
    assert len(tries.read_text().split()) == 3 and time.monotonic() - t0 < 10  # pauses 1 s, 2 s
    tries.unlink()
    once = SlurmClient(env=env)
    assert once.job_state("5") is None and once.unreachable
    assert once.job_state("5") is None and len(tries.read_text().split()) == 1  # not asked again
    tries.unlink()
    gave_up = SlurmClient(env=env, retry_s=0.5)
    assert gave_up.job_state("5") is None and len(tries.read_text().split()) == 2
    tries.unlink()
    assert SlurmClient(env=env, retry_s=30).sbatch(["x.sh"])[0] is None
    assert len(tries.read_text().split()) == 1

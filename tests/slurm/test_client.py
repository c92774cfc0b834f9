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

# The header lines Slurm prints above its rows (22.05 and 24.11 alike).
SQ = 'echo "JOBID|ARRAY_JOB_ID|ARRAY_TASK_ID|JOBID|STATE|NODES|NODELIST|TRES_PER_NODE|REASON"\n'
SA = 'echo "JobID|JobIDRaw|State|NNodes|AllocTRES|NodeList|Reason"\n'


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
        squeue=SQ + 'echo "7|7|N/A|7|RUNNING|2|node[1-2]|gres/gpu:4|None"\n'
        'echo "8|8|N/A|8|COMPLETING|1|node1||None"\n',
        sacct=SA + 'echo "7|7|PENDING|2|||None"\n'
        'echo "8|8|CANCELLED by 0|1|gres/gpu=4|node1|None"\n'
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
        squeue=SQ + 'echo "7|7|N/A|7|RUNNING|1|node1||None"\n',
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
        squeue=f'echo "squeue $@" >> {log}\n' + SQ + 'echo "9_0|9|0|10|RUNNING|1|node1||None"\n',
        sacct=f'echo "sacct $@" >> {log}\n' + SA + 'echo "9_0|10|RUNNING|1||node1|None"\n'
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
        sacct=SA + 'echo "7|7|COMPLETED|1||node1|None"\n',
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


def test_rows_are_read_by_their_header_and_a_bad_row_is_named_not_a_crash(tmp_path: Path) -> None:
    """Columns in another order (a version that moves them) are read by name; forged or
    broken values (a huge count, a date past any job, a NaN, a control character, a row
    with a field too many) leave that row out, named, and the other rows are read."""
    header = 'echo "NNodes|State|Reason|JobIDRaw|NodeList|AllocTRES|JobID|Extra"\n'
    rows = [
        "2|RUNNING|None|7|node[1-2]|gres/gpu=8|7|x",  # moved columns, one more: read
        "99999999999999999999|RUNNING|None|8|node1||8|x",  # a count past any cluster
        "1|RUNNING|None|9|node1||9|x|y",  # a field too many (a `|` in a value)
        "1|running now|None|10|node1||10|x",  # not a state
        "1|RUNNING|None|11|node\x01||11|x",  # a control character
        "1|RUNNING|None|12;rm|node1||12;rm|x",  # not a job id
    ]
    body = header + "".join(f"printf '%b\\n' '{r}'\n" for r in rows)
    slurm = SlurmClient(env=stand_ins(tmp_path, sacct=body))
    (row,) = slurm.sacct(["7"]) or []
    assert (row.job_id, row.nodes, row.gpus_per_node, row.node_list) == ("7", 2, 4, "node[1-2]")
    assert len(slurm.bad_rows) == 5, slurm.bad_rows
    for said, why in zip(
        slurm.bad_rows,
        ("NNodes", "fields, the header has", "not a state", "not printable", "not a job id"),
        strict=True,
    ):
        assert said.startswith("sacct: line ") and why in said, said
    usage = "|".join(client._USAGE)
    times = "2026-11-29T10:00:00|2026-11-29T10:00:00|2026-11-29T10:00:01"
    bad_usage = [
        f"7|COMPLETED|{times}|2026-11-29T10:01:01|60|00:00:00|1|1||00:01|1K|",
        f"8|COMPLETED|{times}|9999-01-01T00:00:00|60|00:00:00|1|1||00:01|1K|",  # a far end
        f"9|COMPLETED|{times}|2026-11-29T10:01:01|nan|00:00:00|1|1||00:01|1K|",  # NaN
        f"10|COMPLETED|{times}|2026-11-29T10:01:01|60|00:00:00|1|1||00:01|1e400K|",
    ]
    body = f'echo "{usage}"\n' + "".join(f"echo '{r}'\n" for r in bad_usage)
    slurm = SlurmClient(env=stand_ins(tmp_path, sacct=body))
    assert [u.job_id for u in slurm.usage(["7"]) or []] == ["7"]
    assert len(slurm.bad_rows) == 3 and all("left out" in b for b in slurm.bad_rows)
    # A user's SLURM_TIME_FORMAT (`relative`: "Tomorr 12:00") does not reach our sacct.
    relative = bad_usage[0].replace("2026-11-29T10:01:01", "Tomorr 12:00")
    body = f'echo "{usage}"\nif [ "$SLURM_TIME_FORMAT" = standard ]; then '
    body += f"echo '{bad_usage[0]}'; else echo '{relative}'; fi\n"
    env = {**stand_ins(tmp_path, sacct=body), "SLURM_TIME_FORMAT": "relative"}
    (row,) = SlurmClient(env=env).usage(["7"]) or [None]
    assert row is not None and row.end is not None and row.end - (row.start or 0) == 60, row
    # A header without a column asked for: every row left out, named once.
    slurm = SlurmClient(env=stand_ins(tmp_path, sacct='echo "JobID|State"\necho "7|RUNNING"\n'))
    assert slurm.sacct(["7"]) == [] and "no column JobIDRaw" in slurm.bad_rows[0]

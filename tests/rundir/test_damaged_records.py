"""Damaged records in a run directory, met as a user meets them (issue 35, classes 2 and 7).

The cases: a run.json that is valid JSON but not an object, or not JSON; a `.latest_run`
pointer that is empty or binary; a checksum sidecar that holds no checksum; a temporary file
of a writer killed mid-write; two trainings into one run directory. One real cartpole run (a
few iterations) is trained once and copied for each case.

No command ends in a traceback, and a damaged run never hides the others from status. A
damaged record is named with its path and what to do, and nothing damaged is overwritten
without being kept.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, clock_ahead, progress_records, wait_for

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_OK
from mjlab_hpc.rundir.checkpoint import Checkpoints
from mjlab_hpc.rundir.layout import RunDir, latest_run_record
from mjlab_hpc.rundir.lock import LeaseLock
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.training

TRAIN = [str(BIN / "mjlab-train"), "cartpole", "--num-envs", "4", "--torch-threads", "1"]
HPC = str(BIN / "mjlab-hpc")


def run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log root holding one completed cartpole run of 2 iterations."""
    root = tmp_path_factory.mktemp("trained")
    args = ["--max-iterations", "2", "--save-interval", "1", "--log-root", "logs"]
    proc = run([*TRAIN, *args], root)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    return root / "logs"


def two_runs(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the log root with two runs of cartpole: (healthy, to be damaged)."""
    logs = tmp_path / "logs"
    shutil.copytree(trained, logs)
    healthy = next(p for p in (logs / "cartpole").iterdir() if not p.name.startswith("."))
    other = healthy.with_name(healthy.name + "_b")
    shutil.copytree(healthy, other)
    return healthy, other


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"a string"', '{"starts": 3}', "{not json"])
def test_a_damaged_run_record_is_named_and_hides_no_other_run(
    trained: Path, tmp_path: Path, content: str
) -> None:
    healthy, damaged = two_runs(trained, tmp_path)
    (damaged / "run.json").write_text(content)
    table = run([HPC, "status", "--log-root", "logs"], tmp_path)
    assert table.returncode == 0 and "Traceback" not in table.stderr, table.stderr
    listed = run([HPC, "status", "--json", "--log-root", "logs"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {Path(r["run_dir"]).name: r for r in json.loads(listed.stdout)}
    assert rows[healthy.name]["state"] == "COMPLETED"
    assert rows[damaged.name]["state"] == "DAMAGED"
    assert str(damaged / "run.json") in rows[damaged.name]["cause"]
    assert "DAMAGED" in table.stdout and healthy.name in table.stdout
    logs = run([HPC, "logs", str(damaged)], tmp_path)
    assert "Traceback" not in logs.stderr and "run.json is damaged" in logs.stdout, logs.stderr


def test_a_resume_keeps_a_damaged_run_record_and_removes_a_dead_writers_temporary(
    trained: Path, tmp_path: Path
) -> None:
    _, damaged = two_runs(trained, tmp_path)
    before = (damaged / "run.json").read_text()
    (damaged / "run.json").write_text(before[: len(before) // 2])  # torn
    # A writer killed while writing a sidecar leaves its temporary file behind.
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    stale = damaged / f".model_2.pt.sha256.{dead.pid}.0123abcd.tmp"
    stale.write_text("half")
    proc = run([*TRAIN, "--max-iterations", "3", "--run-dir", str(damaged)], tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    kept = list(damaged.glob("run.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_text() == before[: len(before) // 2]
    record = read_record(damaged, strict=True)
    assert record.state == "completed" and record.damaged_records == (kept[0].name,)
    assert not stale.exists()
    assert not list(damaged.glob(".*.tmp"))


@pytest.mark.parametrize("content", [b"", b"\n", b"\xff\xfe\x00binary", b".", b"a\nb"])
def test_a_damaged_latest_run_pointer_is_refused_naming_it(
    trained: Path, tmp_path: Path, content: bytes
) -> None:
    shutil.copytree(trained, tmp_path / "logs")
    pointer = latest_run_record(tmp_path / "logs" / "cartpole")
    pointer.write_bytes(content)
    entries = sorted(p.name for p in pointer.parent.iterdir())
    proc = run([*TRAIN, "--max-iterations", "3", "--resume", "--log-root", "logs"], tmp_path)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert said.startswith("error: --resume:"), said
    assert f"logs/cartpole/{pointer.name} is damaged" in said
    assert "--run-dir" in said
    assert "Traceback" not in proc.stderr
    # Nothing trained in the experiment folder itself, nothing new beside the runs.
    assert sorted(p.name for p in pointer.parent.iterdir()) == entries
    assert not list(pointer.parent.glob("model_*.pt"))


def test_a_damaged_sidecar_condemns_no_valid_checkpoint(trained: Path, tmp_path: Path) -> None:
    healthy, _ = two_runs(trained, tmp_path)
    newest = RunDir(healthy).checkpoints()[-1]
    sidecar = newest.with_name(newest.name + ".sha256")
    for damage in (b"", b"\x00" * 65, b"not a checksum\n"):
        sidecar.write_bytes(damage)
        assert Checkpoints(healthy).problem(newest) is None
    sidecar.write_text("0" * 64 + "\n")  # a checksum, and not this file's: the file is suspect
    assert "does not match" in str(Checkpoints(healthy).problem(newest))


def test_the_writer_locks_token_files_are_not_executable(tmp_path: Path) -> None:
    lock = LeaseLock(tmp_path / ".writer.lock", lease_s=5.0)
    lock.acquire(timeout_s=5)
    lock.release()
    tokens = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert tokens and all(p.stat().st_mode & 0o111 == 0 for p in tokens), tokens


def test_a_second_training_into_a_running_run_is_refused_at_once(
    trained: Path, tmp_path: Path
) -> None:
    """Refused whatever the second one's clock says (an hour ahead, faketime): a live writer
    on this machine is never displaced, nor its run resumed."""
    healthy, _ = two_runs(trained, tmp_path)
    first = subprocess.Popen(
        [*TRAIN, "--max-iterations", "5000", "--run-dir", str(healthy)],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(progress_records(RunDir(healthy))) > 3, 150, "the first training")
        for ahead in ([], clock_ahead("+1h")):
            began = time.monotonic()
            resume = ["--max-iterations", "5000", "--run-dir", str(healthy), "--resume"]
            second = run([*ahead, *TRAIN, *resume], tmp_path)
            took = time.monotonic() - began
            said = " ".join(second.stderr.split())
            assert second.returncode == EXIT_BAD_INPUT, second.stderr[-2000:]
            assert "another training is writing" in said and "done:" not in second.stdout, said
            assert "Traceback" not in second.stderr
            assert took < 30, took  # refused before torch loads, not after the first ends
            assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)

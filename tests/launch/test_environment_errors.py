"""Environment problems, met as a user meets them.

The cases: a log root that is a file or read-only, a folder of other files as --run-dir,
resources this machine does not have, a name too long for the filesystem, an unwritable plot,
and a disk that fills up during training. Each gives one clear line naming the flag or path
and the fix, no traceback and the documented exit code. Nothing half-written is left behind
(run.json never stuck at "running").
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run, progress_records

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_FAILED
from mjlab_hpc.rank.context import cuda_device_count
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.validate.world import usable_cores

TRAIN = [BIN / "mjlab-train", "cartpole", "--num-envs", "16", "--torch-threads", "1"]
LOCAL = [BIN / "mjlab-submit", "cartpole", "--executor", "local", "--num-envs", "16"]


def refused(args: list[object], flag: str, words: str, cwd: Path) -> None:
    """Exit 2, one `error: <flag>: ...` line holding `words`, no traceback."""
    proc = subprocess.run(
        [str(a) for a in args], env=cli_env(), cwd=cwd, capture_output=True, text=True, timeout=120
    )
    said = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_BAD_INPUT, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert said.startswith(f"error: {flag}:") and words in said, said
    assert "Traceback" not in proc.stderr


def test_a_log_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for cmd in (TRAIN, [*LOCAL, "--gpus-per-node", "0"]):
        refused([*cmd, "--log-root", "afile"], "--log-root", "is a file, not a folder", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_read_only_log_root(mount_tmpfs: Callable[[str, str], Path], tmp_path: Path) -> None:
    ro = mount_tmpfs("ro", "ro,size=64k")
    refused([*TRAIN, "--log-root", ro / "logs"], "--log-root", "read-only filesystem", tmp_path)
    refused(
        [*LOCAL, "--gpus-per-node", "0", "--log-root", ro / "logs"],
        "--log-root",
        "read-only filesystem",
        tmp_path,
    )


def test_a_folder_of_other_files_is_no_run_directory(tmp_path: Path) -> None:
    junk = tmp_path / "thesis"
    junk.mkdir()
    (junk / "chapter1.tex").write_text("x")
    refused([*TRAIN, "--run-dir", junk], "--run-dir", "holds files but no run", tmp_path)
    assert [p.name for p in junk.iterdir()] == ["chapter1.tex"]


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--gpus-per-node", "99"], "--gpus-per-node", "99 GPU(s) per node asked for"),
        (["--gpus-per-node", "0", "--tasks-per-node", "64"], "--tasks-per-node", "--oversubscribe"),
    ],
)
def test_local_jobs_ask_for_what_this_machine_has(
    tmp_path: Path, args: list[str], flag: str, words: str
) -> None:
    if flag == "--gpus-per-node" and cuda_device_count() >= 99:
        pytest.fail("a machine with 99 GPUs: pick a larger number")
    if flag == "--tasks-per-node" and usable_cores() >= 64:
        pytest.fail("a machine with 64 cores: pick a larger number")
    refused([*LOCAL, *args, "--log-root", "logs"], flag, words, tmp_path)
    assert not any(tmp_path.iterdir())  # no run directory, no process started


def test_more_cpu_ranks_than_cores_and_cuda_without_a_gpu(tmp_path: Path) -> None:
    many = usable_cores() + 1
    refused(
        [*TRAIN, "--num-procs", many, "--log-root", "logs"],
        "--num-procs",
        f"{many} ranks on a machine with {many - 1} usable cores",
        tmp_path,
    )
    if cuda_device_count() == 0:  # the check a GPU machine passes
        refused(
            [*TRAIN, "--device", "cuda", "--log-root", "logs"],
            "--device",
            "use --device cpu",
            tmp_path,
        )
    assert not any(tmp_path.iterdir())


def test_a_run_name_too_long_for_the_filesystem(tmp_path: Path) -> None:
    """Refused by the real run as by the dry run, before any folder exists."""
    name = "r" * 300
    refused([*TRAIN, "--run-name", name, "--log-root", "logs"], "--run-name", "too long", tmp_path)
    refused(
        [*LOCAL, "--gpus-per-node", "0", "--run-name", name, "--log-root", "logs"],
        "--run-name",
        "too long",
        tmp_path,
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.training
def test_a_full_disk_before_the_first_iteration_is_named_with_a_run_record(
    mount_tmpfs: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """The disk holds the writer's 1 MiB reserve and little more: the run fails while it
    starts, in one line naming the full disk, and its record says so (status: FAILED, with
    the cause), instead of `failed at iteration -` and no record."""
    disk = mount_tmpfs("disk", "size=1032k")
    proc = subprocess.run(
        [str(a) for a in [*TRAIN, "--max-iterations", "5", "--log-root", disk / "logs"]],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("failed before the first iteration: ") and "no space left" in line
    run = only_run(disk / "logs")
    record = read_record(run.path, strict=True)
    assert record.state == "failed" and record.failure is not None
    assert record.failure.kind == "environment"
    status = subprocess.run(
        [str(BIN / "mjlab-hpc"), "status", "--json", str(run.path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    (row,) = json.loads(status.stdout)
    assert row["state"] == "FAILED" and "no space left on the device" in row["cause"], row


@pytest.mark.training
def test_a_full_disk_during_training_ends_in_one_line_and_resumes(
    mount_tmpfs: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """The disk fills at a checkpoint: exit 1 with one line saying so and how to resume, no
    traceback, run.json `failed` (not `running`), no temporary file or lone checksum left;
    with room again, the printed command continues from the last checkpoint. An unwritable
    plot is one line too."""
    # The writer's 1 MiB reserve + a few checkpoints: each size fills the disk at another write
    # (a rank's state, the model, a record, a log line).
    for size in ("1650k", "1450k", "1500k"):
        disk = mount_tmpfs(f"disk-{size}", f"size={size}")
        logs = disk / "logs"
        args = [*TRAIN, "--max-iterations", "40", "--save-interval", "1", "--log-root", logs]
        proc = subprocess.run(
            [str(a) for a in args], env=cli_env(), capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("failed at iteration ") and "no space left on the device" in line
        run = only_run(logs)
        record = read_record(run.path)
        assert record.state == "failed" and record.failure is not None
        assert record.failure.kind == "environment"
        assert not [p for p in run.path.rglob("*") if ".tmp" in p.name]
        sidecars = {p.name.removesuffix(".sha256") for p in run.path.glob("model_*.pt.sha256")}
        assert sidecars == {p.name for p in run.checkpoints()}
    done = max(int(p.stem.split("_")[1]) for p in run.checkpoints())

    plot = subprocess.run(
        [BIN / "mjlab-hpc", "plot", str(run.path), "--out", "/proc/no/such.png"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == EXIT_BAD_INPUT and plot.stderr.startswith("error: --out:")

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True, timeout=30)
    resume = line.split("resume with: ", 1)[1]
    again = subprocess.run(
        resume.replace("mjlab-train", str(BIN / "mjlab-train"), 1),
        shell=True,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    record = read_record(run.path)
    assert record.state == "completed" and record.failure is None
    assert record.last_start.resumed_from_iteration == done
    assert [r["iteration"] for r in progress_records(run)] == list(range(1, 41))

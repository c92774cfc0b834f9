"""Out of memory is a named outcome, not a crash, on one machine (issue 35, class 4).

A request whose worlds cannot fit is refused before anything starts, naming the flag and the
most that fits. The largest request that is accepted and still runs out (what MuJoCo Warp's
worlds take is a lower bound of what a rank takes) ends in one line that says so and what to
lower, with a run record. A rank the kernel's OOM killer ends inside a memory cgroup (a
container's limit) is named as such, and not restarted with the same settings.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, memory_cgroup, only_run

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_FAILED
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.tasks.memory import world_bytes
from mjlab_hpc.validate import resolve
from mjlab_hpc.validate.rules import MAX_ENVS_PER_RANK

pytestmark = pytest.mark.training

TRAIN = [str(BIN / "mjlab-train"), "cartpole", "--torch-threads", "1", "--log-root", "logs"]


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


def cartpole_world_bytes() -> int:
    return world_bytes(resolve(TrainSpec(task="cartpole")))


def status_row(cwd: Path) -> dict:
    proc = run([str(BIN / "mjlab-hpc"), "status", "--json", "--log-root", "logs"], cwd)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    return dict(row)


def test_a_request_that_cannot_fit_is_refused_before_anything_starts(tmp_path: Path) -> None:
    proc = run([*TRAIN, "--num-envs", str(MAX_ENVS_PER_RANK)], tmp_path)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_BAD_INPUT, said[-2000:]
    assert said.startswith("error: --num-envs:") and "bytes per world of cartpole's model" in said
    assert "available: use at most --num-envs " in said and "Traceback" not in said
    # A Slurm job's CPU ranks against its --mem, in the dry run too (nothing asks Slurm).
    submit = [str(BIN / "mjlab-submit"), "cartpole", "--executor", "slurm", "--dry-run"]
    submit += ["--gpus-per-node", "0", "--tasks-per-node", "2", "--num-envs", "100000"]
    proc = run([*submit, "--mem", "1G"], tmp_path)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_BAD_INPUT and said.startswith("error: --mem:"), said[-2000:]
    assert "x 2 ranks" in said and "raise --mem to at least" in said
    assert list(tmp_path.iterdir()) == []


def test_the_largest_accepted_request_that_runs_out_says_so(tmp_path: Path) -> None:
    """Under an address-space limit (ulimit -v) every accepted --num-envs fits the estimate;
    the largest still runs out, in an allocation, and says so in one line."""
    limit = 3 * 2**30
    envs = limit // cartpole_world_bytes()
    proc = run(
        ["prlimit", f"--as={limit}", *TRAIN, "--num-envs", str(envs), "--max-iterations", "2"],
        tmp_path,
    )
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("failed before the first iteration: rank 0 on "), line
    assert "ran out of memory" in line and f"{envs} envs per rank on cpu" in line
    assert "lower --num-envs" in line and "resume with: mjlab-train" in line
    record = read_record(only_run(tmp_path / "logs").path, strict=True)
    assert record.state == "failed" and record.failure is not None
    assert record.failure.kind == "out-of-memory"
    row = status_row(tmp_path)
    assert row["state"] == "FAILED" and "ran out of memory" in row["cause"], row


def test_a_rank_the_kernel_kills_for_memory_is_named_and_not_restarted(tmp_path: Path) -> None:
    """Two ranks in a 2 GiB memory cgroup, their worlds taking 80% of it: accepted, and the
    kernel's OOM killer ends a rank. The healer names it (the cgroup counted the kill), does
    not restart it, and the closing line says what to lower."""
    limit = 2 * 2**30
    envs = int(0.8 * limit / 2 / cartpole_world_bytes())
    with memory_cgroup("mjlab-oom", limit) as group:
        in_group = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        train = [*TRAIN, "--num-procs", "2", "--num-envs", str(envs), "--max-iterations", "3"]
        proc = subprocess.run(
            ["sh", "-c", in_group, "sh", *train],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=400,
        )
        kills = int((group / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0])
    assert kills >= 1, proc.stderr[-3000:]
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "ran out of memory (killed by the kernel's OOM killer)" in last, last
    assert f"lower --num-envs (now {envs} per rank)" in last
    record = read_record(only_run(tmp_path / "logs").path, strict=True)
    (fault,) = record.faults
    assert fault.reason == "out-of-memory" and fault.kind == "failed", fault
    # One start at most (none recorded when the kill came before the writer recorded it).
    assert record.failure is not None and record.failure.kind == "out-of-memory"
    assert len(record.starts) <= 1
    row = status_row(tmp_path)
    assert row["state"] == "FAILED" and row["restarts"] == 0, row
    assert "killed by the kernel's OOM killer" in row["cause"]

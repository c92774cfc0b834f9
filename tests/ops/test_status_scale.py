"""`mjlab-hpc status` and `cancel` at scale on the real Slurm test cluster (with slurmdbd).

A 200-element sweep (one held job array) and 50 runs of their own (held jobs) cost the same
number of Slurm calls per refresh as 5 runs: one squeue and one sacct. Logging stand-ins on
PATH that run the real commands count the calls. Held jobs use no CPU. At the end
`mjlab-hpc cancel` cancels all 250 runs with one scontrol update and one scancel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from helpers import BIN, cli_env, wait_for
from slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SLURM_COMMANDS = ("squeue", "sacct", "scontrol", "scancel", "sbatch", "sinfo")
HELD = ["--hold", "--output", "/dev/null", "--time", "1", "--wrap", "true"]


def counting_path(tmp: Path, cluster: SlurmCluster) -> tuple[str, Path]:
    """A PATH whose Slurm commands log each call (one line: the command) and then run the
    real one; and the log."""
    shims, log = tmp / "shims", tmp / "calls.log"
    shims.mkdir()
    for name in SLURM_COMMANDS:
        real = shutil.which(name, path=cluster.environ()["PATH"])
        assert real, f"{name} not on PATH"
        (shims / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexec {real} "$@"\n')
        (shims / name).chmod(0o755)
    return f"{shims}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}", log


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def plain_runs(root: Path, job_ids: list[str]) -> None:
    """Run directories of Slurm jobs of their own, as mjlab-submit leaves them before the
    job starts (run.json names the job)."""
    for i, job in enumerate(job_ids):
        run = root / "scale" / f"2026-01-01_00-00-{i // 60:02d}_run{i:03d}"
        write_json(
            run / "run.json",
            {"launch_mode": "slurm", "starts": [{"job_id": job}], "num_nodes": 1, "world_size": 1},
        )


def sweep_runs(root: Path, array: str, size: int) -> None:
    """A sweep's record and its elements' run directories, as mjlab-submit --sweep writes them."""
    sweep_dir = root / "scale" / ".sweeps" / "2026-01-01_00-00-00"
    elements = []
    for i in range(size):
        run = root / "scale" / f"2026-01-01_00-01-00_seed={i}"
        element = {
            "sweep_dir": str(sweep_dir),
            "index": i,
            "job_id": f"{array}_{i}",
            "executor": "slurm",
            "overrides": {"seed": str(i)},
        }
        write_json(run / "sweep_element.json", element)
        elements.append({**element, "run_dir": str(run)})
    axes = {"seed": [str(i) for i in range(size)]}
    write_json(
        sweep_dir / "sweep.json",
        {"executor": "slurm", "array_job_id": array, "axes": axes, "elements": elements},
    )


def calls(log: Path, seen: list[str] | None = None) -> Counter[str]:
    """How many times each Slurm command ran since the last look (their lines into `seen`)."""
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    if seen is not None:
        seen += lines
    return Counter(line.split()[0] for line in lines)


def test_status_and_cancel_of_250_runs_cost_a_constant_number_of_slurm_calls(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    path, log = counting_path(tmp_path, slurm_cluster)
    env = cli_env(base=slurm_cluster.environ(), path=path)
    jobs = [str(slurm_cluster.sbatch(HELD)) for _ in range(55)]
    array = str(slurm_cluster.sbatch(["--array=0-199", *HELD]))
    try:
        small, big = tmp_path / "small", tmp_path / "big"
        plain_runs(small, jobs[:5])
        plain_runs(big, jobs[5:])
        sweep_runs(big, array, 200)

        def status(root: Path, *args: str, path_env: str = path) -> subprocess.CompletedProcess:
            proc = subprocess.run(
                [BIN / "mjlab-hpc", "status", "--limit", "0", "--log-root", str(root), *args],
                env={**env, "PATH": path_env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc

        rows = json.loads(status(small, "--json").stdout)
        assert len(rows) == 5 and {r["state"] for r in rows} == {"PENDING"}
        per_small = calls(log)
        assert per_small == Counter(squeue=1, sacct=1), per_small

        rows = json.loads(status(big, "--json").stdout)
        assert len(rows) == 250, len(rows)
        by_job = {r["job_ids"][0]: r for r in rows}
        assert set(by_job) == {*jobs[5:], *(f"{array}_{i}" for i in range(200))}
        # Held elements are one folded row in squeue without -r: each must come back.
        assert all(r["state"] == "PENDING" and r["state_source"] == "squeue" for r in rows)
        lines: list[str] = []
        per_big = calls(log, lines)
        assert per_big == per_small, (per_small, per_big)
        # The array is asked by its id (not 200 element ids): 51 ids per command.
        asked = next(line for line in lines if line.startswith("squeue")).split(" -j ")[1]
        assert sorted(asked.split()[0].split(",")) == sorted([*jobs[5:], array]), asked

        table = status(big).stdout  # the table: sweep header and 250 rows, same two calls
        assert f"sweep {array}" in table and "200 PENDING" in table
        assert calls(log) == per_small

        # squeue failing (slurmctld unreachable): one clear line, states from sacct. On a
        # fresh cluster slurmctld hands new jobs to slurmdbd a few seconds late: wait until
        # accounting knows all of them (the array as one folded row), else they are UNKNOWN.
        def accounted() -> bool:
            out = slurm_cluster.run(
                ["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", ",".join([*jobs, array])],
                check=False,
            ).stdout
            known = {line.split("_")[0] for line in out.split()}
            return known >= {*jobs, array}

        wait_for(accounted, 60, "slurmdbd to know the held jobs")
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "squeue").write_text(
            "#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n"
        )
        (broken / "squeue").chmod(0o755)
        proc = status(big, path_env=f"{broken}{os.pathsep}{path}")
        assert "squeue did not answer" in proc.stdout and "sacct" in proc.stdout, proc.stdout
        rows = json.loads(status(big, "--json", path_env=f"{broken}{os.pathsep}{path}").stdout)
        assert len(rows) == 250 and {r["state"] for r in rows} == {"PENDING"}
        assert {r["state_source"] for r in rows} == {"sacct"}
        calls(log)

        # cancel over all 250 runs: one scontrol update, one scancel, status polls after.
        proc = subprocess.run(
            [BIN / "mjlab-hpc", "cancel", str(big), "--grace-s", "20"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        done = calls(log)
        assert done["scontrol"] == 1 and done["scancel"] == 1, done
        assert done["squeue"] == done["sacct"] <= 4, done  # before, and one or two polls
        rows = json.loads(status(big, "--json").stdout)
        assert {r["state"] for r in rows} == {"CANCELLED"}, Counter(r["state"] for r in rows)
    finally:
        slurm_cluster.run(["scancel", *jobs, array], check=False)

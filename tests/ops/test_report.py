"""mjlab-hpc report: what a run cost, as a user who is not root (mjlab-alice).

A local run of two ranks whose rank 0 raises after iteration 3 (healed in its allocation, from
the checkpoint of iteration 2) is checked against its own records: the phases add up to the
allocation, one iteration was recomputed, the env-steps are num_envs x steps x ranks x
iterations. A Slurm job of hers shows sacct's figures (TotalCPU, MaxRSS; the GPU figures the
test cluster does not gather said missing), and a report still comes when sacct fails.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import yaml
from helpers import BIN, Team, runs_under, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

SMALL = ["--num-envs", "16", "--torch-threads", "1"]
PHASES = ("start_up", "training", "checkpointing", "recomputed", "lost_to_faults", "other")
NO_ACCOUNTING = '#!/bin/sh\necho "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1\n'


def _text(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def _report(team: Team, *args: object, extra: dict[str, str] | None = None) -> dict:
    proc = team.run(Team.USERS[0], [BIN / "mjlab-hpc", "report", *args, "--json"], extra=extra)
    assert proc.returncode == 0, _text(proc)
    return json.loads(proc.stdout)


def _adds_up(report: dict) -> None:
    """The phases add up to the allocated node-hours, the shares to one."""
    assert set(report["phase_hours"]) == set(PHASES)
    assert math.isclose(sum(report["phase_hours"].values()), report["node_hours"], rel_tol=1e-6)
    assert math.isclose(sum(report["phase_share"].values()), 1.0, rel_tol=1e-6)
    spans = sum(a["nodes"] * (a["end"] - a["begin"]) for a in report["allocations"]) / 3600
    assert math.isclose(spans, report["node_hours"], rel_tol=1e-6)


@pytest.mark.training
def test_report_of_a_healed_local_run(team: Team) -> None:
    alice = Team.USERS[0]
    logs = team.shared / "report-local"
    train = [BIN / "mjlab-train", "cartpole", *SMALL, "--num-procs", "2", "--log-root", logs]
    train += ["--max-iterations", "5", "--save-interval", "2"]
    proc = team.run(alice, train, extra={"MJLAB_HPC_FAULT": "raise@3:rank0:once"})
    assert proc.returncode == 0, _text(proc)[-3000:]
    run = runs_under(logs)[0]
    record = read_record(run)
    (fault,) = record.faults
    assert fault.kind == "in-allocation" and fault.recomputed == 1, fault

    report = _report(team, run)
    _adds_up(report)
    assert report["kind"] == "local" and report["source"] == "records"
    assert report["starts"] == 2 and report["faults"] == 1 and report["iterations"] == 5
    assert report["recomputed_iterations"] == 1
    for phase in ("start_up", "training", "checkpointing", "recomputed", "lost_to_faults"):
        assert report["phase_hours"][phase] > 0, (phase, report)
    # Every checkpoint the ranks wrote is timed (2, then 4 and 5 after the heal).
    saved = [json.loads(line) for line in RunDir(run).checkpoint_times.read_text().splitlines()]
    assert report["checkpoints"] == len(saved) >= 2
    steps = yaml.safe_load((run / "params" / "agent.yaml").read_text())["num_steps_per_env"]
    env_steps = record.effective.num_envs * steps * record.world_size * 5
    assert report["env_steps"] == env_steps
    assert report["per"] == "core-hour" and report["gpu_hours"] is None
    assert report["core_hours"] == pytest.approx(2 * report["node_hours"])  # 2 ranks x 1 thread
    assert report["env_steps_per_hour"] == pytest.approx(env_steps / report["core_hours"])
    assert report["queue_wait_s"] == 0 and report["efficiency"] is None

    # The table and the timeline, by job id (the local controller's).
    png = team.base / "home" / alice / "cost.png"
    job = report["job_ids"][0]
    shown = team.run(alice, [BIN / "mjlab-hpc", "report", job, "--log-root", logs, "--out", png])
    assert shown.returncode == 0, _text(shown)
    for words in ("lost to faults", "recomputed", "allocated", "1 recomputed after faults"):
        assert words in shown.stdout, shown.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # Bad input: exit 2, one line naming the flag, nothing written.
    home = team.base / "home" / alice
    for args, words in (
        ([run, "--out", home / "cost.svg"], "--out: "),
        ([run, "--out", home / "no" / "such" / "cost.png"], "does not exist"),
        ([home / "no-run"], "RUN|JOB"),
        (["4242424242", "--log-root", logs], "RUN|JOB"),
    ):
        bad = team.run(alice, [BIN / "mjlab-hpc", "report", *args])
        assert bad.returncode == 2, _text(bad)
        assert words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) <= 2, bad.stderr
    assert not (home / "cost.svg").exists() and not (home / "no").exists()


@pytest.mark.slurm
def test_report_of_a_slurm_job_with_sacct(slurm_cluster: SlurmCluster, team: Team) -> None:
    """alice's one-node job on the 22.05 test cluster: allocations, queue wait, TotalCPU and
    MaxRSS from sacct, the GPU figures said missing; with sacct failing, the run's records."""
    alice = Team.USERS[0]
    cluster = slurm_cluster.env
    logs = "report-slurm"
    submit = [BIN / "mjlab-submit", "cartpole", *SMALL, "--gpus-per-node", "0", "--time", "10"]
    submit += ["--max-iterations", "3", "--save-interval", "2", "--log-root", logs, "--follow"]
    done = team.run(alice, submit, extra=cluster, timeout=300)
    assert done.returncode == 0, _text(done)[-3000:]
    run = runs_under(team.shared / logs)[0]
    job = read_record(run).job_ids[0]
    # sacct's record of the steps lands a moment after the job ends.
    report = wait_for(
        lambda: (
            (r := _report(team, job, "--log-root", logs, extra=cluster))["efficiency"]
            and r["efficiency"]["max_rss_bytes"]
            and r
        ),
        30,
        "sacct's figures of the job",
    )
    _adds_up(report)
    assert report["source"] == "sacct" and report["job_ids"] == [job]
    (allocation,) = report["allocations"]
    assert allocation["label"] == job and allocation["nodes"] == 1 and allocation["cores"] >= 1
    assert report["queue_wait_s"] is not None and report["queue_wait_s"] >= 0
    eff = report["efficiency"]
    assert eff["total_cpu_s"] > 0 and eff["cpu_efficiency"] > 0
    assert eff["max_rss_bytes"] > 10 * 2**20  # a Python with torch: tens of MiB at least
    assert eff["missing"] == ["gres/gpuutil", "gres/gpumem"]
    assert report["iterations"] == 3 and report["phase_hours"]["training"] > 0
    shown = team.run(alice, [BIN / "mjlab-hpc", "report", job, "--log-root", logs], extra=cluster)
    assert "TotalCPU" in shown.stdout and "MaxRSS" in shown.stdout, shown.stdout
    assert "not gathered by this site: gres/gpuutil, gres/gpumem" in shown.stdout

    # Accounting off: one line says so, and the report comes from the run's records.
    stand_in = team.base / "home" / alice / "no-sacct"
    stand_in.mkdir()
    (stand_in / "sacct").write_text(NO_ACCOUNTING)
    (stand_in / "sacct").chmod(0o755)
    path = f"{stand_in}:{team.env(alice)['PATH']}"
    off = _report(team, run, extra={**cluster, "PATH": path})
    _adds_up(off)
    assert off["source"] == "records" and off["efficiency"] is None
    assert off["queue_wait_s"] is None and off["iterations"] == 3
    assert any("sacct did not answer" in n for n in off["notes"]), off["notes"]

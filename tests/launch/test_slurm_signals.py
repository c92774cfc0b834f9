"""What a cluster does on purpose is not a fault, on the real Slurm test cluster.

A job suspended and resumed (`scontrol suspend`, as gang scheduling and PreemptMode=SUSPEND
do) past the writer's lease and the hang timeout goes on as if nothing happened. Every signal
a user or admin can send has its one documented meaning (docs/preemption.md, "Signals"):
`scancel --signal` to the steps, the batch shell or both, `scontrol requeue`, a time limit
cut below the signal delay. Each is recorded with its true cause and never excludes a node.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, cli_env, progress_records, reference_digests, runs_under, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import EXIT_OK
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.slurm

CARTPOLE = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1"]
COMMON = [*CARTPOLE, "--save-interval", "5", "--max-iterations", "12"]
REFERENCE = [*CARTPOLE, "--save-interval", "100", "--max-iterations", "12"]
# Longer than the writer's lease (30 s), the hang and the collective timeouts below.
SUSPEND_S = 32
# A sweep element's iterations: long enough to be running still when the other is requeued.
ITERS = 60


def follow(
    cluster: SlurmCluster, args: list[str], root: Path, extra: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`mjlab-submit ... --follow` in the background."""
    cmd = [BIN / "mjlab-submit", *args, "--gpus-per-node", "0", "--time", "10"]
    cmd += ["--log-root", str(root), "--follow"]
    return subprocess.Popen(
        cmd,
        env=cli_env(extra, base=cluster.environ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def the_run(root: Path) -> RunDir:
    return wait_for(lambda: runs_under(root) and RunDir(runs_under(root)[0]), 60, "the run")


def job_of(run: RunDir) -> str:
    """The Slurm job of a single run (submitit names its files after it)."""
    found = wait_for(lambda: sorted((run.path / "submitit").glob("*_submission.sh")), 60, "job")
    return found[0].name.split("_")[0]


def iteration(run: RunDir) -> int:
    return int((progress_records(run) or [{}])[-1].get("iteration", 0))


def suspended(cluster: SlurmCluster, job: str, seconds: float) -> None:
    """`scontrol suspend` the job for `seconds`, then `scontrol resume` it."""
    cluster.run(["scontrol", "suspend", job])
    try:
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        assert state == "SUSPENDED", state
        time.sleep(seconds)
    finally:
        cluster.run(["scontrol", "resume", job])


def test_a_suspended_job_resumes_as_if_nothing_happened(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job suspended for longer than the writer's lease, --hang-timeout-s and
    --dist-timeout-s, once while its ranks start and once after iteration 4: no collective
    times out, no fault, no restart, no iteration computed again, the parameters of a run
    that never stopped; --follow stays with it through both and ends with its done line."""
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--hang-timeout-s", "20"]
    args += ["--dist-timeout-s", "20"]
    proc = follow(slurm_cluster, args, tmp_path)
    try:
        run = the_run(tmp_path)
        wait_for(
            lambda: run.rank_log(0).exists() and "rank 0/2" in run.rank_log(0).read_text(),
            120,
            "rank 0 to start",
        )
        job = job_of(run)
        assert iteration(run) == 0
        suspended(slurm_cluster, job, SUSPEND_S)
        wait_for(lambda: iteration(run) >= 4, 180, "iteration 4")
        suspended(slurm_cluster, job, SUSPEND_S)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_OK and "done: 12 iterations" in out, out[-2000:] + err[-2000:]
    record = read_record(run.path)
    assert record.faults == () and record.restarts == (), record
    assert len(record.starts) == 1 and record.state == "completed", record.starts
    assert [p["iteration"] for p in progress_records(run)] == list(range(1, 13))
    summary = json.loads(run.summary.read_text())
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert "exit: completed" in run.rank_log(1).read_text()
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=0" in shown, shown
    # report charges what sacct charges: the suspensions held the nodes but cost nothing,
    # and are in no phase (not `other`, not `recomputed`).
    report = slurm_cluster.report_is_sacct(run.path, job)
    assert report["suspended_s"] >= 2 * SUSPEND_S - 2 and report["faults"] == 0, report
    assert report["phase_hours"]["recomputed"] == 0, report


def status_row(cluster: SlurmCluster, run: RunDir) -> dict:
    cmd = [BIN / "mjlab-hpc", "status", "--json", str(run.path)]
    out = subprocess.run(
        cmd, env=cli_env(base=cluster.environ()), capture_output=True, text=True, timeout=60
    ).stdout
    return json.loads(out)[0]


def in_logs(run: RunDir, text: str, ranks: int = 2) -> bool:
    return all(text in run.rank_log(r).read_text() for r in range(ranks))


def test_signals_and_admin_actions_mean_what_the_docs_say(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """One 2-node job: USR1 to the steps and to the batch shell asks for a checkpoint and
    training goes on; ALRM to everything (--full) is ignored and said; `scontrol requeue` is
    recorded as a requeue (not a preemption); a time limit cut below --signal-delay-s plus
    start-up (scontrol update TimeLimit, here below the delay) stops the run for good with a
    line that says why,
    instead of requeueing it again and again. No fault, no node excluded, status STOPPED."""
    args = [*COMMON[:-2], "--max-iterations", "100000", "--nodes", "2", "--tasks-per-node", "1"]
    proc = follow(slurm_cluster, args, tmp_path)
    try:
        run = the_run(tmp_path)
        job = job_of(run)
        wait_for(lambda: iteration(run) >= 3, 120, "iteration 3")
        slurm_cluster.run(["scancel", "--signal=USR1", job])
        wait_for(lambda: in_logs(run, "asked for by SIGUSR1"), 60, "a checkpoint for USR1")
        slurm_cluster.run(["scancel", "--full", "--signal=ALRM", job])
        wait_for(lambda: in_logs(run, "SIGALRM ignored"), 60, "ALRM said and ignored")
        before = run.rank_log(0).read_text().count("asked for by SIGUSR1")
        slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])  # through the shell
        wait_for(
            lambda: run.rank_log(0).read_text().count("asked for by SIGUSR1") > before,
            60,
            "USR1 through the batch shell",
        )
        slurm_cluster.run(["scontrol", "requeue", job])
        wait_for(lambda: len(read_record(run.path).starts) == 2, 120, "the restart")
        at = iteration(run)
        wait_for(lambda: iteration(run) > at + 2, 120, "training after the requeue")
        slurm_cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"])
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    record = read_record(run.path)
    assert record.faults == (), record.faults
    requeue, limit = record.restarts
    got = (requeue.reason, requeue.kind, requeue.signal)
    assert got == ("requeue", "requeue", "SIGTERM"), requeue
    assert (limit.reason, limit.kind) == ("time-limit", "stop"), limit
    assert str(limit.why).startswith(
        "not requeued: the job's time limit (00:01:00) is no longer than --signal-delay-s 90"
    ), limit
    assert proc.returncode == 3, out[-1000:] + err[-2000:]
    assert f"({limit.reason}, SIGUSR2: {limit.why})" in " ".join(err.split()), err[-2000:]
    saved = {p.name for p in run.path.glob("model_*.pt")}
    assert f"model_{limit.iteration}.pt" in saved and len(saved) > 2, saved
    assert slurm_cluster.wait_job(job, timeout=60) == "FAILED"  # the ranks' exit 3
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "ExcNodeList=(null)" in shown and "Restarts=1" in shown, shown
    row = status_row(slurm_cluster, run)
    assert row["state"] == "STOPPED" and row["restart_reasons"] == ["requeue"], row


def test_a_term_to_the_batch_shell_stops_the_run_for_good(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`scancel --batch --signal=TERM`: the batch shell passes it on to the ranks, which stop
    for good with a checkpoint (a person's TERM, not a preemption: nothing is requeued and
    nothing says so); --follow ends with the stop's line (exit 3), status says STOPPED."""
    args = [*COMMON[:-2], "--max-iterations", "100000", "--nodes", "2", "--tasks-per-node", "1"]
    proc = follow(slurm_cluster, args, tmp_path)
    try:
        run = the_run(tmp_path)
        job = job_of(run)
        wait_for(lambda: iteration(run) >= 3, 120, "iteration 3")
        slurm_cluster.run(["scancel", "--batch", "--signal=TERM", job])
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out[-1000:] + err[-2000:]
    assert "(terminated, SIGTERM: SIGTERM while the job runs" in " ".join(err.split()), err
    record = read_record(run.path)
    (stop,) = record.restarts
    assert (stop.reason, stop.kind) == ("terminated", "stop") and not record.faults
    logs = "".join(p.read_text() for p in (run.path / "submitit").glob("*_log.*"))
    assert "requeue" not in logs.lower() and "preemption" not in logs.lower(), logs[-2000:]
    assert slurm_cluster.wait_job(job, timeout=60) == "FAILED"
    assert status_row(slurm_cluster, run)["state"] == "STOPPED"


def test_a_requeue_of_one_array_element_is_that_elements_alone(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`scontrol requeue <array>_1` of a two-element sweep: element 1 (whose own SLURM_JOB_ID
    is the array's id, which names every element) is requeued and continues from its
    checkpoint; element 0, another run, trains on to its end: one start, no stop, no fault."""
    args = ["cartpole", "--num-envs", "64", "--torch-threads", "1", "--sweep", "seed=0,1"]
    args += ["--save-interval", "5", "--max-iterations", str(ITERS), "--nodes", "1"]
    args += ["--gpus-per-node", "0", "--time", "10", "--log-root", str(tmp_path)]
    sent = subprocess.run(
        [BIN / "mjlab-submit", *args],
        env=cli_env(base=slurm_cluster.environ()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"job array\s+(\d+) \(slurm\)", sent.stdout)
    assert sent.returncode == 0 and found, sent.stdout + sent.stderr
    array = found.group(1)

    def elements() -> dict[int, RunDir]:
        marks = [r / "sweep_element.json" for r in runs_under(tmp_path)]
        found = {json.loads(m.read_text())["index"]: RunDir(m.parent) for m in marks if m.exists()}
        return found if len(found) == 2 else {}

    by_seed = wait_for(elements, 120, "the two elements' runs")
    wait_for(lambda: all(iteration(r) >= 3 for r in by_seed.values()), 180, "iteration 3")
    assert iteration(by_seed[0]) < ITERS - 20, "element 0 ended before the requeue"
    slurm_cluster.run(["scontrol", "requeue", f"{array}_1"])
    for index in (0, 1):
        assert slurm_cluster.wait_job(f"{array}_{index}", timeout=300) == "COMPLETED"
    kept, requeued = read_record(by_seed[0].path), read_record(by_seed[1].path)
    assert kept.restarts == () and kept.faults == () and len(kept.starts) == 1, kept
    assert [p["iteration"] for p in progress_records(by_seed[0])] == list(range(1, ITERS + 1))
    (restart,) = requeued.restarts
    assert (restart.reason, restart.kind) == ("requeue", "requeue") and not requeued.faults
    assert len(requeued.starts) == 2 and requeued.state == "completed", requeued

"""Self-healing runs, locally and on the real Slurm test cluster.

The faults: a rank killed (kill -9), a rank frozen (SIGSTOP) with a short --hang-timeout-s (the
writer too, in a checkpoint write), two ranks failing at once, an exception that repeats at
the same iteration (no crash loop), a node lost or set DOWN. Local
runs use `mjlab-train --num-procs 2` (submitit's local executor under our controller). Each
test asserts the final state, the iteration count, the fault record and that no process is
left; a healed crash also ends with bit-identical parameters. Restarts exhausted
(--max-restarts 0) are in tests/rank/test_preemption.py.

Faults are injected with MJLAB_HPC_FAULT (`mjlab_hpc.rank.watchdog`): the rank kills or stops
itself at the end of a fixed iteration, so the tests do not race the training.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    BIN,
    cli_env,
    clock_ahead,
    only_run,
    progress_records,
    reference_digests,
    runs_under,
    wait_for,
)
from slurm_cluster import SLURMD_TIMEOUT_S, SlurmCluster

from mjlab_hpc.errors import EXIT_FAILED, EXIT_HUNG, EXIT_OK, EXIT_REQUEUE, job_exit_code
from mjlab_hpc.launch.heal import Fault, Healing, Step, next_step
from mjlab_hpc.launch.local import local_processes
from mjlab_hpc.rank.watchdog import FAULT_ENV, SAY_ENV
from mjlab_hpc.rundir.ends import rank_ends, start_hosts
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import Interruption, read_record
from mjlab_hpc.slurm.client import SlurmClient

CARTPOLE = ["cartpole", "--num-envs", "64", "--seed", "11", "--torch-threads", "1"]
COMMON = [*CARTPOLE, "--save-interval", "5", "--max-iterations", "12"]
# The uninterrupted run to compare with: the same training (checkpoints do not change it), so
# its digests are shared with tests/rank/test_preemption.py's reference.
REFERENCE = [*CARTPOLE, "--save-interval", "100", "--max-iterations", "12"]
TWO = ["--num-procs", "2"]
# Rank 1 prints text shaped like our log lines after iteration 2 (a start on another node with
# another world size, an out-of-memory exit with its traceback, a completed exit), then
# raises after iteration 3: what it printed must change no decision.
LOOKALIKE = {
    FAULT_ENV: "say@2:rank1:once,raise@3:rank1:once",
    SAY_ENV: "\n\n".join(
        [
            "rank 1/3 (local 1/3, node 0/1) via slurm, master x:1 on cpu, host evil-node, pid 1, "
            "seed 1, 8 envs, CUDA_VISIBLE_DEVICES=unset, start 9.9.9, oom-kills 0 in /x (kernel k)",
            "exit: failed (out-of-memory)\nTraceback (most recent call last):\n"
            '  File "x.py", line 1, in f\nMemoryError: out of memory',
            "exit: completed 99 iterations",
        ]
    ),
}
LOOKALIKE_RUN = [*CARTPOLE, "--save-interval", "2", "--max-iterations", "6"]


def train(args: list[str], root: Path, fault: str | None, timeout: float = 300):
    extra = {"MJLAB_HPC_FAULT": fault} if fault else {}
    return subprocess.run(
        [BIN / "mjlab-train", *args, "--log-root", str(root)],
        env=cli_env(extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def faults_of(run: RunDir) -> list[dict]:
    """The run's faults as tools read them in run.json."""
    return [f.to_json() for f in read_record(run.path).faults]


def hpc_json(run: RunDir, env: dict[str, str] | None = None) -> dict:
    cmd = [BIN / "mjlab-hpc", "status", "--json", str(run.path)]
    status = subprocess.run(cmd, env=env or cli_env(), capture_output=True, text=True, timeout=60)
    return json.loads(status.stdout)[0]


def hpc_logs(run: RunDir, env: dict[str, str] | None = None) -> str:
    cmd = [BIN / "mjlab-hpc", "logs", str(run.path)]
    return subprocess.run(
        cmd, env=env or cli_env(), capture_output=True, text=True, timeout=60
    ).stdout


@pytest.mark.training
def test_local_crash_then_hang_heal_to_the_same_parameters(
    tmp_path: Path, shared_tmp: Path
) -> None:
    """kill -9 of rank 1 after iteration 6, then SIGSTOP of rank 1 after iteration 10 with
    --hang-timeout-s 5: each is healed without a person (the hang noticed within seconds, not
    the 300 s collective timeout, with rank 0's Python stacks and rank 1 and its host named),
    and the run ends with the parameters of a run that never failed, leaving nothing."""
    args = [*COMMON, *TWO, "--save-interval", "4", "--hang-timeout-s", "5"]
    t0 = time.monotonic()
    proc = train(args, tmp_path, "kill@6:rank1:once,stop@10:rank1:once")
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "mjlab-hpc heal: crash after iteration 6" in proc.stderr
    assert "mjlab-hpc heal: hang after iteration 10" in proc.stderr
    assert elapsed < 240
    run = only_run(tmp_path)
    crash, hang = faults_of(run)
    got = (crash["reason"], crash["kind"], crash["ranks"], crash["iteration"])
    assert got == ("crash", "in-allocation", [1], 6), crash
    assert "killed by a signal" in crash["error"]
    assert crash["resumed_from"] == 4 and crash["recomputed"] == 2, crash
    got = (hang["reason"], hang["kind"], hang["ranks"], hang["iteration"])
    assert got == ("hang", "in-allocation", [1], 10), hang
    assert hang["resumed_from"] == 8 and hang["recomputed"] == 2, hang
    assert all(0 < f["recovery_s"] < 120 for f in (crash, hang))
    log0 = run.rank_log(0).read_text()
    assert "hang: no progress for" in log0 and "rank(s) 1 on" in log0
    assert "<- stalled" in log0 and "Thread 0x" in log0 and 'File "' in log0  # faulthandler
    assert "exit: hung after iteration 10" in log0
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12 and summary["resumed_from"] == 8
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert local_processes(run.path) == []
    row = hpc_json(run)
    assert row["state"] == "COMPLETED" and row["restart_reasons"] == ["crash", "hang"], row


@pytest.mark.training
def test_a_repeated_failure_is_not_retried(tmp_path: Path) -> None:
    """An exception at the same iteration on every start (a bug in a reward, a NaN): healed
    once, then the run ends FAILED with that error in `status` and `logs`, not a crash loop."""
    proc = train([*COMMON, *TWO], tmp_path, "raise@6:rank1")
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    run = only_run(tmp_path)
    first, second = faults_of(run)
    assert first["kind"] == "in-allocation" and second["kind"] == "failed"
    assert "the same failure at iteration 6" in second["action"]
    assert "injected fault at iteration 6" in second["error"]
    record = read_record(run.path)
    assert record.state == "failed" and record.failure and record.failure.rank == 1
    row = hpc_json(run)
    assert row["state"] == "FAILED" and "injected fault at iteration 6" in row["cause"], row
    logs = hpc_logs(run)
    assert logs.startswith("cause: rank 1 on") and "not retried (a crash loop" in logs
    assert local_processes(run.path) == []


def assert_lookalike_changed_nothing(run: RunDir, host: str, env: dict[str, str]) -> None:
    """The crash was healed as the crash of rank 1 it was, on its real node, to the end."""
    (fault,) = faults_of(run)
    assert (fault["reason"], fault["ranks"]) == ("crash", [1]), fault
    assert "injected fault at iteration 3" in fault["error"], fault
    assert "exit: completed 99 iterations" in run.rank_log(1).read_text()  # it said it
    assert start_hosts(run.path, rank=1) == [host, host]
    ends = [(e.rank, e.how, e.world_size, e.host) for e in rank_ends(run.path)]
    assert ends == [(0, "completed", 2, host), (1, "completed", 2, host)], ends
    assert hpc_json(run, env)["state"] == "COMPLETED"
    logs = hpc_logs(run, env)
    assert f"── rank 1 · {host} ·" in logs and "── rank 1 · evil-node" not in logs, logs[-3000:]


@pytest.mark.training
def test_text_like_our_log_lines_changes_no_decision_locally(tmp_path: Path) -> None:
    """A rank that prints our log lines' shapes (LOOKALIKE) then raises: healed as a crash of
    that rank (not out of memory, not completed), on its node, to the end."""
    proc = subprocess.run(
        [BIN / "mjlab-train", *LOOKALIKE_RUN, *TWO, "--log-root", str(tmp_path)],
        env=cli_env(LOOKALIKE),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert_lookalike_changed_nothing(only_run(tmp_path), socket.gethostname(), cli_env())


# --- Slurm --------------------------------------------------------------------------------


@pytest.mark.slurm
def test_stragglers_are_left_out_only_for_spares(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next srun step's nodes in a 4-node allocation whose steps run on 2 (Slurm expands
    the node list): stragglers' nodes go while spares are left, after the suspect nodes; a
    straggler left out before comes back when a later fault leaves no other spare; none is
    left out for fewer nodes."""
    client = SlurmClient(env=slurm_cluster.environ())
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-4]")
    run = RunDir(tmp_path)

    def step(
        exclude: list[str],
        stragglers: list[str],
        faults: list[dict],
        iteration: int,
        nodes: int = 2,
        min_nodes: int | None = None,
    ) -> tuple[Step | None, Healing]:
        run.record.write_text(
            json.dumps({"faults": faults, "stragglers": [{"host": h} for h in stragglers]})
        )
        fault = Fault(
            reason="crash",
            error="x",
            ranks=(1,),
            hosts=("node1",),
            iteration=iteration,
            suspect_nodes=tuple(exclude),
        )
        heal = Healing(
            fault,
            requeue=True,
            why="requeued after a crash (1 of 3)",
            exclude=list(exclude),
            entry=Interruption(job_id="9", restart_count=0),
        )
        return next_step(client, run.path, heal, step_nodes=nodes, min_nodes=min_nodes), heal

    got, heal = step([], ["node2", "node3", "node9"], [], 5)
    assert got == Step(("node2", "node3")) and heal.entry.straggler_nodes == ("node2", "node3")
    assert heal.why.endswith("; straggler node(s) node2, node3 left out for a spare")
    got, heal = step(["node1"], ["node2", "node3"], [], 5)
    assert got == Step(("node1", "node2")), got  # the suspect first, one spare left
    earlier = {
        "kind": "in-allocation",
        "job_id": "9",
        "restart_count": 0,
        "iteration": 5,
        "excluded_nodes": ["node1", "node2"],
        "straggler_nodes": ["node2"],
    }
    got, heal = step(["node3"], [], [earlier], 8)
    assert got == Step(("node1", "node3")) and not heal.entry.straggler_nodes, got
    got, _ = step([], ["node2"], [earlier], 8, nodes=4)  # no spare: node2 is back
    assert got == Step(("node1",), 3), got
    got, _ = step(["node4"], ["node2"], [earlier], 8, nodes=3, min_nodes=1)
    assert got == Step(("node1", "node4"), 2), got  # fewer nodes, but not for a straggler


def test_a_jobs_exit_code_has_one_meaning() -> None:
    """srun's codes that are not ours (a signal's number, 128 + it) end a job as a failure."""
    for ours in (EXIT_OK, EXIT_FAILED, EXIT_HUNG, EXIT_REQUEUE):
        assert job_exit_code(ours) == ours
    assert {job_exit_code(c) for c in (9, 15, 137, 143, 76, 255)} == {EXIT_FAILED}


def submit(
    cluster: SlurmCluster,
    args: list[str],
    root: Path,
    fault: str | None = None,
    follow: bool = True,
):
    extra = {"MJLAB_HPC_FAULT": fault} if fault else {}
    cmd = [BIN / "mjlab-submit", *args, "--gpus-per-node", "0", "--time", "10"]
    cmd += ["--log-root", str(root)] + (["--follow"] if follow else [])
    return subprocess.run(
        cmd, env=cli_env(extra, base=cluster.environ()), capture_output=True, text=True, timeout=400
    )


@pytest.mark.slurm
def test_slurm_text_like_our_log_lines_changes_no_decision(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """On Slurm too (one node, two ranks): LOOKALIKE's crash is restarted in the allocation as
    the crash of rank 1 on its node."""
    cmd = [BIN / "mjlab-submit", *LOOKALIKE_RUN, "--nodes", "1", "--tasks-per-node", "2"]
    cmd += ["--gpus-per-node", "0", "--time", "10", "--log-root", str(tmp_path), "--follow"]
    env = cli_env(LOOKALIKE, base=slurm_cluster.environ())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    (host,) = set(start_hosts(run.path, rank=0))
    assert host.startswith("node"), host
    assert_lookalike_changed_nothing(run, host, cli_env(base=slurm_cluster.environ()))


@pytest.mark.slurm
def test_slurm_crash_excludes_the_node_and_heals(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """kill -9 of rank 1 of a 1-node job: the batch script's healer adds the node to the
    job's excluded nodes and requeues it; it resumes on the other node to the same final
    parameters as a run that never crashed."""
    args = [*COMMON, "--nodes", "1", "--tasks-per-node", "2"]
    proc = submit(slurm_cluster, args, tmp_path, "kill@8:rank1:once")
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    (fault,) = faults_of(run)
    first, second = start_hosts(run.path, rank=0)
    assert fault["reason"] == "crash" and fault["excluded_nodes"] == [first], fault
    assert second != first and fault["recomputed"] == 3
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12 and summary["launch_mode"] == "slurm"
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    job = summary["job_id"]
    shown = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert f"ExcNodeList={first}" in shown, shown
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"


@pytest.mark.slurm
def test_slurm_hang_then_node_down_on_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A 2-node job. SIGSTOP of rank 1 (node2) after iteration 8: the watchdog ends the
    start after --hang-timeout-s, node2 is not excluded (no spare, and the partition would be
    too small: the record says so), and the ranks start again in the allocation. Then node2
    is set DOWN under the running job: Slurm requeues it, the ranks checkpoint on the way out,
    run.json calls it node-lost. While node2 is held out (drained), the requeued job waits, and
    status and logs say after what and node2's state and reason, not a bare PENDING. Back in
    service, the job completes in the same run directory."""
    args = [*COMMON[:-2], "--max-iterations", "40", "--nodes", "2", "--tasks-per-node", "1"]
    args += ["--hang-timeout-s", "5"]
    proc = submit(slurm_cluster, args, tmp_path, "stop@8:rank1:once", follow=False)
    assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
    run = wait_for(lambda: runs_under(tmp_path) and RunDir(runs_under(tmp_path)[0]), 60, "run")
    wait_for(
        lambda: (
            len(read_record(run.path).starts) >= 2
            and (progress_records(run) or [{}])[-1].get("iteration", 0) >= 14
        ),
        240,
        "the healed start to pass iteration 14",
    )
    (fault,) = faults_of(run)
    assert (fault["reason"], fault["ranks"], fault["hosts"]) == ("hang", [1], ["node2"]), fault
    assert fault["kind"] == "in-allocation", fault
    assert "partition debug would have 1 usable node(s) for a 2-node job" in fault["not_excluded"]
    assert "Thread 0x" in run.rank_log(0).read_text()
    down = slurm_cluster.run(
        ["scontrol", "update", "nodename=node2", "state=down", "reason=mjlab-hpc-test"]
    )
    assert down.returncode == 0, down.stderr
    try:
        # A drain keeps node2 out of service (its slurmd registering again would end DOWN
        # within seconds: ReturnToService=2).
        slurm_cluster.run(
            ["scontrol", "update", "nodename=node2", "state=drain", "reason=mjlab-hpc-test"]
        )
        env = cli_env(base=slurm_cluster.environ())
        row = wait_for(lambda: (r := hpc_json(run, env))["waiting"] and r, 120, "the wait")
        assert row["state"] == "PENDING" and row["active"], row
        # After the stop (node-lost, or a requeue by Slurm where sinfo no longer said node2 was
        # down), naming node2 (that stop, or the hang before it).
        assert re.search(
            r"^waits after: .* at iteration \d+: requeued; node2 is drained "
            r"\(mjlab-hpc-test\)$",
            row["waiting"],
        ), row
        logs = hpc_logs(run, env)
        assert row["waiting"] in " ".join(logs.split()), logs
        slurm_cluster.run(["scontrol", "update", "nodename=node2", "state=resume"])
        summary = wait_for(
            lambda: run.summary.exists() and json.loads(run.summary.read_text()),
            300,
            "the requeued job to finish",
        )
    finally:
        # Usually back to idle by itself already (ReturnToService=2): "Invalid node state".
        slurm_cluster.run(["scontrol", "update", "nodename=node2", "state=resume"], check=False)
    stops = [s.to_json() for s in read_record(run.path).restarts]
    # Exactly node2, never the healthy node1 or the allocation's hostlist: Slurm's DOWN event
    # (accounting), though node2 was back a moment later.
    assert [s["reason"] for s in stops] == ["node-lost"], stops
    assert stops[0]["nodes"] == ["node2"], stops
    assert stops[0]["recomputed"] == 0 and stops[0]["recovery_s"] > 0
    assert summary["iterations"] == 40 and summary["resumed_from"] == stops[0]["iteration"]
    # One restart count: the hang's restart in the allocation and the requeue, as status says.
    row = hpc_json(run, env)
    assert summary["restart_count"] == row["restarts"] == 2, (summary, row)
    assert summary["restart_reasons"] == row["restart_reasons"] == ["hang", "node-lost"]
    assert slurm_cluster.wait_job(summary["job_id"], timeout=60) == "COMPLETED"  # nothing left


def restarts_of(cluster: SlurmCluster, job: str) -> int:
    """How often Slurm started the job again (a requeue): scontrol's Restarts=."""
    shown = cluster.run(["scontrol", "show", "job", job]).stdout
    return int(shown.split("Restarts=")[1].split()[0])


def ended_in_the_allocation(
    cluster: SlurmCluster, fault: dict, summary: dict, what: str, timeout: float = 120
) -> None:
    """The healed run's one job: the fault's, never requeued, COMPLETED (nothing left
    running); prints the fault's seconds to the first resumed iteration."""
    job = summary["job_id"]
    assert fault["job_id"] == job and restarts_of(cluster, job) == 0
    assert cluster.wait_job(job, timeout=timeout) == "COMPLETED"
    print(f"{what} to the first resumed iteration: {fault['recovery_s']} s")


def lose_rank1_node_after_6(cluster: SlurmCluster, run: RunDir, after: int = 6) -> str:
    """Once rank 1 has stopped itself after iteration 6 (or `after`), lose its node for real
    (slurmd and rank killed at once, as in a power cut): that node."""
    wait_for(
        lambda: (progress_records(run) or [{}])[-1].get("iteration", 0) >= after,
        240,
        f"iteration {after} (rank 1 stops itself there)",
    )
    lost = start_hosts(run.path, rank=1)[-1]
    killed = cluster.lose_node(lost)
    assert "slurmd" in killed and "slurmstepd" in killed, killed
    return lost


@pytest.mark.slurm
def test_slurm_crash_restarts_in_the_allocation(
    slurm_cluster: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """An exception in rank 1 after iteration 6 of a 1-node, 2-rank job: the batch script
    starts a new srun step in the same allocation (no requeue, no queue wait: the job id and
    Slurm's restart count unchanged) from the newest checkpoint, and the run ends with the
    parameters of a run that never failed; the record has the seconds from the fault to the
    first resumed iteration (docs/performance.md). `mjlab-hpc logs --follow`, started with
    the job, streams the fault and how it was healed as they happen, naming the Slurm node."""
    cmd = [BIN / "mjlab-submit", *COMMON, "--nodes", "1", "--tasks-per-node", "2"]
    cmd += ["--gpus-per-node", "0", "--time", "10", "--log-root", str(tmp_path), "--follow"]
    env = cli_env({"MJLAB_HPC_FAULT": "raise@6:rank1:once"}, base=slurm_cluster.environ())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(
            lambda: runs_under(tmp_path) and RunDir(runs_under(tmp_path)[0]), 60, "the run"
        )
        logs = subprocess.run(
            [BIN / "mjlab-hpc", "logs", str(run.path), "--follow"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_OK, out[-2000:] + err[-2000:]
    (fault,) = faults_of(run)
    assert (fault["reason"], fault["kind"], fault["iteration"]) == ("crash", "in-allocation", 6)
    streamed = [line for line in logs.stdout.splitlines() if line.startswith("[run] ")]
    assert len(streamed) == 2 and all("crash of rank 1 on node" in s for s in streamed), streamed
    assert "resumed from 5" in streamed[-1], streamed  # healed: said when it came back
    heads = re.findall(r"^── rank \d · (\S+) ·", logs.stdout, re.M)
    # The Slurm node, or "?" before the rank has said where it runs; never the machine. No
    # head at all where the first look came before any rank had a log (the job still pending).
    assert all(h == "?" or h.startswith("node") for h in heads), logs.stdout
    assert f" {socket.gethostname()} " not in logs.stdout, logs.stdout
    assert fault["resumed_from"] == 5 and fault["recomputed"] == 1, fault
    assert 0 < fault["recovery_s"] < 120, fault
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    ended_in_the_allocation(slurm_cluster, fault, summary, "crash", timeout=60)
    job = summary["job_id"]
    steps = slurm_cluster.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,State"]).stdout
    # Step 0 ended with the crash: FAILED, or CANCELLED when srun's --kill-on-bad-exit ended
    # the other rank before Slurm recorded the failed one (it varies from run to run).
    assert re.search(rf"^{job}\.0\|(FAILED|CANCELLED( by \d+)?)$", steps, re.M), steps
    assert f"{job}.1|COMPLETED" in steps, steps


def lose_rank1_node(
    cluster: SlurmCluster, args: list[str], root: Path, after: str
) -> tuple[RunDir, str, dict, dict]:
    """Submit a job with --follow whose rank 1 stops itself after iteration 6, then lose its
    node for real (slurmd and rank killed at once, as in a power cut), back once the run has
    finished `after` it; --follow must end with the run's `done` line (exit 0). The run, the
    lost node, the summary and the one fault, a crash healed in the allocation."""
    cmd = [BIN / "mjlab-submit", *args, "--gpus-per-node", "0", "--time", "10"]
    cmd += ["--log-root", str(root), "--follow"]
    env = cli_env({"MJLAB_HPC_FAULT": "stop@6:rank1:once"}, base=cluster.environ())
    follow = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        run = wait_for(lambda: runs_under(root) and RunDir(runs_under(root)[0]), 60, "run")
        lost = lose_rank1_node_after_6(cluster, run)
        try:
            out, err = follow.communicate(timeout=300)
        finally:
            cluster.start_node(lost)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == EXIT_OK and "done: 12 iterations" in out, (after, out, err)
    summary = json.loads(run.summary.read_text())
    (fault,) = faults_of(run)
    got = (fault["reason"], fault["kind"], fault["hosts"])
    assert got == ("crash", "in-allocation", [lost]), fault
    return run, lost, summary, fault


@pytest.mark.slurm
def test_slurm_hard_node_loss_with_a_spare(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 (3 nodes allocated, ranks on 2). Rank 1's node is
    lost after iteration 6 (its slurmd and rank killed at once, as in a power cut; Slurm
    would call it dead only after SlurmdTimeout, 300 s): the next srun step, in the same
    allocation, leaves that node out and runs on the spare, with the same world size, to the
    parameters of a run that never failed. No requeue, nothing left once the node is back."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--spare-nodes", "1"]
    run, lost, summary, fault = lose_rank1_node(cluster, args, tmp_path, "on the spare")
    # Resumed from model_5.pt, or from model_6.pt when the ranks saw a stop on the way out.
    assert fault["excluded_nodes"] == [lost] and fault["resumed_from"] + fault["recomputed"] == 6
    assert 0 < fault["recovery_s"] < 120, fault
    first, second = start_hosts(run.path, rank=1)
    assert first == lost, (first, second)
    assert second not in (lost, start_hosts(run.path, rank=0)[1]), (first, second)
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    # The lost node's step ends once its slurmd is back (else after SlurmdTimeout).
    ended_in_the_allocation(cluster, fault, summary, "node lost")


@pytest.mark.slurm
def test_slurm_node_set_down_with_a_spare(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 (so --no-kill) whose rank 1 stops itself after
    iteration 6; an admin then sets its node DOWN. Slurm kills the step at once (SIGKILL: no
    time for a checkpoint) and the node is back a moment later: the healer names that node
    (node-lost, from Slurm's DOWN event), not the healthy one, leaves it out for the spare in
    the same allocation, and the run ends with the parameters of a run that never failed.
    summary.json's restart count is status's."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--spare-nodes", "1"]
    proc = submit(cluster, args, tmp_path, "stop@6:rank1:once", follow=False)
    assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
    run = wait_for(lambda: runs_under(tmp_path) and RunDir(runs_under(tmp_path)[0]), 60, "run")
    wait_for(
        lambda: (progress_records(run) or [{}])[-1].get("iteration", 0) >= 6,
        240,
        "iteration 6 (rank 1 stops itself there)",
    )
    lost = start_hosts(run.path, rank=1)[-1]
    down = ["scontrol", "update", f"nodename={lost}", "state=down", "reason=mjlab-hpc-test"]
    try:
        assert cluster.run(down).returncode == 0
        summary = wait_for(
            lambda: run.summary.exists() and json.loads(run.summary.read_text()),
            240,
            "the healed run to finish",
        )
    finally:  # usually idle again already (ReturnToService=2)
        cluster.run(["scontrol", "update", f"nodename={lost}", "state=resume"], check=False)
    (fault,) = faults_of(run)
    got = (fault["reason"], fault["kind"], fault["nodes"], fault["excluded_nodes"])
    assert got == ("node-lost", "in-allocation", [lost], [lost]), fault
    assert f"node(s) {lost} lost: Slurm set them DOWN" in fault["error"], fault
    assert fault["iteration"] == 6 and fault["resumed_from"] == 5, fault  # the last checkpoint
    assert start_hosts(run.path, rank=1)[1] not in (lost, start_hosts(run.path, rank=0)[1])
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    row = hpc_json(run, cli_env(base=cluster.environ()))
    assert summary["restart_count"] == row["restarts"] == 1, (summary, row)
    assert summary["restart_reasons"] == row["restart_reasons"] == ["node-lost"], row
    ended_in_the_allocation(cluster, fault, summary, "node set DOWN")
    # report charges what sacct charges (its RESIZING row: 3 nodes until the node went);
    # the iteration done again costs its seconds, the idle spare is `spare`, not training.
    report = cluster.report_is_sacct(run.path, read_record(run.path).job_ids[0])
    node_s = {k: v * 3600 for k, v in report["phase_hours"].items()}
    assert report["recomputed_iterations"] == 1 and node_s["recomputed"] > 0, node_s
    assert node_s["spare"] > 0 and len(report["allocations"]) == 2, report


@pytest.mark.slurm
def test_slurm_failures_of_one_kind_end_with_one_exit_code(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Two 1-rank jobs with --max-restarts 0: one rank killed by SIGKILL, one raising. Both are
    crashes not restarted: sacct shows the same exit code for both jobs, EXIT_FAILED (srun
    passes on the signal's number for the killed one)."""
    jobs = []
    for fault in ("kill@2:rank0:once", "raise@2:rank0:once"):
        args = [*CARTPOLE, "--max-iterations", "4", "--nodes", "1", "--tasks-per-node", "1"]
        args += ["--max-restarts", "0"]
        proc = submit(slurm_cluster, args, tmp_path / fault[:4], fault, follow=False)
        assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
        jobs.append(wait_for(lambda r=tmp_path / fault[:4]: runs_under(r), 60, "run")[0])
    codes = []
    for path in jobs:
        job = wait_for(lambda p=path: read_record(p).job_ids, 120, "the job")[0]
        assert slurm_cluster.wait_job(job, timeout=180) == "FAILED"
        row = slurm_cluster.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "State,ExitCode"])
        codes.append(row.stdout.strip())
        assert read_record(path).faults[-1].reason == "crash", path
    assert codes == [f"FAILED|{EXIT_FAILED}:0"] * 2, codes


@pytest.mark.slurm
def test_slurm_hard_node_loss_goes_on_with_fewer_nodes(
    slurm_cluster3: SlurmCluster, tmp_path: Path
) -> None:
    """A 2-node job with --min-nodes 1 and no spare. Rank 1's node is lost after iteration 6
    (its slurmd and rank killed at once): the next srun step, in the same allocation, runs on
    the other node with one rank, which keeps its environments (rank 1's are dropped: the
    record, the rank log and status say so), to the end. No requeue, nothing left running."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--min-nodes", "1"]
    run, lost, summary, fault = lose_rank1_node(cluster, args, tmp_path, "on one node")
    kept = start_hosts(run.path, rank=0)[0]
    assert fault["excluded_nodes"] == [lost] and fault["world_size"] == [2, 1], fault
    assert fault["action"].endswith(
        "on 1 node(s), 1 rank(s) (--min-nodes 1; no spare left): "
        "the environments of rank(s) 1 dropped"
    ), fault
    assert fault["resumed_from"] + fault["recomputed"] == 6 and 0 < fault["recovery_s"] < 120
    start = read_record(run.path).last_start
    assert start.changed["world_size"] == [2, 1] and start.environments == "partly restored"
    assert start.resumed_from_iteration == fault["resumed_from"], start
    assert start_hosts(run.path, rank=0) == [kept, kept]
    assert "those of rank(s) 1 dropped" in run.rank_log(0).read_text()
    assert summary["iterations"] == 12 and summary["world_size"] == 1, summary
    row = hpc_json(run, cli_env(base=cluster.environ()))
    assert row["ranks"] == 1 and row["interruptions"][-1]["world_size"] == [2, 1], row
    ended_in_the_allocation(cluster, fault, summary, "node lost, on fewer nodes,")


@pytest.mark.slurm
def test_slurm_crash_with_a_spare_leaves_the_straggler_out(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 whose rank 1 works twice as long per iteration (a
    throttled node: MJLAB_HPC_FAULT's slow) and whose rank 0 raises after iteration 11. The
    straggler is named by iteration 10; the crash points at no node, but the next srun step,
    in the same allocation, leaves the straggler's node out for the spare, with the same
    world size, to the parameters of a run that never failed. No requeue, nothing left."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--spare-nodes", "1"]
    proc = submit(cluster, args, tmp_path, "slow@1:rank1:once,raise@11:rank0:once")
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    (fault,) = faults_of(run)
    slow, spare = start_hosts(run.path, rank=1)
    kept = start_hosts(run.path, rank=0)
    assert (fault["reason"], fault["kind"], fault["iteration"]) == ("crash", "in-allocation", 11)
    assert fault["straggler_nodes"] == [slow] and fault["excluded_nodes"] == [slow], fault
    assert f"straggler node(s) {slow} left out for a spare" in fault["action"], fault
    assert spare not in (slow, kept[0]) and kept == [kept[0], kept[0]], (slow, spare, kept)
    assert f"straggler: rank 1 on {slow} is " in run.rank_log(0).read_text()
    assert fault["resumed_from"] == 10 and fault["recomputed"] == 1, fault
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    ended_in_the_allocation(cluster, fault, summary, "crash, on the spare,")


@pytest.mark.slurm
def test_slurm_node_lost_for_good_past_slurmd_timeout(
    slurm_cluster3: SlurmCluster, tmp_path: Path
) -> None:
    """A 2-node job with --spare-nodes 1 whose rank 1's node is lost after iteration 6 and
    stays lost. The ranks go on on the spare at once; when Slurm calls the node dead
    (SlurmdTimeout, short on this cluster) it shrinks the job (--no-kill) instead of ending it
    with the node, and the ranks train on. A cancel then stops the run with a checkpoint, and
    Slurm's answer for the job is its end, not the row of its allocation before the shrink
    (sacct: RESIZING). Nothing is left."""
    cluster = slurm_cluster3
    config = cluster.run(["scontrol", "show", "config"]).stdout
    timeout = int(re.search(r"^SlurmdTimeout\s*=\s*(\d+)", config, re.M).group(1))  # type: ignore[union-attr]
    assert timeout == SLURMD_TIMEOUT_S, f"{cluster.state_dir} runs SlurmdTimeout={timeout}"
    args = [*COMMON[:-2], "--max-iterations", "100000", "--nodes", "2", "--tasks-per-node", "1"]
    args += ["--spare-nodes", "1"]
    proc = submit(cluster, args, tmp_path, "stop@6:rank1:once", follow=False)
    assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
    run = wait_for(lambda: runs_under(tmp_path) and RunDir(runs_under(tmp_path)[0]), 60, "run")
    iteration = lambda: (progress_records(run) or [{}])[-1].get("iteration", 0)  # noqa: E731
    env = cli_env(base=cluster.environ())
    lost = lose_rank1_node_after_6(cluster, run)
    try:
        wait_for(lambda: any(f.get("recovered_at") for f in faults_of(run)), 120, "the heal")
        state = lambda: cluster.run(["sinfo", "-h", "-n", lost, "-o", "%T"]).stdout  # noqa: E731
        wait_for(lambda: "down" in state(), timeout + 60, f"Slurm to call {lost} dead")
        job = read_record(run.path).job_ids[0]
        shown = cluster.run(["scontrol", "show", "job", job]).stdout
        assert "JobState=RUNNING" in shown and f"NodeList={lost}" not in shown, shown
        at = iteration()
        wait_for(lambda: iteration() >= at + 5, 120, "training to go on after the shrink")
        assert hpc_json(run, env)["state"] == "RUNNING"
        cancel = subprocess.run(
            [BIN / "mjlab-hpc", "cancel", str(run.path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cancel.returncode == 0, cancel.stderr
        assert cluster.wait_job(job, timeout=120) == "CANCELLED"
    finally:
        cluster.start_node(lost)
    answer = SlurmClient(env=cluster.environ()).answer([job])
    assert answer.rows[job].state == "CANCELLED", answer  # not RESIZING
    # sacct calls the job CANCELLED at once; the ranks record their stop a moment later.
    wait_for(lambda: read_record(run.path).state == "stopped", 30, "the ranks' stop record")
    assert restarts_of(cluster, job) == 0
    (fault,) = faults_of(run)
    assert fault["kind"] == "in-allocation" and fault["excluded_nodes"] == [lost], fault


@pytest.mark.slurm
def test_rendered_template_heals_a_crash_and_a_lost_node(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """`mjlab-hpc render train` with --spare-nodes 1, submitted with plain sbatch, heals as a
    submitted job does (the same loop): an exception in rank 1 after iteration 6 starts a new
    srun step in the allocation; rank 1's node lost after iteration 9 (its slurmd and rank
    killed at once) is left out for the spare once the step is ended by the loop's watcher.
    The ranks' clocks are an hour behind the batch host's. The run ends with the parameters of
    a run that never failed, in the one job, and the job's log has no "ignored" warning: the
    script's own variables are its own."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--spare-nodes", "1"]
    args += ["--gpus-per-node", "0", "--time", "10", "--log-root", str(tmp_path)]
    env = cli_env(
        {"MJLAB_HPC_FAULT": "raise@6:rank1:once,stop@9:rank1:once"}, base=cluster.environ()
    )
    render = subprocess.run(
        [BIN / "mjlab-hpc", "render", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert render.returncode == 0, render.stderr
    script = tmp_path / "job.sbatch"
    # The ranks' clocks an hour behind the batch host's: the healer finds their step by its
    # name (the script's _MJLAB_HPC_START), never by comparing clocks.
    behind = shlex.join(clock_ahead("-1h"))
    script.write_text(render.stdout.replace("train=(mjlab-train ", f"train=({behind} mjlab-train "))
    job = cluster.sbatch([str(script)], env=env, cwd=tmp_path)
    run = wait_for(lambda: runs_under(tmp_path) and RunDir(runs_under(tmp_path)[0]), 60, "run")
    lost = lose_rank1_node_after_6(cluster, run, after=9)
    try:
        summary = wait_for(
            lambda: run.summary.exists() and json.loads(run.summary.read_text()),
            300,
            "the healed run to finish",
        )
    finally:
        cluster.start_node(lost)
    crash, loss = faults_of(run)
    assert (crash["reason"], crash["kind"], crash["iteration"]) == ("crash", "in-allocation", 6)
    assert crash["ranks"] == [1], crash
    assert (loss["kind"], loss["hosts"], loss["excluded_nodes"]) == (
        "in-allocation",
        [lost],
        [lost],
    )
    assert summary["iterations"] == 12 and summary["world_size"] == 2, summary
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    assert str(summary["job_id"]) == str(job) and restarts_of(cluster, str(job)) == 0
    assert cluster.wait_job(job, timeout=120) == "COMPLETED"
    (log,) = tmp_path.glob(f"slurm-*-{job}.out")
    assert "ignored" not in log.read_text(), log.read_text()[-3000:]


@pytest.mark.slurm
def test_slurm_two_faults_at_once_then_a_writer_frozen_in_a_checkpoint(
    slurm_cluster3: SlurmCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """A 2-node job with --spare-nodes 1 and --hang-timeout-s 5. After iteration 6 rank 0
    raises and rank 1 kills itself (SIGKILL) at once, on two nodes: the fault names both ranks
    and nodes, and the next srun step leaves rank 1's node out for the spare (an exception is
    no node's fault). Then rank 0, the writer, stops itself (SIGSTOP) in its checkpoint write
    of iteration 10, its rank state written: rank 1, waiting for it in a collective, names
    rank 0 and its node as hung within the limit (not a collective timeout of its own), and
    the run heals to the parameters of a run that never failed. `logs` names them all."""
    cluster = slurm_cluster3
    args = [*COMMON, "--nodes", "2", "--tasks-per-node", "1", "--spare-nodes", "1"]
    args += ["--hang-timeout-s", "5"]
    fault = "raise@6:rank0:once,kill@6:rank1:once,stop@10:rank0:checkpoint:once"
    proc = submit(cluster, args, tmp_path, fault)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    crash, hang = faults_of(run)
    (writer, writer_again, _), (killed, spare, _) = (
        start_hosts(run.path, rank=0),
        start_hosts(run.path, rank=1),
    )
    assert writer == writer_again and spare not in (writer, killed), (writer, killed, spare)
    assert (crash["reason"], crash["kind"], crash["iteration"]) == ("crash", "in-allocation", 6)
    assert (crash["ranks"], crash["hosts"]) == ([0, 1], [writer, killed]), crash
    assert f"rank 0 on {writer} failed: RuntimeError: injected fault" in crash["error"], crash
    assert f"rank 1 on {killed} ended without an exit record" in crash["error"], crash
    assert crash["excluded_nodes"] == [killed] and crash["recomputed"] == 1, crash
    assert (hang["reason"], hang["iteration"], hang["ranks"]) == ("hang", 10, [0]), hang
    assert hang["hosts"] == [writer] and "in the checkpoint write" in hang["error"], hang
    assert f"{writer} not excluded: no spare" in hang["not_excluded"], hang
    waited = float(re.search(r"no progress for ([\d.]+) s", hang["error"]).group(1))  # type: ignore[union-attr]
    assert waited < 5 + 5, hang  # the limit, and a margin (a collective timeout: minutes)
    assert hang["resumed_from"] == 5 and hang["recomputed"] == 5, hang
    print(f"the frozen writer named {waited} s after its last progress (limit 5 s)")
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 12
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, REFERENCE, ranks=2)
    env = cli_env(base=cluster.environ())
    logs = hpc_logs(run, env)
    assert f"crash of rank 0, 1 on {writer}, {killed} at iteration 6" in logs, logs[-3000:]
    assert f"hang of rank 0 on {writer} at iteration 10" in logs, logs[-3000:]
    assert hpc_json(run, env)["restart_reasons"] == ["crash", "hang"]
    ended_in_the_allocation(cluster, hang, summary, "a writer frozen in a checkpoint,")

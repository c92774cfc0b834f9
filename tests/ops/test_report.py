"""mjlab-hpc report: what a run cost, as a user who is not root (mjlab-alice).

A local run of two ranks whose rank 0 raises after iteration 3 (healed in its allocation, from
the checkpoint of iteration 2) is checked against its own records: the phases add up to the
allocation, one iteration was recomputed, the env-steps are num_envs x steps x ranks x
iterations. A Slurm job of hers shows sacct's figures (TotalCPU, MaxRSS; the GPU figures the
test cluster does not gather said missing), and a report still comes when sacct fails.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import yaml
from helpers import BIN, Team, runs_under, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.ops.report import CostReport, collect_report
from mjlab_hpc.ops.runs import run_jobs
from mjlab_hpc.procs import ProcessId
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.liveness import NodeBeat, RankBeat, write_node_beat
from mjlab_hpc.rundir.record import Interruption, RunRecord, Start, read_record
from mjlab_hpc.slurm.client import SlurmClient

SMALL = ["--num-envs", "16", "--torch-threads", "1"]
PHASES = ("start_up", "training", "checkpointing", "recomputed", "lost_to_faults", "spare", "other")
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
    held = [a["nodes"] * (a["end"] - a["begin"] - a["suspended_s"]) for a in report["allocations"]]
    assert math.isclose(sum(held) / 3600, report["node_hours"], rel_tol=1e-6)


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
    print(shown.stdout)  # the figures, in the test's output
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
    # A plain job of hers first (no run directory, held until released), which her run's job
    # waits for, as a chain's link waits for the previous one.
    wrap = ["sbatch", "--parsable", "--hold", "-N1", "-o", "/dev/null", "--wrap", "sleep 3"]
    plain = team.run(alice, wrap, extra=cluster).stdout.strip()
    submit = [BIN / "mjlab-submit", "cartpole", *SMALL, "--gpus-per-node", "0", "--time", "10"]
    submit += ["--max-iterations", "3", "--save-interval", "2", "--log-root", logs]
    done = team.run(alice, [*submit, "--after", plain], extra=cluster, timeout=300)
    assert done.returncode == 0, _text(done)[-3000:]
    run = runs_under(team.shared / logs)[0]
    (job,) = run_jobs(run).job_ids  # the submitted job: it has not started yet
    waiting = _report(team, run, extra=cluster)
    assert waiting["node_hours"] == 0 and waiting["allocations"] == [], waiting
    assert any(n.startswith(f"job {job} is pending") for n in waiting["notes"]), waiting
    said = team.run(alice, [BIN / "mjlab-hpc", "report", plain, "--log-root", logs], extra=cluster)
    assert said.returncode == 2 and f"job {plain} is not an mjlab-hpc run" in said.stderr, said
    assert len(said.stderr.strip().splitlines()) == 1, said.stderr
    assert team.run(alice, ["scontrol", "release", plain], extra=cluster).returncode == 0
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED"
    # Node-seconds are sacct's own; every start and iteration lies in the allocation.
    truth = slurm_cluster.report_is_sacct(run, job)
    (held,) = truth["allocations"]
    assert held["eligible"] - held["submitted"] >= 2, held  # it waited for the plain job
    assert truth["queue_wait_s"] == held["begin"] - held["eligible"] < 5, truth
    # sacct's record of the steps lands a moment after the job ends.
    report = wait_for(
        lambda: (
            (r := _report(team, job, "--log-root", logs, extra=cluster))["efficiency"]
            and r["efficiency"]["max_rss_bytes"]
            and r["efficiency"]["total_cpu_s"]
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
    assert eff["max_rss_bytes"] > 2**20  # a process's resident memory: a MiB at least
    assert eff["missing"] == ["gres/gpuutil", "gres/gpumem"]
    assert report["iterations"] == 3 and report["phase_hours"]["training"] > 0
    shown = team.run(alice, [BIN / "mjlab-hpc", "report", job, "--log-root", logs], extra=cluster)
    print(shown.stdout)  # the figures, in the test's output
    assert "TotalCPU" in shown.stdout and "MaxRSS" in shown.stdout, shown.stdout
    assert "not gathered by this site: gres/gpuutil, gres/gpumem" in shown.stdout

    unknown = [BIN / "mjlab-hpc", "report", "999999", "--log-root", logs]
    refused = team.run(alice, unknown, extra=cluster)
    assert refused.returncode == 2 and "Slurm does not know it" in refused.stderr, _text(refused)

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


def test_phases_of_a_requeued_gpu_job_from_sacct(tmp_path: Path) -> None:
    """A two-node job with 8 GPUs, requeued after a node was lost at iteration 12 (resumed
    from 10), with sacct (a stand-in) answering as a site that gathers GPU figures: every
    phase is the seconds its records say, and the phases add up to sacct's allocations."""
    t = dt.datetime(2026, 11, 1, 10, 0, 0)
    at = t.timestamp()

    def iso(s: float) -> str:
        return (t + dt.timedelta(seconds=s)).isoformat(timespec="seconds")

    run = tmp_path / "run"
    (run / "logs" / "ranks").mkdir(parents=True)
    fault = Interruption(
        reason="node-lost",
        kind="requeue",
        job_id="7",
        iteration=12,
        at_s=at + 640,
        recomputed=2,
        resumed_from=10,
    )
    record = RunRecord(
        launch_mode="slurm",
        starts=(Start(job_id="7"),),
        job_ids=("7",),
        faults=(fault,),
        world_size=8,
        num_nodes=2,
        device="cuda:0",
    )
    (run / "run.json").write_text(json.dumps(record.to_json()))
    for number, began in ((1, 70), (2, 770)):
        start = {
            "run": "run",
            "rank": 0,
            "world_size": 8,
            "node": "node1",
            "pid": 1,
            "device": "cuda:0",
            "at": at + began,
        }
        (run / "logs" / "ranks" / f"rank0.{number}.start.json").write_text(json.dumps(start))
    (run / "logs" / "ranks" / "rank0.2.end.json").write_text(
        json.dumps({"how": "completed", "detail": "done", "at": at + 1340})
    )
    done = [(i, 120 + 50 * (i - 1)) for i in range(1, 11)] + [
        (i, 830 + 50 * (i - 11)) for i in range(11, 21)
    ]
    (run / "progress.jsonl").write_text(
        "".join(
            json.dumps(
                {"iteration": i, "env_steps": 1000, "collect_s": 30, "learn_s": 10, "time": at + s}
            )
            + "\n"
            for i, s in done
        )
    )
    (run / "logs" / "checkpoints.jsonl").write_text(
        "".join(
            json.dumps({"iteration": i, "at": at + s, "s": 10}) + "\n"
            for i, s in ((5, 320), (10, 570), (20, 1280))
        )
    )
    tres = "billing=8,cpu=8,gres/gpu=8,node=2"
    usage = "cpu=00:10:00,gres/gpumem=30G,gres/gpuutil=87,mem=2G"
    rows = [
        "JobID|State|Submit|Eligible|Start|End|ElapsedRaw|Suspended|NNodes|AllocCPUS|AllocTRES|"
        "TotalCPU|MaxRSS|TRESUsageInMax",
        f"7|NODE_FAIL|{iso(0)}|{iso(0)}|{iso(60)}|{iso(660)}|600|00:00:00|2|8|{tres}|01:00:00||",
        f"7.0|CANCELLED|{iso(60)}|{iso(60)}|{iso(61)}|{iso(660)}|599|00:00:00|2|8|{tres}|"
        f"59:00.500|2048K|{usage}",
        f"7|COMPLETED|{iso(660)}|{iso(660)}|{iso(760)}|{iso(1360)}|600|00:00:00|2|8|{tres}|"
        "02:00:00||",
        f"7.0|COMPLETED|{iso(760)}|{iso(760)}|{iso(761)}|{iso(1360)}|599|00:00:00|2|8|{tres}|"
        f"01:59:00|4096K|{usage}",
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\ncat <<'ROWS'\n" + "\n".join(rows) + "\nROWS\n")
    (bin_dir / "sacct").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    report = collect_report(run, SlurmClient(env=env)).as_dict()
    _adds_up(report)
    node_s = {k: round(v * 3600 / 2, 6) for k, v in report["phase_hours"].items()}
    assert node_s == {
        "start_up": 20 + 30,
        "training": 480 + 490,
        "checkpointing": 30,
        "recomputed": 60,
        "lost_to_faults": 20,  # to the end of the allocation: the wait for the requeue is queue
        "spare": 0,
        "other": 70,
    }
    assert report["source"] == "sacct" and len(report["allocations"]) == 2
    assert report["queue_wait_s"] == 60 + 100
    assert report["node_hours"] == pytest.approx(2 * 1200 / 3600)
    assert report["gpu_hours"] == pytest.approx(8 * 1200 / 3600) and report["per"] == "GPU-hour"
    assert report["recomputed_iterations"] == 2 and report["iterations"] == 20
    assert report["env_steps_per_hour"] == pytest.approx(20_000 / report["gpu_hours"])
    eff = report["efficiency"]
    assert eff["total_cpu_s"] == pytest.approx(59 * 60 + 0.5 + 119 * 60)
    assert eff["cpu_efficiency"] == pytest.approx(eff["total_cpu_s"] / (1200 * 8), abs=1e-4)
    assert eff["max_rss_bytes"] == 4096 * 1024 and eff["missing"] == []
    assert (eff["gpu_util"], eff["gpu_mem"]) == ("87", "30G")


def _lines_run(module_file: str, work: Callable[[], object]) -> int:
    """Lines of `module_file` executed while `work` runs: its own work, whatever the clock."""
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> object:
        nonlocal count
        count += event == "line"
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> object:
        return local if frame.f_code.co_filename == module_file else None

    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


def test_report_out_of_a_long_run_is_linear_work(tmp_path: Path) -> None:
    """report --out of a run healed every 100 iterations, with a checkpoint after each: four
    times the iterations is at most about four times report.py's own lines run, and the
    figure's drawn objects grow only by the marks of each heal (one collection per phase, one
    line of iterations), where it was a bar per piece and a pass over every span per piece
    (docs/performance.md)."""
    import matplotlib.figure

    import mjlab_hpc.ops.report as report
    from benchmarks.cost_report import make_run

    figure = matplotlib.figure.Figure

    def cost(n: int) -> tuple[int, int]:
        run = make_run(tmp_path / str(n) / "2026-01-01_00-00-00", n, save_every=1, heal_every=100)
        got: list[CostReport] = []
        lines = _lines_run(report.__file__, lambda: got.append(collect_report(run)))
        drawn: list[int] = []
        real = figure.savefig

        def counted(fig: matplotlib.figure.Figure, *args: object, **kwargs: object) -> None:
            drawn.append(sum(len(ax.get_children()) for ax in fig.axes))
            real(fig, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(figure, "savefig", counted)
            report.draw_timeline(got[0], tmp_path / f"{n}.png")
        assert len(got[0].timeline) > 2 * n  # a piece per checkpoint and per iteration span
        return lines, drawn[0]

    (small, drawn_small), (large, drawn_large) = cost(500), cost(2000)
    assert large <= 4.5 * small, (small, large)
    # A start and a fault each draw a line on both axes and a word: 6 per heal, nothing more.
    heals = (2000 - 500) // 100
    assert drawn_large <= drawn_small + 6 * heals, (drawn_small, drawn_large)


USAGE_HEADER = (
    "JobID|State|Submit|Eligible|Start|End|ElapsedRaw|Suspended|NNodes|AllocCPUS|AllocTRES|"
    "TotalCPU|MaxRSS|TRESUsageInMax"
)


def _slurm_run(
    tmp_path: Path,
    name: str,
    rows: list[str],
    starts: list[tuple[float, list[str]]],
    done: list[float],
) -> tuple[Path, SlurmClient, float]:
    """A Slurm run whose ranks started at the given seconds on the given nodes, did iterations
    at the `done` seconds (8 s of work each), with sacct (a stand-in) printing `rows` (`{t60}`:
    60 s after the start); returns it, its client and sacct's own node-seconds."""
    t = dt.datetime(2026, 11, 1, 10, 0, 0)
    iso = {f"t{s}": (t + dt.timedelta(seconds=s)).isoformat() for s in range(0, 3000, 5)}
    rows = [r.format(**iso) for r in rows]
    run = tmp_path / name
    (run / "logs" / "ranks").mkdir(parents=True)
    at = t.timestamp()
    for number, (began, nodes) in enumerate(starts, start=1):
        for rank, node in enumerate(nodes):
            start = {"run": name, "rank": rank, "world_size": len(nodes), "node": node}
            start.update(pid=1, device="cpu", at=at + began)
            (run / "logs" / "ranks" / f"rank{rank}.{number}.start.json").write_text(
                json.dumps(start)
            )
    record = RunRecord(
        launch_mode="slurm",
        starts=tuple(Start(job_id=name) for _ in starts or [0]),
        job_ids=(name,),
        world_size=len(starts[0][1]) if starts else 1,
        num_nodes=len(set(starts[0][1])) if starts else 1,
        device="cpu",
    )
    (run / "run.json").write_text(json.dumps(record.to_json()))
    lines = [
        {"iteration": i, "env_steps": 10, "collect_s": 6, "learn_s": 2, "time": at + s}
        for i, s in enumerate(done, start=1)
    ]
    (run / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    bin_dir = tmp_path / f"bin-{name}"
    bin_dir.mkdir()
    script = "#!/bin/sh\ncat <<'ROWS'\n" + "\n".join([USAGE_HEADER, *rows]) + "\nROWS\n"
    (bin_dir / "sacct").write_text(script)
    (bin_dir / "sacct").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    truth = sum(
        int(r.split("|")[6]) * int(r.split("|")[8]) for r in rows if "." not in r.split("|")[0]
    )
    return run, SlurmClient(env=env), truth


def test_report_against_sacct_for_every_kind_of_job(tmp_path: Path) -> None:
    """Node-seconds equal sacct's own (ElapsedRaw x NNodes over the job's rows) for a job
    shrunk after a node was lost (its RESIZING row), a suspended job (Suspended seconds in no
    phase) and a chain link that waited on the previous one (no queue wait: Eligible);
    a spare node idle while the ranks ran is `spare`, not training; a pending job is said."""
    rows = [  # 3 nodes (one a spare) until node3 went down at 300 s, then 2 to the end
        "7|RESIZING|{t0}|{t0}|{t60}|{t300}|240|00:00:00|3|3|cpu=3,node=3|||",
        "7|COMPLETED|{t300}|{t300}|{t300}|{t600}|300|00:00:00|2|2|cpu=2,node=2|||",
    ]
    done = [130 + 10 * i for i in range(5)] + [330 + 10 * i for i in range(7)]
    starts = [(70.0, ["node1", "node2"]), (310.0, ["node1", "node3"])]
    run, slurm, truth = _slurm_run(tmp_path, "7", rows, starts, done)
    record = read_record(run)
    fault = Interruption(
        reason="node-lost",
        kind="in-allocation",
        job_id="7",
        iteration=6,
        recomputed=1,
        resumed_from=5,
        at_s=dt.datetime(2026, 11, 1, 10, 4, 50).timestamp(),
    )
    (run / "run.json").write_text(
        json.dumps(dataclasses.replace(record, faults=(fault,)).to_json())
    )
    # Start 2 cut progress back to iteration 5: iteration 6 was lost with node2 at 290 s.
    report = collect_report(run, slurm).as_dict()
    _adds_up(report)
    node_s = {k: round(v * 3600, 6) for k, v in report["phase_hours"].items()}
    assert report["node_hours"] * 3600 == pytest.approx(truth) == 240 * 3 + 300 * 2
    assert report["recomputed_iterations"] == 1 and report["notes"] == [], report["notes"]
    assert node_s == {
        "start_up": 2 * (122 - 60) + 2 * (322 - 300),
        "training": 2 * (170 - 122) + 2 * (390 - 322),
        "checkpointing": 0,
        "recomputed": 2 * (290 - 170),  # from the last iteration kept to the fault
        "lost_to_faults": 3 * (300 - 290),
        "spare": 1 * (290 - 60),  # node3, idle while the ranks worked on two nodes
        "other": 2 * (600 - 390),
    }

    rows = ["8|COMPLETED|{t0}|{t0}|{t0}|{t440}|290|00:02:30|1|1|cpu=1,node=1|||"]
    done = [130 + 10 * i for i in range(5)] + [330 + 10 * i for i in range(5)]
    run, slurm, truth = _slurm_run(tmp_path, "8", rows, [(100.0, ["node1"])], done)
    report = collect_report(run, slurm).as_dict()
    _adds_up(report)
    assert report["node_hours"] * 3600 == pytest.approx(truth) == 290
    assert report["suspended_s"] == 150 and report["queue_wait_s"] == 0
    node_s = {k: round(v * 3600, 6) for k, v in report["phase_hours"].items()}
    # Suspended in the longest pause of the records (170-330 s): 150 s in no phase.
    assert (node_s["start_up"], node_s["training"], node_s["other"]) == (122, 248 - 150, 70)
    assert ("suspended", 180.0, 330.0) in _timeline(run, slurm), node_s

    rows = ["9|COMPLETED|{t0}|{t500}|{t510}|{t600}|90|00:00:00|1|1|cpu=1,node=1|||"]
    run, slurm, truth = _slurm_run(tmp_path, "9", rows, [], [])
    report = collect_report(run, slurm).as_dict()
    assert report["queue_wait_s"] == 10 and report["node_hours"] * 3600 == truth == 90

    rows = ["10|PENDING|{t0}|{t0}|Unknown|Unknown|0|00:00:00|1|0||||"]
    run, slurm, truth = _slurm_run(tmp_path, "10", rows, [], [])
    report = collect_report(run, slurm).as_dict()
    assert report["node_hours"] == 0 == truth and report["allocations"] == []
    assert any(n.startswith("job 10 is pending: it has waited for ") for n in report["notes"])


def _timeline(run: Path, slurm: SlurmClient) -> list[tuple[str, float, float]]:
    t0 = dt.datetime(2026, 11, 1, 10, 0, 0).timestamp()
    return [(p.name, p.begin - t0, p.end - t0) for p in collect_report(run, slurm).timeline]


def test_a_killed_local_run_costs_nothing_after_its_last_record(tmp_path: Path) -> None:
    """A local run whose processes were killed (no end record, run.json still `running`,
    none of its recorded processes alive): its allocation ends at its last record, said in
    a note, instead of growing with the clock as a run that still runs."""
    from benchmarks.cost_report import T0, make_run

    run = make_run(tmp_path / "2026-01-01_00-00-00", 20, heal_every=1000)
    for end in (run / "logs" / "ranks").glob("*.end.json"):
        end.unlink()
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "state": "running"}))
    RunDir(run).heartbeats.mkdir(parents=True)
    gone = ProcessId(2**22 - 1, T0, "gone")  # a rank that no longer runs
    write_node_beat(RunDir(run), NodeBeat("vm", 0, 1, (RankBeat(0, "vm", gone, 3, 1),)))
    assert len(RunDir(run).node_beats()) == 1
    report = collect_report(run).as_dict()
    (allocation,) = report["allocations"]
    last = max(p["time"] for p in map(json.loads, (run / "progress.jsonl").open()))
    assert allocation["end"] == pytest.approx(last + 0.1)  # its last checkpoint's end
    assert any("processes are gone and left no end record" in n for n in report["notes"])
    assert not any("still running" in n for n in report["notes"])

    # Named as made years before its first start (anyone may name a --run-dir): the machine
    # is held from that start, not from the name.
    named = run.rename(tmp_path / "2020-01-01_00-00-00")
    (moved,) = collect_report(named).as_dict()["allocations"]
    assert moved["begin"] >= T0 and moved["end"] == allocation["end"]

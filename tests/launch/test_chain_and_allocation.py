"""Job chains and existing allocations on the real two-node Slurm test cluster.

With `mjlab-submit --chain 3` and a short --time, the first job meets its real time limit,
saves a checkpoint and ends without a requeue. The second job continues the run from that
checkpoint, and `mjlab-hpc cancel` stops it and the still-queued third. A chained sweep
(behind a held job, so nothing trains) queues one job array per link; cancelling the first
array's id removes them all.

Inside `salloc`, `mjlab-submit` starts the ranks with srun in the allocation (no new job),
refuses a request larger than the allocation, and Ctrl-C stops every rank with a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import BIN, cli_env, only_run, progress_records, wait_for
from slurm_cluster import SlurmCluster

from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record

pytestmark = pytest.mark.slurm


def _run(cluster: SlurmCluster, *args: str, timeout: float = 120) -> tuple[int, str]:
    proc = subprocess.run(
        [*args],
        env=cli_env(base=cluster.environ()),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_chain_continues_the_run_after_the_time_limit_and_cancel_stops_it_all(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    args = [str(BIN / "mjlab-submit"), "cartpole", "--gpus-per-node", "0", "--num-envs", "32"]
    args += ["--torch-threads", "1", "--max-iterations", "100000", "--save-interval", "100000"]
    args += ["--log-root", str(tmp_path), "--time", "1", "--signal-delay-s", "45", "--chain", "3"]
    code, out = _run(slurm_cluster, *args)
    assert code == 0, out
    chain = re.search(r"(\d+) -> (\d+) -> (\d+)", out)
    assert chain, out
    first, second, third = chain.groups()
    squeue = slurm_cluster.run(["squeue", "-h", "-j", third, "-o", "%E"]).stdout
    assert f"afterany:{second}" in squeue, squeue
    try:
        _chain_continues(slurm_cluster, only_run(tmp_path), first, second, third)
    finally:  # leave no job behind, whatever failed
        slurm_cluster.run(["scancel", first, second, third], check=False)


def _chain_continues(
    slurm_cluster: SlurmCluster, run: RunDir, first: str, second: str, third: str
) -> None:
    def second_started() -> dict | None:
        record = json.loads(run.record.read_text()) if run.record.exists() else {}
        starts = record.get("starts", [])
        return record if len(starts) >= 2 and progress_records(run) else None

    record = wait_for(second_started, 150, "the chain's second job to start the run again")
    starts = record["starts"]
    assert [s["job_id"] for s in starts[:2]] == [first, second], starts
    stop = record["restarts"][0]
    assert stop["reason"] == "time-limit", stop
    # The second job continued from the first one's stop checkpoint.
    assert starts[1]["resumed_from_iteration"] == stop["iteration"] > 0, (starts, stop)
    # The first job ended at its time limit without a requeue (one attempt, not REQUEUED).
    attempts = slurm_cluster.run(
        ["sacct", "-n", "-P", "-X", "--duplicates", "-j", first, "-o", "State"]
    ).stdout.split()
    assert attempts == ["COMPLETED"], attempts
    err = run.path / "submitit" / f"{first}_0_log.err"
    assert "job 1 of 3 of the chain ends here" in err.read_text()

    _, said = _run(slurm_cluster, str(BIN / "mjlab-hpc"), "status", "--json", str(run.path))
    status = json.loads(said)
    assert status[0]["state"] == "RUNNING", status
    assert status[0]["job_ids"] == [first, second, third], status

    code, out = _run(slurm_cluster, str(BIN / "mjlab-hpc"), "cancel", str(run.path))
    assert code == 0, out
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = slurm_cluster.run(["squeue", "-h", "-j", f"{second},{third}", "-o", "%i %T"])
        if not left.stdout.strip():
            break
        time.sleep(0.5)
    states = {j: slurm_cluster.sacct_state(j) for j in (second, third)}
    assert states == {second: "CANCELLED", third: "CANCELLED"}, states
    # The running link's stop is its own time limit or the cancel, never a preemption.
    stops = [s.reason for s in read_record(run.path).restarts[1:]]
    assert set(stops) <= {"time-limit", "cancelled"}, stops


SALLOC = ["salloc", "-N2", "--ntasks-per-node=1", "-t", "5"]


def test_inside_salloc_the_ranks_run_in_the_allocation_and_ctrl_c_saves_them(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    small = ["cartpole", "--gpus-per-node", "0", "--num-envs", "32", "--torch-threads", "1"]
    small += ["--log-root", str(tmp_path)]
    submit = str(BIN / "mjlab-submit")
    code, out = _run(slurm_cluster, *SALLOC, submit, *small, "--nodes", "3")
    assert code == 2 and "--nodes: 3 nodes asked for; allocation" in out, out
    code, out = _run(slurm_cluster, *SALLOC, submit, *small, "--nodes", "2", "--dry-run")
    assert code == 0 and "--nodes=2 --ntasks=2 --ntasks-per-node=1" in out, out
    assert not list(tmp_path.iterdir())

    # In the same allocation: the dry run, then the run, whose srun is the one it printed.
    pid_file = tmp_path.parent / f"{tmp_path.name}.pid"
    dry = pid_file.with_name(pid_file.name + ".dry")
    args = [*small, "--nodes", "2", "--max-iterations", "100000"]
    args += ["--run-dir", str(tmp_path / "cartpole" / "run")]
    dry_run_then_run = 'echo $$ > "$0"; "$@" --dry-run > "$0.dry"; exec "$@"'
    proc = subprocess.Popen(
        [*SALLOC, "bash", "-c", dry_run_then_run, str(pid_file), submit, *args],
        env=cli_env(base=slurm_cluster.environ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run = wait_for(lambda: _progressing(tmp_path, 3), 120, "the ranks to train")
        printed = dry.read_text().split("(dry run: not started) ----\n")[1].strip()
        srun = next(
            p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == "srun"
        )
        started = [
            f"{k}={shlex.quote(v)}"
            for k, v in sorted(srun.environ().items())
            if k.startswith("_MJLAB_HPC_")
            or k.startswith("PYTHONSAFE")
            or (k == "PYTHONPATH" and v != os.environ.get(k))
        ]
        cmdline = srun.info["cmdline"]
        assert printed == " ".join([*started, shlex.join(cmdline)]), (printed, started, cmdline)
        queued = slurm_cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split("\n")
        assert len([q for q in queued if q.strip()]) == 1, queued  # the allocation, no new job
        subprocess.run(["kill", "-INT", pid_file.read_text().strip()], check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out
    assert "inside Slurm allocation" in out and "stopped at iteration" in out, out
    record = json.loads(run.record.read_text())
    assert record["state"] == "stopped", record
    stop = record["restarts"][-1]
    assert (run.path / f"model_{stop['iteration']}.pt").exists()
    assert [p for p in run.logs.glob("task-*.out")], "srun's per-task output"
    left = subprocess.run(["pgrep", "-f", str(run.path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def _progressing(root: Path, iterations: int) -> RunDir | None:
    runs = [p for p in root.glob("*/*") if p.is_dir()]
    if not runs:
        return None
    run = RunDir(runs[0])
    return run if len(progress_records(run)) >= iterations else None


def test_a_chained_sweep_queues_one_array_per_link_and_cancel_stops_them_all(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # Everything waits behind a held job: the dependencies are Slurm's, nothing trains.
    held = slurm_cluster.run(
        ["sbatch", "--parsable", "--hold", "--output", "/dev/null", "--time", "1", "--wrap", "true"]
    ).stdout.strip()
    try:
        args = [str(BIN / "mjlab-submit"), "cartpole", "--gpus-per-node", "0", "--num-envs", "16"]
        args += ["--torch-threads", "1", "--max-iterations", "4", "--log-root", str(tmp_path)]
        args += ["--time", "5", "--sweep", "seed=1,2", "--chain", "2", "--after", held]
        code, out = _run(slurm_cluster, *args)
        assert code == 0, out
        elements = sorted(tmp_path.glob("cartpole/*/sweep_element.json"))
        assert len(elements) == 2, out
        records = [json.loads(p.read_text()) for p in elements]
        first = records[0]["job_id"].split("_")[0]
        second = records[0]["chain"][0].split("_")[0]
        assert first != second
        # Each element's job in the later array is its continuation.
        assert [r["chain"] for r in records] == [[f"{second}_0"], [f"{second}_1"]], records
        deps = slurm_cluster.run(["squeue", "-h", "-r", "-o", "%i %E"]).stdout
        assert f"{first}_0 afterany:{held}" in deps and f"{second}_1 afterany:{first}" in deps, deps
        # The first array's id names the sweep: its later arrays go too.
        code, out = _run(slurm_cluster, str(BIN / "mjlab-hpc"), "cancel", first)
        assert code == 0, out
        squeue = ["squeue", "-h", "-j", f"{first},{second}", "-o", "%i"]
        wait_for(
            lambda: not slurm_cluster.run(squeue).stdout.strip(),
            30,
            "both arrays of the chain to leave the queue",
        )
    finally:
        slurm_cluster.run(["scancel", held], check=False)


def _scripts(dry_run_output: str) -> list[str]:
    """The sbatch scripts a dry run printed, in order."""
    parts = re.split(r"^# ---- sbatch script.*----\n", dry_run_output, flags=re.M)
    return [p.split("\n# ---- ")[0] for p in parts[1:]]


def _options(script: str) -> list[str]:
    """A script's #SBATCH lines but where its batch log goes (mjlab-submit's: the run's
    submitit folder; a template's: where sbatch runs)."""
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    return sorted(x for x in lines if not x[8:].startswith(("--output", "--error", "--wckey")))


def test_what_is_submitted_is_what_the_dry_run_shows(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A job of a --chain of 2 and a sweep's job arrays of a --chain of 2 (everything held
    behind a held job: nothing trains): every script submitted is the one the dry run printed
    (its run or sweep directory, and the id of the job before, as Slurm gave them). The
    template rendered for the same job has its #SBATCH lines and trains in its run directory."""
    held = slurm_cluster.run(
        ["sbatch", "--parsable", "--hold", "--output", "/dev/null", "--time", "1", "--wrap", "true"]
    ).stdout.strip()
    submit = [str(BIN / "mjlab-submit"), "cartpole", "--gpus-per-node", "0", "--num-envs", "16"]
    submit += ["--torch-threads", "1", "--max-iterations", "4", "--time", "5"]
    submit += ["--chain", "2", "--after", held, "--nodes", "2"]
    queued = [held]
    shown = ""
    try:
        one, many = tmp_path / "one", tmp_path / "sweep"
        single = [*submit, "--log-root", str(one), "--run-dir", str(one / "cartpole" / "run")]
        sweep = [*submit, "--log-root", str(many), "--sweep", "seed=1,2"]
        for args, root in ((single, one), (sweep, many)):
            dry = subprocess.run(
                [*args, "--dry-run"],
                env=cli_env(base=slurm_cluster.environ()),
                capture_output=True,
                text=True,
                timeout=120,
            )
            printed = _scripts(dry.stdout)
            assert dry.returncode == 0 and len(printed) == 2, dry.stdout + dry.stderr
            shown = shown or printed[0]  # the single job's
            code, out = _run(slurm_cluster, *args)
            assert code == 0, out
            (folder,) = {p for p in root.rglob("submitit") if p.is_dir() and not p.is_symlink()}
            jobs = sorted(folder.glob("*_submission.sh"), key=lambda p: int(p.name.split("_")[0]))
            ids = [p.name.split("_")[0] for p in jobs]
            queued += ids
            assert len(jobs) == 2, jobs
            planned = re.search(r"--output=(\S+)/submitit/", printed[0]).group(1)  # type: ignore[union-attr]
            for text, job in zip(printed, jobs, strict=True):
                text = text.replace(planned, str(folder.parent)).replace("JOB1", ids[0])
                assert text == job.read_text(), job
        # The template for the single job's flags (one job: no chain): the same #SBATCH lines
        # but the chain's, and Slurm takes it as it is.
        chained = single.index("--chain")
        alone = single[1:chained] + single[chained + 4 :]  # without --chain 2 --after HELD
        code, template = _run(slurm_cluster, str(BIN / "mjlab-hpc"), "render", "train", *alone)
        assert code == 0 and f"RUN_DIR={one / 'cartpole' / 'run'}\n" in template, template
        options = [x for x in _options(shown) if "dependency" not in x]
        assert _options(template) == options, (template, shown)
        script = tmp_path / "job.sbatch"
        script.write_text(template)
        test_only = slurm_cluster.run(["sbatch", "--test-only", str(script)], check=False)
        assert test_only.returncode == 0, test_only.stderr
    finally:
        slurm_cluster.run(["scancel", *queued], check=False)

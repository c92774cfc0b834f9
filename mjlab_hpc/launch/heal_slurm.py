"""The heal step of a Slurm job script: it acts on the decision of `launch/heal` after srun.

It runs in the batch shell, which outlives the ranks (`mjlab-hpc heal`). It records the
decision, then prints the srun options of the next step in the allocation, or requeues the
job without the suspect nodes, or lets it end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from mjlab_hpc.errors import (
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_RESTART,
    job_exit_code,
)
from mjlab_hpc.launch.heal import Healing, Step, decide, place_restart, record_healing
from mjlab_hpc.rank.context import START_ENV
from mjlab_hpc.rundir.ends import rank_ends
from mjlab_hpc.rundir.layout import SUBMITIT_DIR, SWEEP_ELEMENTS, read_sweep
from mjlab_hpc.slurm.client import SlurmClient, own_job, retry_s

__all__ = ["apply_slurm", "heal_job", "heal_slurm", "job_run_dir"]

log = logging.getLogger("mjlab_hpc")


def job_run_dir(path: Path, env: Mapping[str, str]) -> Path:
    """Return the run directory of this job: `path`, or this array element's run.

    For a sweep's job array `path` is the sweep's directory, which links each element's run.
    """
    index = env.get("SLURM_ARRAY_TASK_ID", "0")
    link = path / SWEEP_ELEMENTS / index
    if link.is_dir():
        return link.resolve()
    sweep = read_sweep(path)
    found = [e.run_dir for e in sweep.elements if str(e.index) == index] if sweep else []
    return found[0] if found and found[0] is not None else path


def apply_slurm(client: SlurmClient, job_id: str, heal: Healing) -> bool:
    """Requeue the job from inside it, excluding the suspect nodes; True when done."""
    if not heal.exclude:
        return client.requeue(job_id)
    nodes = ",".join(dict.fromkeys([*client.excluded_nodes(job_id), *heal.exclude]))
    # A running job's ExcNodeList cannot change; a requeued one's can, in the seconds before
    # Slurm may start it again (its begin time). The requeue ends this script (SIGTERM,
    # SIGKILL after KillWait): the change follows at once. No requeuehold and later release:
    # a release before the requeue completes is lost, and a helper meant to release it later
    # dies with the job under proctrack/cgroup: the job stayed held for good (seen on 22.05
    # and 24.11 with task/cgroup).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not client.requeue(job_id):
        return False
    update = client.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={nodes}"])
    if update is None or update.returncode != 0:  # it runs again, maybe on the same node
        log.error("excluding %s failed: %s", nodes, update and update.stderr.strip())
    return True


def _say(heal: Healing) -> None:
    """Tell the job's output what was decided."""
    lines = [heal.describe()]
    if heal.entry.excluded_nodes:
        lines.append(f"excluding node(s) {', '.join(heal.entry.excluded_nodes)}")
    if heal.entry.not_excluded:
        lines.append(heal.entry.not_excluded)
    for line in lines:
        print(f"mjlab-hpc heal: {line}", file=sys.stderr, flush=True)


def _drop_results(submitit_dir: Path, job_id: str | None) -> None:
    """Delete the failed start's submitit results (a rank's exception).

    `mjlab-submit --follow` would take one that the next start has not rewritten yet for its
    own (seen on 24.11).
    """
    key = own_job(os.environ) or job_id
    for stale in submitit_dir.glob(f"{key}_*_result.pkl"):
        stale.unlink(missing_ok=True)


def _srun_options(step: Step, tasks_per_node: int) -> str:
    """Return the batch script's srun options for its next step."""
    options = [f"--exclude={','.join(step.excluded)}"] if step.excluded else []
    if step.nodes is not None:
        options += [f"--nodes={step.nodes}", f"--ntasks={step.nodes * tasks_per_node}"]
    return " ".join(options)


def _lost_nodes(
    client: SlurmClient, run_dir: Path, job_id: str | None, start: str | None, since: float | None
) -> list[str]:
    """Return the nodes of the srun step `start` that Slurm set DOWN or FAIL since `since`.

    The step's nodes are its ranks' hosts (else the allocation's: an older script). Lost are
    those Slurm took out of the job (--no-kill: it shrinks the job at once), and those it
    says are down, or were since `since`; never the step's healthy nodes.
    """
    hosts = sorted({e.host for e in rank_ends(run_dir) if start and e.start_id == start and e.host})
    alloc = client.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or []
    hosts = hosts or alloc
    if not hosts:
        return []
    now = client.job_fields(job_id) if job_id else None
    kept = client.hostnames(now.get("NodeList", "")) if now else None
    gone = [h for h in hosts if kept and h in alloc and h not in kept]
    return sorted({*gone, *(client.lost_nodes(",".join(hosts), since=since) or ())})


def heal_slurm(
    run_dir: Path,
    exit_code: int,
    max_restarts: int,
    client: SlurmClient,
    since: float | None = None,
    submitit_dir: Path | None = None,
    step_nodes: int | None = None,
    min_nodes: int | None = None,
    tasks_per_node: int = 1,
) -> int:
    """Decide, record and act after the batch script's srun step; return the script's exit code.

    EXIT_RESTART asks the script for another srun step, whose options are printed on stdout.
    `since`: when this srun step began; `submitit_dir`: the job's submitit folder;
    `step_nodes`: the nodes of a step (the allocation's others are spares); `min_nodes`: the
    fewest nodes a step may go on with (`tasks_per_node` ranks each).
    """
    if exit_code in (EXIT_OK, EXIT_REQUEUE):  # done; or a stop the ranks want requeued
        return exit_code
    # EXIT_RESTART from srun came from a rank, not from us: passed on, the script would loop.
    fail_code = job_exit_code(exit_code)
    job_id = os.environ.get("SLURM_JOB_ID")  # what the ranks record
    job = own_job(os.environ)  # what Slurm's commands name: this array element, not the array
    start = os.environ.get(START_ENV) or None
    heal = decide(
        run_dir,
        max_restarts,
        job_id=job_id,
        since=None if start else since,
        slurm_oom=bool(job and client.out_of_memory(job)),
        start=start,
        lost=lambda: _lost_nodes(client, run_dir, job, start, since),
    )
    if heal.fault is None:
        return fail_code
    # A fault not healed ends the job with its kind's code, whatever srun's was.
    fail_code = EXIT_HUNG if heal.fault.reason == "hang" else EXIT_FAILED
    step = place_restart(
        client,
        run_dir,
        heal,
        step_nodes=step_nodes,
        min_nodes=min_nodes,
        tasks_per_node=tasks_per_node,
    )
    _say(heal)
    try:
        record_healing(run_dir, heal)
    except Exception as exc:  # the run matters more than its record: heal anyway
        log.error("could not record the fault in run.json: %s", exc)
        step = None  # unrecorded restarts would escape --max-restarts: a requeue instead
    if heal.requeue and submitit_dir is not None:
        _drop_results(submitit_dir, job_id)
    if step is not None:
        print(_srun_options(step, tasks_per_node), flush=True)
        return EXIT_RESTART
    if heal.requeue and job:
        if shutil.which("scontrol", path=(client.env or os.environ).get("PATH")) is None:
            return EXIT_REQUEUE  # inside an image without Slurm's client: the batch shell requeues
        if apply_slurm(client, job, heal):
            return EXIT_OK
    if heal.requeue:  # run.json must not say requeued
        heal.requeue = False
        heal.entry = dataclasses.replace(
            heal.entry,
            kind="failed",
            action=f"{heal.why}, but Slurm refused the requeue (see the job's output)",
        )
        with contextlib.suppress(Exception):
            record_healing(run_dir, heal, replace_last=True)
    return fail_code


def heal_job(
    run_dir: Path,
    exit_code: int,
    max_restarts: int,
    elapsed_s: float | None = None,
    step_nodes: int | None = None,
    min_nodes: int | None = None,
    tasks_per_node: int = 1,
) -> int:
    """Run a Slurm job script's heal step after srun (see `heal_slurm`); never raises.

    Returns the script's exit code. `run_dir`: the job's run directory, or a sweep's;
    `elapsed_s`: how long the srun step ran.
    """
    logging.basicConfig(level=logging.INFO, format="mjlab-hpc heal: %(message)s")
    since = time.time() - elapsed_s if elapsed_s is not None else None
    try:
        return heal_slurm(
            job_run_dir(run_dir, os.environ),
            exit_code,
            max_restarts,
            SlurmClient(retry_s=retry_s()),  # slurmctld away: wait for it (bounded)
            since=since,
            submitit_dir=run_dir / SUBMITIT_DIR,
            step_nodes=step_nodes,
            min_nodes=min_nodes,
            tasks_per_node=tasks_per_node,
        )
    except Exception as exc:  # the job's own exit code matters more than ours
        print(f"mjlab-hpc heal: could not heal on {socket.gethostname()}: {exc}", file=sys.stderr)
        return EXIT_FAILED if exit_code == EXIT_OK else job_exit_code(exit_code)

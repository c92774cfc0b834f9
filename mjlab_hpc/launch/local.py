"""Start the ranks of one job on this machine, through submitit's local executor.

Used by `mjlab-train --num-procs N` (N CPU ranks) and `--gpu-ids 0 1 ...` (one rank per GPU).
The launcher decides the run directory and the rendezvous port once and hands both to every
rank; each rank runs the same `train_rank` as any other launch path.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import submitit

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rank.job import RankJob
from mjlab_hpc.rundir.layout import SUBMITIT_DIR, create_run_dir
from mjlab_hpc.spec import ResolvedSpec, TrainSpec

if TYPE_CHECKING:
    from mjlab_hpc.rank.entry import RankResult

__all__ = [
    "LOCAL_TIMEOUT_MIN",
    "JobFailed",
    "LaunchPlan",
    "LocalJob",
    "follow",
    "free_port",
    "physical_gpu_ids",
    "plan_launch",
    "rank_outcomes",
    "run_local",
    "submit_local",
    "wait_local",
]

# Local jobs run until they finish; submitit's default (2 minutes) would stop them.
LOCAL_TIMEOUT_MIN = 60 * 24 * 30


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def physical_gpu_ids(gpu_ids: Sequence[int], cuda_visible_devices: str | None) -> list[int]:
    """Map ids relative to CUDA_VISIBLE_DEVICES (as mjlab's --gpu-ids are) to physical ids."""
    if cuda_visible_devices is None:
        return list(gpu_ids)
    visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
    out = []
    for i in gpu_ids:
        if i >= len(visible):
            raise SpecError(
                "--gpu-ids",
                f"GPU {i} is not visible: CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
                f"shows {len(visible)} GPU(s); ids count from 0 within that list",
            )
        if not visible[i].isdigit():
            raise SpecError(
                "--gpu-ids",
                f"CUDA_VISIBLE_DEVICES entry {visible[i]!r} is not an index; set "
                "CUDA_VISIBLE_DEVICES to indices to launch several GPU ranks",
            )
        out.append(int(visible[i]))
    return out


@dataclass(frozen=True)
class LaunchPlan:
    """How `mjlab-train` runs a spec: in this process, or as several local ranks."""

    ranks: int = 1
    gpus: tuple[int, ...] = ()
    """Physical GPU ids given to the local ranks (empty: CPU)."""
    single_gpu: int | None = None
    """Physical id of the one GPU an in-process run uses."""

    @property
    def in_process(self) -> bool:
        return self.ranks == 1


def plan_launch(
    spec: TrainSpec, launched_by: str, cuda_count: Callable[[], int], cuda_visible: str | None
) -> LaunchPlan:
    """Decide how to run `spec`; `cuda_count` is asked only when GPUs are requested."""
    wants_many = spec.num_procs > 1 or (isinstance(spec.gpu_ids, tuple) and len(spec.gpu_ids) > 1)
    if launched_by != "single" and wants_many:
        flag = "--num-procs" if spec.num_procs > 1 else "--gpu-ids"
        raise SpecError(
            flag,
            f"this process is already one rank of a {launched_by} launch; "
            "let that launcher start the ranks and drop the flag",
        )
    if spec.num_procs > 1:
        return LaunchPlan(ranks=spec.num_procs)
    ids = spec.gpu_ids
    if ids in ("auto", None):
        return LaunchPlan()
    count = cuda_count()
    if count == 0:
        raise SpecError(
            "--gpu-ids",
            f"{'all' if ids == 'all' else list(ids)} asked for GPUs, but no CUDA device is "
            "visible; use --gpu-ids None (CPU) or --num-procs N for CPU ranks",
        )
    rel = tuple(range(count)) if ids == "all" else ids
    assert isinstance(rel, tuple)
    phys = tuple(physical_gpu_ids(rel, cuda_visible))
    if len(phys) == 1:
        return LaunchPlan(single_gpu=phys[0])
    return LaunchPlan(ranks=len(phys), gpus=phys)


@dataclass(frozen=True)
class LocalJob:
    """A submitted local job and where its files are."""

    job: submitit.Job
    run_dir: Path
    ranks: int

    def rank_stdout(self, rank: int) -> Path:
        return Path(self.job.task(rank).paths.stdout)


def submit_local(
    spec: ResolvedSpec,
    ranks: int,
    gpus: Sequence[int] = (),
    timeout_min: float = LOCAL_TIMEOUT_MIN,
    signal_delay_s: int = 90,
) -> LocalJob:
    """Submit `ranks` processes of `train_rank(spec)` on this machine and return at once.

    Like Slurm, submitit's local executor sends the time-limit signal `signal_delay_s` before
    `timeout_min`, and restarts the ranks when they exit for a requeue.
    """
    train = spec.train
    run_dir = (
        Path(train.run_dir)
        if train.run_dir
        else create_run_dir(train.log_root, spec.experiment_name, train.run_name)
    )
    executor = submitit.LocalExecutor(folder=run_dir / SUBMITIT_DIR)
    executor.update_parameters(
        tasks_per_node=ranks,
        timeout_min=timeout_min,
        signal_delay_s=signal_delay_s,
        gpus_per_node=len(gpus),
        visible_gpus=tuple(gpus),
    )
    job = executor.submit(RankJob(spec.replace_train(run_dir=str(run_dir)), free_port()))
    return LocalJob(job=job, run_dir=run_dir, ranks=ranks)


def follow(path: Path, done: Callable[[], bool], out: TextIO, poll_s: float = 0.2) -> None:
    """Copy what is appended to `path` onto `out` until `done()` and the file is drained."""
    pos = 0
    while True:
        finished = done()
        if path.exists():
            with open(path, errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            if chunk:
                out.write(chunk)
                out.flush()
        if finished:
            return
        time.sleep(poll_s)


class JobFailed(RuntimeError):
    """Some ranks of a job failed; the message names each and why."""


def rank_outcomes(job: submitit.Job, ranks: int) -> tuple[list[object], list[str]]:
    """Every rank's result, and a line for each rank that failed or died without a result."""
    results: list[object] = []
    failures: list[str] = []
    for k in range(ranks):
        task = job.task(k)
        try:
            results.append(task.result())
        except submitit.core.utils.UncompletedJobError:
            failures.append(
                f"rank {k} died without a result (killed, e.g. SIGKILL or out of memory); "
                f"its output: {task.paths.stderr}"
            )
        except Exception as exc:  # the rank's own exception, re-raised by submitit
            last = str(exc).strip().splitlines()
            failures.append(f"rank {k} failed: {last[-1] if last else type(exc).__name__}")
    return results, failures


def wait_local(local: LocalJob, out: TextIO | None = None) -> list[RankResult]:
    """Stream rank 0's output until the job ends; every rank's result, or JobFailed naming the
    ranks that failed. Ctrl-C cancels the job and leaves no rank behind."""
    try:
        follow(local.rank_stdout(0), local.job.done, out or sys.stdout)
    except KeyboardInterrupt:
        local.job.cancel(check=False)
        raise
    results, failures = rank_outcomes(local.job, local.ranks)
    if failures:
        raise JobFailed(f"job {local.job.job_id} failed:\n  " + "\n  ".join(failures))
    return results  # type: ignore[return-value]


def run_local(
    spec: ResolvedSpec, ranks: int, gpus: Sequence[int] = (), out: TextIO | None = None
) -> list[RankResult]:
    """Run a local multi-rank job to its end (see `wait_local`)."""
    return wait_local(submit_local(spec, ranks, gpus), out)

"""The checks every entry point runs before anything is created, submitted or started.

`validate_train` (mjlab-train) and `validate_submit` (mjlab-submit, mjlab-hpc render) check
the values, resolve the task once and return the resolved spec that every later stage uses;
a bad value raises SpecError naming the flag and the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from mjlab_hpc.checks import job_name, no_control, shell_line, slurm_name
from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.resources import (
    check_local_cpus,
    check_local_gpus,
    check_log_root,
    check_partition,
    check_run_dir,
)
from mjlab_hpc.launch.slurm import check_allocation, current_allocation, sbatch_options
from mjlab_hpc.launch.sweep import sweep_elements
from mjlab_hpc.rank.watchdog import FAULT_ENV, parse_faults
from mjlab_hpc.rundir.checkpoint import Checkpoints, cannot_continue
from mjlab_hpc.rundir.layout import latest_run
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.slurm.units import check_mem, slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks.registry import resolve

__all__ = [
    "continue_target",
    "executor_for",
    "slurm_only",
    "validate_submit",
    "validate_train",
]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _check_places(train: TrainSpec, existing_only: bool = False) -> None:
    """Where the run will be written can be written (nothing is created). `existing_only`
    (a dry run, a template, maybe for another machine): only what exists here is checked."""
    if train.run_dir:
        check_run_dir("--run-dir", train.run_dir, existing_only)
    else:
        check_log_root("--log-root", train.log_root, existing_only)


def _check_faults() -> None:
    """A fire drill's MJLAB_HPC_FAULT that the ranks could not read is bad input here."""
    try:
        parse_faults(os.environ)
    except ValueError as exc:
        raise SpecError(FAULT_ENV, str(exc).removeprefix(f"{FAULT_ENV}: ")) from None


def validate_train(spec: TrainSpec, launched_by: str = "single") -> ResolvedSpec:
    """Check a training spec and resolve its task; with --resume, the run it continues is
    decided here (the resolved spec names it as its run directory). `launched_by`: the
    launcher that started this process (a torchrun or srun rank starts no other rank)."""
    spec.validate()
    _check_faults()
    resolved = resolve(spec)
    _check_places(spec)
    if launched_by == "single" and spec.num_procs > 1:
        check_local_cpus("--num-procs", spec.num_procs, spec.oversubscribe)
    if spec.device == "cuda" and spec.gpu_ids == "auto":
        check_local_gpus("--device", 1)
    return continue_target(resolved)


def continue_target(resolved: ResolvedSpec) -> ResolvedSpec:
    """`resolved` with the run directory --resume continues filled in, after checking that an
    existing run directory (--run-dir or --resume) holds a run of the same task."""
    train = resolved.train
    run_dir = Path(train.run_dir) if train.run_dir else None
    if run_dir is None and train.resume:
        run_dir = latest_run(train.log_root, resolved.experiment_name)
        if run_dir is None:
            raise SpecError(
                "--resume",
                f"no earlier run of {resolved.experiment_name} under {train.log_root} to "
                "continue; drop --resume to start one, or name it with --run-dir",
            )
    if run_dir is None:
        return resolved
    # The ranks check again (and load); refusing here starts no process at all.
    refusal = cannot_continue(
        Checkpoints(run_dir), resolved.task, train.restart_from_scratch,
        "--run-dir" if train.run_dir else "--resume",
    )  # fmt: skip
    if refusal is not None:
        raise refusal
    return resolved.replace_train(run_dir=str(run_dir))


def executor_for(spec: SubmitSpec) -> str:
    """The executor a submission uses: `auto` becomes allocation inside a Slurm allocation
    (salloc), else slurm where sbatch can be found, else local."""
    if spec.executor != "auto":
        return spec.executor
    if current_allocation(os.environ) is not None:
        return "allocation"
    if shutil.which("sbatch"):
        return "slurm"
    # A laptop preparing a cluster job: a dry run of a request only Slurm can run shows the
    # Slurm script instead of refusing it for the local executor.
    return "slurm" if spec.dry_run and slurm_only(spec) else "local"


def slurm_only(spec: SubmitSpec) -> str | None:
    """The first flag of the request that only Slurm can run (several nodes, a partition,
    an account, ...), None when this machine could run it."""
    for flag, given in (("--nodes", spec.nodes > 1), ("--partition", spec.partition),
                        ("--account", spec.account), ("--qos", spec.qos),
                        ("--constraint", spec.constraint), ("--container", spec.container),
                        ("--chain", spec.chain > 1), ("--after", spec.after),
                        ("--sbatch-arg", spec.sbatch_arg)):  # fmt: skip
        if given:
            return flag
    return None


_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def _check_chain(spec: SubmitSpec, executor: str) -> None:
    """--after and --chain: Slurm job ids, a sane length, and Slurm (queued jobs wait for
    each other there; the local executor restarts its ranks itself)."""
    for job in spec.after:
        if not _JOB_ID.fullmatch(job):
            raise SpecError("--after", f"{job!r} is not a Slurm job id (4711, or 4711_2)")
    if not 1 <= spec.chain <= 1000:
        raise SpecError("--chain", f"must be between 1 and 1000 jobs, got {spec.chain}")
    if executor == "local" and (spec.after or spec.chain > 1):
        flag = "--chain" if spec.chain > 1 else "--after"
        raise SpecError(
            flag,
            "chains wait in Slurm's queue; the local executor restarts its ranks itself "
            "(use --executor slurm, or drop the flag)",
        )


def _check_after_exists(spec: SubmitSpec) -> None:
    """A --after job Slurm does not know would leave ours pending for ever."""
    if not spec.after:
        return
    known, _ = SlurmClient(timeout_s=10).query(spec.after)
    missing = [j for j in spec.after if j not in known]
    if missing:
        raise SpecError("--after", f"Slurm knows no job {', '.join(missing)} (squeue, sacct)")


def _check_array_size(spec: SubmitSpec) -> None:
    """A sweep larger than the cluster's job arrays (MaxArraySize) is refused by sbatch with
    "Invalid job array specification": say why, before anything is made."""
    if not spec.sweep:
        return
    count = len(sweep_elements(spec.train, spec.sweep))
    limit = (SlurmClient(timeout_s=10).config() or {}).get("MaxArraySize", "")
    # Indexes 0 .. MaxArraySize - 1: MaxArraySize elements.
    if limit.isdigit() and count > int(limit):
        raise SpecError(
            "--sweep",
            f"{count} elements; this cluster's job arrays hold at most {limit} "
            "(MaxArraySize): split the sweep into several submissions",
        )


def validate_submit(spec: SubmitSpec, warn: Callable[[str], None] = _warn) -> ResolvedSpec:
    """Check a submission (and every element of its sweep) and resolve its task; SpecError
    naming the flag for anything that cannot be submitted. What cannot be checked here (a
    partition sinfo does not describe) is said through `warn`."""
    spec.train.validate()
    _check_faults()
    resolved = resolve(spec.train)
    if not spec.sweep:
        resolved = continue_target(resolved)
    if spec.nodes < 1:
        raise SpecError("--nodes", f"must be >= 1, got {spec.nodes}")
    if spec.gpus_per_node < 0:
        raise SpecError("--gpus-per-node", f"must be >= 0, got {spec.gpus_per_node}")
    if spec.tasks_per_node is not None and spec.tasks_per_node < 1:
        raise SpecError("--tasks-per-node", f"must be >= 1, got {spec.tasks_per_node}")
    if spec.gpus_per_node > 0 and spec.ranks_per_node != spec.gpus_per_node:
        raise SpecError(
            "--tasks-per-node",
            f"{spec.ranks_per_node} ranks for {spec.gpus_per_node} GPUs per node: the job "
            "runs one rank per GPU; drop --tasks-per-node or make it equal --gpus-per-node",
        )
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise SpecError("--cpus-per-task", f"must be >= 1, got {spec.cpus_per_task}")
    # Far above any cluster, below what sbatch or the ranks overflow on: a typo.
    for flag, value, high in (("--nodes", spec.nodes, 100_000),
                              ("--gpus-per-node", spec.gpus_per_node, 1024),
                              ("--tasks-per-node", spec.tasks_per_node, 4096),
                              ("--cpus-per-task", spec.cpus_per_task, 4096)):  # fmt: skip
        if value is not None and value > high:
            raise SpecError(flag, f"must be at most {high}, got {value}")
    if spec.mem is not None:
        check_mem(spec.mem)
    minutes = slurm_time_minutes(spec.time)
    if spec.signal_delay_s < 1:
        raise SpecError("--signal-delay-s", f"must be >= 1, got {spec.signal_delay_s}")
    if spec.signal_delay_s >= minutes * 60:
        raise SpecError(
            "--signal-delay-s",
            f"{spec.signal_delay_s} s is not shorter than --time {spec.time}; "
            "the warning must come before the limit",
        )
    for flag, value in (("--partition", spec.partition), ("--account", spec.account),
                        ("--qos", spec.qos)):  # fmt: skip
        if value is not None:
            slurm_name(flag, value)
    if spec.constraint is not None:
        slurm_name("--constraint", spec.constraint, constraint=True)
    if spec.job_name is not None:
        job_name("--job-name", spec.job_name)
    for line in spec.setup:
        shell_line("--setup", line)
    if spec.container is not None:
        no_control("--container", spec.container)
        if not Path(spec.container).is_file():
            raise SpecError("--container", f"image {spec.container!r} does not exist")
    if spec.train.num_procs != 1:
        raise SpecError("--num-procs", "mjlab-submit starts ranks itself: use --tasks-per-node")
    if spec.train.gpu_ids != "auto":
        raise SpecError("--gpu-ids", "mjlab-submit gives each rank its GPU: use --gpus-per-node")
    sbatch_options(spec)
    executor = executor_for(spec)
    if executor == "slurm" and not spec.dry_run and shutil.which("sbatch") is None:
        raise SpecError(
            "--executor",
            "slurm, but sbatch is not on PATH: submit from a login node, load Slurm's "
            "module, or use --executor local",
        )
    if executor == "local" and spec.nodes > 1:
        raise SpecError("--nodes", "the local executor runs on this one machine: use --nodes 1")
    if executor == "local" and spec.container is not None:
        raise SpecError("--container", "containers run through Slurm: use --executor slurm")
    _check_chain(spec, executor)
    if executor == "allocation":
        alloc = current_allocation(os.environ)
        if alloc is None:
            raise SpecError(
                "--executor",
                "allocation, but this shell is in no Slurm allocation (no SLURM_JOB_ID, or "
                "inside an srun step): start one with salloc, or use --executor slurm",
            )
        check_allocation(spec, alloc)
    if spec.array_parallelism is not None and spec.array_parallelism < 1:
        raise SpecError("--array-parallelism", f"must be >= 1, got {spec.array_parallelism}")
    if not spec.sweep and spec.array_parallelism is not None:
        raise SpecError("--array-parallelism", "throttles a sweep: use it with --sweep")
    if spec.sweep and spec.train.run_dir:
        raise SpecError("--run-dir", "a sweep makes one run directory per element")
    if spec.sweep and spec.train.resume:
        raise SpecError("--resume", "a sweep starts new runs; resume each run by itself")
    sweep_elements(spec.train, spec.sweep)
    if executor == "local":
        if spec.gpus_per_node == 0:
            check_local_cpus("--tasks-per-node", spec.ranks_per_node, spec.train.oversubscribe)
        check_local_gpus("--gpus-per-node", spec.gpus_per_node)
    _check_places(resolved.train, existing_only=spec.dry_run)
    if not spec.dry_run and executor == "slurm":
        check_partition(spec, warn)
        _check_after_exists(spec)
        _check_array_size(spec)
    return resolved

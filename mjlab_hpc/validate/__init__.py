"""Every check before anything is created, submitted or started: the one place input is refused.

`validate_train` (mjlab-train) returns the resolved spec every later stage uses, and
`validate_submit` (mjlab-submit, mjlab-hpc render and doctor) a `Checked` submission: that
spec, the executor, a sweep's elements and the allocation, each decided once here. A bad
value raises SpecError naming the flag and the fix (exit code 2 in the CLIs). The checks
live in `rules` (each flag), `places` (where a value is written), `sbatch_args`, `sweep`,
`continuation` and `world` (what exists: the log root, a run to continue, this machine, the
Slurm cluster).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rank.context import Allocation, current_allocation
from mjlab_hpc.rank.watchdog import FAULT_ENV, parse_faults
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS
from mjlab_hpc.tasks.video import gl_unloadable, prepare_gl
from mjlab_hpc.validate import world
from mjlab_hpc.validate.continuation import continue_target
from mjlab_hpc.validate.places import check_job_paths
from mjlab_hpc.validate.rules import check_submit, resolve
from mjlab_hpc.validate.sweep import SweepElement, sweep_elements

__all__ = [
    "Checked",
    "Executor",
    "resolve",
    "slurm_only",
    "validate_submit",
    "validate_train",
]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _train_world(spec: TrainSpec, launched_by: str) -> tuple[int | None, str]:
    """How many ranks `mjlab-train` will start (None: unknown here), and the flag that says."""
    if launched_by != "single":
        size = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
        return (int(size) if size and size.isdigit() else None), "--num-procs"
    if spec.num_procs > 1:
        return spec.num_procs, "--num-procs"
    if isinstance(spec.gpu_ids, tuple):
        return len(spec.gpu_ids), "--gpu-ids"
    return (None if spec.gpu_ids == "all" else 1), "--num-procs"


def _check_faults(warn: Callable[[str], None], preflight: bool) -> None:
    """Refuse a fault drill's MJLAB_HPC_FAULT that the ranks could not read; say one they can.

    A variable left exported from a drill would end a real run.
    """
    try:
        faults = parse_faults(os.environ)
    except ValueError as exc:
        raise SpecError(FAULT_ENV, str(exc).removeprefix(f"{FAULT_ENV}: ")) from None
    unused = [f.kind for f in faults if f.kind.startswith("preflight-") and not preflight]
    if unused:
        raise SpecError(FAULT_ENV, f"{unused[0]} drills the preflight check: add --preflight")
    if faults:
        what = ", ".join(f"{f.kind} rank {f.rank} at iteration {f.iteration}" for f in faults)
        warn(
            f"{FAULT_ENV}={os.environ[FAULT_ENV]} is set: this run is a fault drill ({what}); "
            f"unset {FAULT_ENV} to train without it"
        )


def validate_train(spec: TrainSpec, launched_by: str = "single") -> ResolvedSpec:
    """Check a training spec and resolve its task.

    The run target (new, continued or restarted, and its directory) is decided here, in
    `continue_target`: the resolved spec carries it. `launched_by` is the launcher that
    started this process; a torchrun or srun rank starts no other rank, and its launcher
    checked what this machine holds.
    """
    single = launched_by == "single"
    _check_faults(_warn if single else lambda _: None, spec.preflight)
    if single:
        _settle_gl(spec)  # before mjlab is imported
    resolved = resolve(spec)
    world.check_places(spec, experiment=resolved.experiment_name)
    if single and spec.num_procs > 1:
        world.check_local_cpus("--num-procs", spec.num_procs, spec.oversubscribe)
    if spec.device == "cuda" and spec.gpu_ids == "auto":
        world.check_local_gpus("--device", 1)
    resolved = continue_target(
        resolved, world=_train_world(spec, launched_by), say=_note, launcher=single
    )
    if single:
        world.check_train_memory(resolved)
    return resolved


def _settle_gl(spec: TrainSpec) -> None:
    """Settle the offscreen GL of ranks on this machine.

    --video needs one that loads (refused before anything starts). Without --video, a
    machine where EGL does not load renders nothing.
    """
    if not spec.video:
        if spec.task not in BUILTIN_TASKS and (done := prepare_gl()) is not None:
            _note(done)
        return
    if (problem := gl_unloadable()) is not None:
        raise SpecError("--video", f"{problem}; install them, or drop --video")


Executor = Literal["slurm", "local", "allocation"]


@dataclass(frozen=True)
class Checked:
    """A submission that passed every check, with what validation decided of it, once."""

    resolved: ResolvedSpec
    """The task resolved, with its run target (a sweep: the base spec, no target)."""
    executor: Executor
    """Where the ranks run: a new Slurm job, this machine, or the allocation of this shell."""
    elements: tuple[SweepElement, ...]
    """A sweep's elements, each resolved (none without --sweep)."""
    allocation: Allocation | None
    """The Slurm allocation the ranks run in (executor `allocation` only)."""


def _executor(spec: SubmitSpec, alloc: Allocation | None) -> Executor:
    """The executor a submission uses.

    `auto` becomes allocation inside a Slurm allocation (salloc), else slurm where sbatch can
    be found, else local.
    """
    if spec.executor != "auto":
        return spec.executor
    if alloc is not None:
        return "allocation"
    if shutil.which("sbatch"):
        return "slurm"
    # A laptop preparing a cluster job: a dry run of a request only Slurm can run shows the
    # Slurm script instead of refusing it for the local executor.
    return "slurm" if spec.dry_run and slurm_only(spec) else "local"


def slurm_only(spec: SubmitSpec) -> str | None:
    """Return the first flag of the request that only Slurm can run, or None.

    Such flags are several nodes, a partition, an account, a chain, and the like.
    """
    for flag, given in (
        ("--nodes", spec.nodes > 1),
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--qos", spec.qos),
        ("--constraint", spec.constraint),
        ("--container", spec.container),
        ("--container-image", spec.container_image),
        ("--chain", spec.chain > 1),
        ("--after", spec.after),
        ("--sbatch-arg", spec.sbatch_arg),
    ):
        if given:
            return flag
    return None


def _check_executor(spec: SubmitSpec, executor: Executor, alloc: Allocation | None) -> None:
    """Refuse what the chosen executor cannot run."""
    for flag, given in (("--spare-nodes", spec.spare_nodes), ("--min-nodes", spec.min_nodes)):
        if executor != "slurm" and given:
            raise SpecError(
                flag,
                f"the healer of a new Slurm job acts on it, not --executor {executor}: use "
                "--executor slurm, or drop the flag",
            )
    if executor == "slurm" and not spec.dry_run and shutil.which("sbatch") is None:
        raise SpecError(
            "--executor",
            "slurm, but sbatch is not on PATH: submit from a login node, load Slurm's "
            "module, or use --executor local",
        )
    if executor == "local":
        if spec.nodes > 1:
            raise SpecError("--nodes", "the local executor runs on this one machine: use --nodes 1")
        for flag, image in (
            ("--container", spec.container),
            ("--container-image", spec.container_image),
        ):
            if image is not None:
                raise SpecError(flag, "containers run through Slurm: use --executor slurm")
        if spec.after or spec.chain > 1:
            raise SpecError(
                "--chain" if spec.chain > 1 else "--after",
                "chains wait in Slurm's queue; the local executor restarts its ranks itself "
                "(use --executor slurm, or drop the flag)",
            )
        if spec.gpus_per_node == 0:
            world.check_local_cpus(
                "--tasks-per-node", spec.ranks_per_node, spec.train.oversubscribe
            )
        world.check_local_gpus("--gpus-per-node", spec.gpus_per_node)
    if executor == "allocation":
        if alloc is None:
            raise SpecError(
                "--executor",
                "allocation, but this shell is in no Slurm allocation (no SLURM_JOB_ID, or "
                "inside an srun step): start one with salloc, or use --executor slurm",
            )
        world.check_allocation(spec, alloc)


def validate_submit(
    spec: SubmitSpec,
    warn: Callable[[str], None] = _warn,
    env: Mapping[str, str] = os.environ,
) -> Checked:
    """Check a submission (and every element of its sweep) and decide what it runs.

    SpecError names the flag of anything that cannot be submitted. What cannot be checked
    here (a partition sinfo does not describe) is said through `warn`. `env` is read once,
    here: the allocation this shell is in decides the executor `auto`.
    """
    check_submit(spec)
    _check_faults(warn, spec.train.preflight)
    alloc = current_allocation(env)
    executor = _executor(spec, alloc)
    if executor == "local":
        _settle_gl(spec.train)
    resolved = resolve(spec.train)
    if not spec.sweep:
        flag = "--nodes" if spec.nodes > 1 else "--tasks-per-node"
        resolved = continue_target(resolved, world=(spec.world_size, flag), say=_note)
    elements = tuple(sweep_elements(spec.train, spec.sweep))
    if spec.container is not None and not Path(spec.container).is_file():
        raise SpecError("--container", f"image {spec.container!r} does not exist")
    _check_executor(spec, executor, alloc)
    check_job_paths(resolved)  # every executor writes through Slurm's or submitit's patterns
    world.check_places(
        resolved.train, existing_only=spec.dry_run, experiment=resolved.experiment_name
    )
    world.check_submit_memory(spec, resolved, executor)
    if not spec.dry_run and executor == "slurm":
        world.check_partition(spec, warn, resolved=resolved)
        world.check_after_exists(spec)
        world.check_array_size(len(elements))
    return Checked(resolved, executor, elements, alloc if executor == "allocation" else None)

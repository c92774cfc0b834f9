"""The checks every entry point runs before anything is created, submitted or started.

`validate_train` (mjlab-train) and `validate_submit` (mjlab-submit, mjlab-hpc render) check
the values, resolve the task once and return the resolved spec that every later stage uses;
a bad value raises SpecError naming the flag and the fix.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.sweep import sweep_elements
from mjlab_hpc.slurm.units import check_mem, slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks.registry import resolve

__all__ = ["executor_for", "sbatch_options", "validate_submit", "validate_train"]

_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def validate_train(spec: TrainSpec) -> ResolvedSpec:
    """Check a training spec and resolve its task."""
    spec.validate()
    return resolve(spec)


def executor_for(spec: SubmitSpec) -> str:
    """The executor a submission uses: `auto` becomes slurm where sbatch can be found, else
    local."""
    if spec.executor != "auto":
        return spec.executor
    return "slurm" if shutil.which("sbatch") else "local"


def sbatch_options(spec: SubmitSpec) -> dict[str, str | bool]:
    """--sbatch-arg KEY=VALUE pairs (a bare KEY is a flag); SpecError for a malformed one."""
    out: dict[str, str | bool] = {}
    for item in spec.sbatch_arg:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not _SBATCH_KEY.match(key):
            raise SpecError(
                "--sbatch-arg", f"{item!r} is not KEY=VALUE with an sbatch option as KEY"
            )
        out[key] = value if sep else True
    return out


def validate_submit(spec: SubmitSpec) -> ResolvedSpec:
    """Check a submission (and every element of its sweep) and resolve its task; SpecError
    naming the flag for anything that cannot be submitted."""
    spec.train.validate()
    resolved = resolve(spec.train)
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
    if spec.container is not None and not Path(spec.container).is_file():
        raise SpecError("--container", f"image {spec.container!r} does not exist")
    if spec.train.num_procs != 1:
        raise SpecError("--num-procs", "mjlab-submit starts ranks itself: use --tasks-per-node")
    if spec.train.gpu_ids != "auto":
        raise SpecError("--gpu-ids", "mjlab-submit gives each rank its GPU: use --gpus-per-node")
    if any("\n" in line for line in spec.setup):
        raise SpecError("--setup", "one shell line per --setup (no newlines)")
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
    if spec.array_parallelism is not None and spec.array_parallelism < 1:
        raise SpecError("--array-parallelism", f"must be >= 1, got {spec.array_parallelism}")
    if not spec.sweep and spec.array_parallelism is not None:
        raise SpecError("--array-parallelism", "throttles a sweep: use it with --sweep")
    if spec.sweep and spec.train.run_dir:
        raise SpecError("--run-dir", "a sweep makes one run directory per element")
    if spec.sweep and spec.train.resume:
        raise SpecError("--resume", "a sweep starts new runs; resume each run by itself")
    sweep_elements(spec.train, spec.sweep)
    return resolved

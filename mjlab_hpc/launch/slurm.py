"""Slurm jobs through submitit: the executor for a SubmitSpec, its sbatch parameters, and the
exact script it submits (also what `--dry-run` prints)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import submitit

from mjlab_hpc.launch.validate import sbatch_options
from mjlab_hpc.rundir.layout import SUBMITIT_DIR
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import SubmitSpec

__all__ = [
    "container_python",
    "make_slurm_executor",
    "render_array_sbatch",
    "render_sbatch",
    "slurm_parameters",
]


def slurm_parameters(spec: SubmitSpec) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for a spec (validated)."""
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": spec.nodes,
        "ntasks_per_node": spec.ranks_per_node,
        "time": slurm_time_minutes(spec.time),
        "signal_delay_s": spec.signal_delay_s,
        # A dead rank ends the whole step instead of leaving the others in a collective.
        "srun_args": ["--kill-on-bad-exit=1"],
        # submitit writes --signal=USR2@delay; this also honours --preempt-signal.
        "additional_parameters": {
            "requeue": True,
            "signal": f"{spec.preempt_signal}@{spec.signal_delay_s}",
            **sbatch_options(spec),
        },
        "setup": list(spec.setup),
    }
    if spec.gpus_per_node > 0:
        params["gpus_per_node"] = spec.gpus_per_node
    optional = {
        "cpus_per_task": spec.cpus_per_task,
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    if spec.mem is not None:
        params["additional_parameters"]["mem"] = spec.mem
    if spec.exclusive:
        params["exclusive"] = True
    return params


def container_python(spec: SubmitSpec, run_dir: Path) -> str | None:
    """The command that runs Python inside the image on every rank (None: no container)."""
    if spec.container is None:
        return None
    image = str(Path(spec.container).resolve())
    nv = " --nv" if spec.gpus_per_node > 0 else ""
    bind = shlex.quote(str(run_dir.parent.parent.resolve()))
    # Apptainer where installed, else Singularity (its former name, still common).
    return (
        '"$(command -v apptainer || command -v singularity)" exec'
        f"{nv} --bind {bind} {shlex.quote(image)} python3"
    )


class _SlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor that can also render a script where there is no srun (a dry
    run on a laptop)."""

    def __init__(self, folder: Path, python: str | None, render_only: bool = False) -> None:
        self._render_only = render_only
        super().__init__(folder, python=python)

    def affinity(self) -> int:  # type: ignore[override]
        # submitit refuses to build an executor without srun; rendering needs none.
        return 2 if self._render_only else submitit.SlurmExecutor.affinity()


def make_slurm_executor(spec: SubmitSpec, folder_parent: Path, dry_run: bool = False) -> Any:
    """A configured submitit SlurmExecutor writing into `<folder_parent>/submitit`."""
    executor = _SlurmExecutor(
        folder=folder_parent / SUBMITIT_DIR,
        python=container_python(spec, folder_parent),
        render_only=dry_run,
    )
    executor.update_parameters(**slurm_parameters(spec))
    return executor


def render_sbatch(spec: SubmitSpec, run_dir: Path) -> str:
    """The exact sbatch script submitit submits for this spec."""
    executor = make_slurm_executor(spec, run_dir, dry_run=True)
    return str(executor._make_submission_file_text(executor._submitit_command_str, "dry-run"))


def array_executor(spec: SubmitSpec, sweep_dir: Path, dry_run: bool = False) -> Any:
    """The executor of a sweep's job array (throttled by --array-parallelism)."""
    executor = make_slurm_executor(spec, sweep_dir, dry_run=dry_run)
    if spec.array_parallelism is not None:
        executor.update_parameters(array_parallelism=spec.array_parallelism)
    return executor


def render_array_sbatch(spec: SubmitSpec, sweep_dir: Path, count: int) -> str:
    """The exact sbatch script of a sweep's job array of `count` elements."""
    executor = array_executor(spec, sweep_dir, dry_run=True)
    executor.parameters["map_count"] = count  # what submitit sets when it submits an array
    return str(executor._make_submission_file_text(executor._submitit_command_str, "dry-run"))

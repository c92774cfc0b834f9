"""`mjlab-train TASK`: train on this machine (one process, N CPU ranks, or one rank per GPU),
or as one rank of a job started by torchrun, srun or submitit."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tyro
from rich.console import Console

from mjlab_hpc.distributed import DistContext, cuda_device_count, detect_mode
from mjlab_hpc.errors import LaunchError, SpecError
from mjlab_hpc.launch import JobFailed, physical_gpu_ids, run_local
from mjlab_hpc.spec import TrainSpec, split_overrides
from mjlab_hpc.tasks import resolve_task

EXIT_BAD_INPUT = 2


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


def run(spec: TrainSpec) -> int:
    """Validate, plan and run; the exit code."""
    err = Console(stderr=True)
    try:
        spec.validate()
        resolve_task(spec)
        launched_by = detect_mode(os.environ)
        if launched_by != "single":
            DistContext.from_env()  # inconsistent launcher variables: fail before any work
        plan = plan_launch(
            spec, launched_by, cuda_device_count, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    except (SpecError, LaunchError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    except KeyError as exc:
        err.print(f"[bold red]error:[/] TASK: {exc.args[0]}")
        return EXIT_BAD_INPUT
    if plan.in_process:
        if plan.single_gpu is not None:
            # Before CUDA initialises: the chosen GPU becomes cuda:0 of this process.
            os.environ["CUDA_VISIBLE_DEVICES"] = str(plan.single_gpu)
        from mjlab_hpc.preemption import Stopped, after_stop
        from mjlab_hpc.trainer import train_rank

        try:
            result = train_rank(spec)
        except Stopped as stop:
            code = after_stop(stop, None, spec.max_restarts)
            if (stop.ctx is None or stop.ctx.is_main) and code == 3:
                err.print(
                    f"{stop}: the checkpoint is saved; continue with the same command and "
                    "--resume (or --run-dir RUN_DIR)"
                )
            return code
        if result.rank == 0:
            Console().print(f"run directory: {result.run_dir}")
        return 0
    try:
        results = run_local(spec, plan.ranks, plan.gpus)
    except JobFailed as exc:
        err.print(f"[bold red]{exc}[/]")
        return 1
    Console().print(f"{len(results)} ranks done, run directory: {results[0].run_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mjlab-train`. Arguments it does not know go to mjlab tasks as
    `--env.*` / `--agent.*` overrides, as with mjlab's own train."""
    spec, unknown = tyro.cli(TrainSpec, args=argv, description=__doc__, return_unknown_args=True)
    try:
        spec = spec.replace(overrides=split_overrides(unknown))
    except SpecError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())

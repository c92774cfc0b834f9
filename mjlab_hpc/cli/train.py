"""`mjlab-train TASK`: train on this machine (one process, N CPU ranks, or one rank per GPU),
or as one rank of a job started by torchrun, srun or submitit."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from rich.console import Console

from mjlab_hpc.cli.common import error_line, guarded, parse_with_overrides
from mjlab_hpc.errors import EXIT_FAILED, EXIT_STOPPED
from mjlab_hpc.launch.local import JobFailed, LaunchPlan, plan_launch, run_local
from mjlab_hpc.launch.validate import validate_train
from mjlab_hpc.rank.context import DistContext, cuda_device_count, detect_mode
from mjlab_hpc.spec import ResolvedSpec, TrainSpec

__all__ = ["main", "run"]


def run(spec: TrainSpec) -> int:
    """Validate, plan and run; the exit code."""
    return guarded(lambda: _run(spec))


def _run(spec: TrainSpec) -> int:
    resolved = validate_train(spec)
    launched_by = detect_mode(os.environ)
    if launched_by != "single":
        DistContext.from_env()  # inconsistent launcher variables: fail before any work
    plan = plan_launch(spec, launched_by, cuda_device_count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if plan.in_process:
        return _run_in_process(resolved, plan)
    try:
        results = run_local(resolved, plan.ranks, plan.gpus)
    except JobFailed as exc:
        error_line("failed", exc)
        return EXIT_FAILED
    Console().print(f"{len(results)} ranks done, run directory: {results[0].run_dir}")
    return 0


def _run_in_process(resolved: ResolvedSpec, plan: LaunchPlan) -> int:
    if plan.single_gpu is not None:
        # Before CUDA initialises: the chosen GPU becomes cuda:0 of this process.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(plan.single_gpu)
    # torch, warp, rsl-rl: loaded only once the input is known to be good.
    from mjlab_hpc.rank.entry import train_rank
    from mjlab_hpc.rank.preemption import Stopped, after_stop

    try:
        result = train_rank(resolved)
    except Stopped as stop:
        code = after_stop(stop, None, resolved.train.max_restarts)
        if (stop.ctx is None or stop.ctx.is_main) and code == EXIT_STOPPED:
            Console(stderr=True).print(
                f"{stop}: the checkpoint is saved; continue with the same command and "
                "--resume (or --run-dir RUN_DIR)"
            )
        return code
    if result.rank == 0:
        Console().print(f"run directory: {result.run_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mjlab-train`. Arguments it does not know go to mjlab tasks as
    `--env.*` / `--agent.*` overrides, as with mjlab's own train."""
    spec = parse_with_overrides(
        TrainSpec, argv, __doc__, lambda s, overrides: s.replace(overrides=overrides)
    )
    return spec if isinstance(spec, int) else run(spec)


if __name__ == "__main__":
    sys.exit(main())

"""`mjlab-train TASK`: train on this machine (one process, N CPU ranks, or one rank per GPU),
or as one rank of a job started by torchrun, srun or submitit."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from mjlab_hpc import console
from mjlab_hpc.cli.common import (
    drop_internal_variables,
    guarded,
    parse_command,
    resume_command,
)
from mjlab_hpc.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    SpecError,
    environment_problem,
)
from mjlab_hpc.launch.follow import Closing, closing
from mjlab_hpc.launch.local import LaunchPlan, plan_launch, run_local
from mjlab_hpc.rank.context import (
    DistContext,
    cuda_device_count,
    current_allocation,
    detect_mode,
)
from mjlab_hpc.rank.failures import failure_kind
from mjlab_hpc.rundir.layout import realise_target
from mjlab_hpc.spec import ResolvedSpec, TrainSpec
from mjlab_hpc.tasks.video import rendering_problem
from mjlab_hpc.validate import validate_train
from mjlab_hpc.validate.continuation import continued

__all__ = ["cli", "main", "run"]

PROG = "mjlab-train"


def run(spec: TrainSpec, argv: Sequence[str] = (), named: frozenset[str] = frozenset()) -> int:
    """Validate, plan and run `spec`, and return the exit code.

    `argv` is the command's arguments, for the command that resumes the run; `named` the
    fields they set (`parse_command`): a continuation takes every other from the run.
    """
    return guarded(lambda: _run(spec, argv, named))


def _run(spec: TrainSpec, argv: Sequence[str], named: frozenset[str]) -> int:
    launched_by = detect_mode(os.environ)
    single = launched_by == "single"  # not a rank of torchrun, srun or submitit
    if single:  # a rank keeps what its launcher set
        drop_internal_variables()
    # A rank of torchrun or srun decides this as every other rank does: from the same
    # arguments and the same run.json, which no rank writes before all have joined.
    spec = continued(spec, named, rank=not single)
    resolved = validate_train(spec, launched_by)
    if not single:
        DistContext.from_env()  # inconsistent launcher variables: fail before any work
    plan = plan_launch(
        spec,
        launched_by,
        cuda_count=cuda_device_count,
        cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if spec.video and single:
        # The writer renders on this machine: a renderer that cannot start stops us here.
        problem = rendering_problem()
        if problem is not None:
            raise SpecError(
                "--video",
                f"{problem}. Install EGL (Debian: libegl1 libegl-mesa0 libgl1-mesa-dri) or "
                "OSMesa (libosmesa6, then MUJOCO_GL=osmesa), or drop --video",
            )
    alloc = current_allocation(os.environ) if single else None
    if alloc is not None:
        print(
            f"note: inside Slurm allocation {alloc.job_id} ({alloc.nodes} node(s)): mjlab-train "
            "runs on this machine only; `mjlab-submit TASK --nodes N ...` starts the ranks "
            "across the allocation with srun",
            file=sys.stderr,
            flush=True,
        )
    if not single:  # its rank 0 realises the target and tells the others (agree_run_dir)
        return _run_planned(resolved, plan, argv)
    # Realised here, so the closing line can name the run whatever happens to the ranks.
    made = resolved.target.path is None
    resolved = realise_target(resolved)
    run_dir = Path(str(resolved.target.path))
    try:
        return _run_planned(resolved, plan, argv)
    finally:  # a new run stopped before any rank wrote to it (a Ctrl-C while torch loads)
        if made:
            with contextlib.suppress(OSError):
                run_dir.rmdir()


def _run_planned(resolved: ResolvedSpec, plan: LaunchPlan, argv: Sequence[str]) -> int:
    if plan.in_process:
        return _run_in_process(resolved, plan, argv)
    resume = resume_command(PROG, argv, str(resolved.train.run_dir))
    ended = run_local(resolved, plan.ranks, plan.gpus, resume)
    ended.say()
    return ended.code


def _run_in_process(resolved: ResolvedSpec, plan: LaunchPlan, argv: Sequence[str]) -> int:
    if plan.single_gpu is not None:
        # Before CUDA initialises: the chosen GPU becomes cuda:0 of this process.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(plan.single_gpu)
    # torch, warp, rsl-rl: loaded only once the input is known to be good.
    from mjlab_hpc.rank.preflight import PreflightFailed
    from mjlab_hpc.rank.stop import Interrupted, Stopped, after_stop
    from mjlab_hpc.rank.train import train_rank

    try:
        result = train_rank(resolved)
    except Stopped as stopped:
        code = after_stop(stopped, resolved.train.max_restarts)
        if (stopped.ctx is None or stopped.ctx.is_main) and stopped.run_dir:
            ended = closing(Path(stopped.run_dir), resume_command(PROG, argv, stopped.run_dir))
            if ended is not None and code == EXIT_STOPPED:
                ended.say()
        return code
    except Exception as exc:
        # The machine, not the code (a full disk, no memory left, a node that failed the
        # preflight): the closing line says so and what to change; the traceback of
        # anything else is the code's.
        run_dir = resolved.train.run_dir or "the run directory"
        problem = environment_problem(exc, run_dir)
        machine = isinstance(exc, PreflightFailed) or failure_kind(exc) == "out-of-memory"
        if problem is None and not machine:
            raise
        ended = closing(Path(run_dir), resume_command(PROG, argv, run_dir))
        line = ended.line if ended is not None else f"failed: {problem or exc}"
        Closing(EXIT_FAILED, line).say()
        return EXIT_FAILED
    except Interrupted as interrupted:
        ended = closing(Path(interrupted.run_dir), resume_command(PROG, argv, interrupted.run_dir))
        if ended is not None:
            ended.say()
        return EXIT_INTERRUPTED
    if result.rank == 0:
        ended = closing(Path(result.run_dir), resume_command(PROG, argv, result.run_dir))
        if ended is not None:
            ended.say()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mjlab-train` with `argv` and return its exit code.

    Arguments it does not know go to mjlab tasks as `--env.*` / `--agent.*` overrides, as
    with mjlab's own train.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_command(
        TrainSpec, args, __doc__, lambda s, overrides: s.replace(overrides=overrides)
    )
    return parsed if isinstance(parsed, int) else run(parsed[0], args, parsed[1])


def cli() -> NoReturn:
    """Run the `mjlab-train` command: `main`, then exit at once.

    A process that trained would spend seconds in its interpreter's teardown (torch's and
    Warp's native objects) after its closing line, where a second Ctrl-C would not stop it;
    every record is written by then. Training does not depend on the console
    (`console.detach`).
    """
    console.detach()
    code = main()
    console.settle()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()

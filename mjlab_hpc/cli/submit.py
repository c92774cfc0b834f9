"""`mjlab-submit TASK`: one command from a login node to a multi-node training job."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from mjlab_hpc import console as own_console
from mjlab_hpc.cli.common import (
    drop_internal_variables,
    guarded,
    parse_command,
    resume_command,
)
from mjlab_hpc.cli.config import (
    Setting,
    naming_sources,
    origin_lines,
    site_given,
    with_site_defaults,
)
from mjlab_hpc.errors import EXIT_INTERRUPTED
from mjlab_hpc.launch.follow import Closing, follow_to_end
from mjlab_hpc.launch.local import LocalControls, rank_failures
from mjlab_hpc.launch.plan import SubmitPlan, plan_submission
from mjlab_hpc.launch.slurm import run_in_allocation
from mjlab_hpc.launch.submit import (
    Submitted,
    SubmittedSweep,
    prepare_run,
    submit,
    submit_sweep,
)
from mjlab_hpc.ops.cancel import write_cancel_marker
from mjlab_hpc.ops.status import collect, status_table
from mjlab_hpc.ops.status import console as wide_console
from mjlab_hpc.procs import wait_gone
from mjlab_hpc.rank.context import interactive_step
from mjlab_hpc.rundir.ends import latest_world_size, rank_ends
from mjlab_hpc.rundir.layout import SWEEP_RECORD
from mjlab_hpc.slurm.client import FINAL_STATES, SlurmClient, retry_s
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import SubmitSpec
from mjlab_hpc.validate import slurm_only

__all__ = ["main", "run"]

PROG = "mjlab-submit"


def spec_yaml(plan: SubmitPlan) -> str:
    """Dump the plan's spec as YAML: what every rank will run."""
    spec = plan.spec
    data = dataclasses.asdict(spec)
    data["train"] = spec.train.to_dict()
    data["setup"] = list(spec.setup)
    data["sbatch_arg"] = list(spec.sbatch_arg)
    data["sweep"] = list(spec.sweep)
    data["resolved"] = {
        "executor": plan.executor,
        "ranks_per_node": spec.ranks_per_node,
        "world_size": spec.world_size,
        "time_minutes": slurm_time_minutes(spec.time),
        **plan.resolved.effective(),
    }
    if plan.elements:
        data["resolved"]["sweep_elements"] = len(plan.elements)
    return yaml.safe_dump(data, sort_keys=False)


def summary_table(s: Submitted) -> Table:
    """Show what was submitted, where it writes, and how to watch or cancel it."""
    spec = s.spec
    n = s.resolved.num_envs
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")  # paths are copied from here: wrap, never crop
    t.add_row("job", f"{s.job_id} ({s.executor})")
    if s.chain:
        t.add_row(
            "chain",
            f"{' -> '.join(s.job_ids)}: {len(s.job_ids)} jobs of --time {spec.time}, each "
            "starting when the one before ends and continuing the run",
        )
    gpus = f"{spec.gpus_per_node} GPU(s)" if spec.gpus_per_node else "CPU"
    t.add_row(
        "ranks",
        f"{spec.nodes} node(s) x {spec.ranks_per_node} rank(s), {gpus} per node "
        f"= {spec.world_size} ranks",
    )
    t.add_row("envs", f"{n} per rank x {spec.world_size} ranks = {n * spec.world_size} in total")
    t.add_row("run directory", str(s.run_dir))
    t.add_row("rank logs", f"{s.run_dir}/logs/rank<k>.log")
    t.add_row("task output", str(s.rank_stdout(0)).replace("_0_log", "_<k>_log"))
    if s.executor == "slurm":
        t.add_row("watch", f"squeue -j {s.job_id}   |   tail -f {s.rank_stdout(0)}")
        t.add_row("cancel", f"mjlab-hpc cancel {s.job_id}")
    else:
        t.add_row("watch", f"tail -f {s.rank_stdout(0)}")
        t.add_row("cancel", f"mjlab-hpc cancel {s.run_dir}")
    return t


def follow_job(s: Submitted, argv: Sequence[str]) -> int:
    """Stay with the job to its end, then say one closing line and return the exit code.

    Rank 0's progress is shown and stop signals are forwarded. A local job stops at its next
    iteration boundary with a checkpoint; a Slurm job is cancelled with one. A second signal
    stops a local job at once, and stops following a Slurm job.
    """
    resume = resume_command(PROG, argv, s.run_dir)
    client = SlurmClient(retry_s=retry_s())  # slurmctld away is no end of the job
    # Once a stop is asked, Slurm's state is asked for now (at most every second): submitit's
    # cached one is refreshed every 30 s into a long job, long after the ranks are done.
    forced: list[float] = []
    if s.executor == "local":
        controls = LocalControls(int(s.job_id), s.run_dir)
        stop, kill = controls.stop, controls.kill
    else:

        def stop() -> None:
            # The ranks save a checkpoint on SIGTERM; with requeue forbidden and the cancel
            # said in the run directory first, none follows.
            write_cancel_marker(Path(s.run_dir), s.job_ids)
            client.forbid_requeue(s.job_ids)  # a --chain's queued jobs too
            client.scancel(list(s.job_ids))
            forced.append(0.0)

        def kill() -> None:
            pass  # stop following; the cancel goes on

    def done() -> bool:
        force = bool(forced) and time.monotonic() - forced[-1] >= 1.0
        if force:
            forced.append(time.monotonic())
        jobs = (s.job, *s.chain)
        if not all(j.done(force_check=force) for j in jobs):
            return False
        if s.executor == "slurm":
            # Results of ranks that the batch script starts again (healed); a job suspended
            # (scontrol suspend, gang scheduling), which submitit counts as done, resumes.
            states = [client.job_state(j.job_id) for j in jobs]
            return all(state is None or state in FINAL_STATES for state in states)
        # A local controller may be gone (killed) while its ranks still save their checkpoint.
        return not controls.live()

    def failures() -> list[str]:  # of the latest start's ranks (fewer after --min-nodes)
        size = latest_world_size(rank_ends(Path(s.run_dir))) or s.ranks
        return rank_failures(s.job, min(size, s.ranks), Path(s.run_dir))

    ended, fg = follow_to_end(
        s.run_dir,
        total=s.resolved.max_iterations,
        stop=stop,
        kill=kill,
        done=done,
        resume=resume,
        failures=failures,
        cancels=s.executor == "slurm",
        num_envs=s.resolved.num_envs,
    )
    if fg.killed and s.executor == "local":
        wait_gone(controls.live(), timeout_s=10)
    elif fg.killed:  # a Slurm job goes on being cancelled (with its checkpoint)
        ended = Closing(
            EXIT_INTERRUPTED,
            f"stopped following job {s.job_id}, which is being "
            f"cancelled with a checkpoint; then resume with: {resume}",
        )
    ended.say()
    return ended.code


def sweep_table(s: SubmittedSweep) -> Table:
    """Show the submitted sweep: its job array, and every element's job, values and run."""
    spec = s.spec
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    n = len(s.elements)
    if s.array_job_id is not None:
        at_once = f", at most {spec.array_parallelism} at once" if spec.array_parallelism else ""
        t.add_row("job array", f"{s.array_job_id} (slurm), {n} elements{at_once}")
        if spec.chain > 1 and s.runs:
            arrays = [str(j.job_id).split("_")[0] for j in s.runs[0].chain]
            t.add_row(
                "chain",
                f"{' -> '.join([s.array_job_id, *arrays])}: each array starts "
                "when the one before has ended",
            )
    else:
        t.add_row("jobs", f"{n} local jobs ({s.executor}), all running at once")
    t.add_row(
        "each",
        f"{spec.nodes} node(s) x {spec.ranks_per_node} rank(s) = {spec.world_size} ranks, "
        f"{s.runs[0].resolved.num_envs if s.runs else '?'} envs per rank",
    )
    t.add_row("sweep record", str(s.sweep_dir / SWEEP_RECORD))
    elements = Table(box=None, pad_edge=False)
    for col in ("#", "job", "values", "run directory"):
        elements.add_column(col, overflow="fold")
    for e, r in zip(s.elements, s.runs, strict=True):
        elements.add_row(str(e.index), r.job_id, e.label, str(r.run_dir))
    t.add_row("elements", elements)
    target = s.array_job_id or str(s.sweep_dir)
    t.add_row("watch", f"mjlab-hpc status {target}")
    t.add_row("cancel", f"mjlab-hpc cancel {target}")
    return t


def follow_sweep(s: SubmittedSweep, console: Console) -> int:
    """Wait for every element to end, then show their status; 0 if all completed."""
    try:
        while not all(j.done() for r in s.runs for j in (r.job, *r.chain)):
            time.sleep(2.0)
    except KeyboardInterrupt:
        console.print("stopped waiting; the sweep keeps running")
        raise
    report = collect([r.run_dir for r in s.runs])
    # Wide even into a file: a table squeezed into 80 columns is unreadable.
    wide_console().print(status_table(report.rows))
    failed = [r for r in report.rows if r.state != "COMPLETED"]
    return 1 if failed else 0


def run(
    spec: SubmitSpec,
    argv: Sequence[str] = (),
    named: frozenset[str] = frozenset(),
    site: Sequence[Setting] = (),
) -> int:
    """Plan and submit `spec` (or print the plan, with --dry-run), and return the exit code.

    `argv` is the command's arguments, for the command that resumes the run; `named` the
    fields they set (`parse_command`): a continuation takes every other from the run; `site`
    the values config files gave it (said on the console).
    """

    def body() -> int:
        with naming_sources(site):
            return _run(spec, argv, named, site)

    return guarded(body)


def _run(
    spec: SubmitSpec, argv: Sequence[str], named: frozenset[str], site: Sequence[Setting] = ()
) -> int:
    drop_internal_variables()
    plan = plan_submission(spec, named, site_given(site))  # once: the rest carries it out
    if plan.spec.dry_run:
        dry_run(plan)
        return 0
    for line in origin_lines(plan.origins, site_only=True):
        print(line, file=sys.stderr)
    if plan.executor == "allocation":
        return in_allocation(plan, argv)
    step = interactive_step(os.environ) if spec.executor == "auto" else None
    if step is not None and plan.executor == "slurm":
        # srun --pty holds the allocation's resources: ranks could not start beside it.
        Console(stderr=True).print(
            f"note: inside interactive {step} (srun --pty): submitting a new job. To run "
            "the ranks in that allocation instead, start mjlab-submit from the allocation's "
            "own shell (salloc, outside srun --pty); where salloc's shell is itself such a "
            "step (LaunchParameters=use_interactive_step), a new job is the way",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    console = Console()
    if plan.elements:
        sweep = submit_sweep(plan)
        console.print("[bold]submitted sweep[/]")
        console.print(sweep_table(sweep))
        return follow_sweep(sweep, console) if plan.spec.follow else 0
    submitted = submit(plan)
    console.print("[bold]submitted[/]")
    console.print(summary_table(submitted))
    return follow_job(submitted, argv) if plan.spec.follow else 0


def _no_slurm_here(spec: SubmitSpec) -> str:
    """Say why a dry run shows a Slurm script where there is no Slurm."""
    if shutil.which("sbatch") or spec.executor == "slurm":
        return ""
    return f"; Slurm was not found here, {slurm_only(spec)} asks for it"


def in_allocation(plan: SubmitPlan, argv: Sequence[str]) -> int:
    """Run the ranks with the plan's srun inside the allocation this shell is in, to their end."""
    alloc = plan.allocation
    assert alloc is not None  # validation refuses --executor allocation outside one
    plan = prepare_run(plan)
    console = Console(stderr=True)
    console.print(
        f"[bold]inside Slurm allocation {alloc.job_id}[/] ({alloc.nodes} node(s)): starting "
        f"{plan.spec.world_size} rank(s) with srun here, no new job (--executor slurm "
        "submits one)",
        soft_wrap=True,
    )
    console.print(f"run directory: {plan.run_dir}", highlight=False, soft_wrap=True)
    ended = run_in_allocation(
        plan.srun,
        dict(plan.srun_env),
        plan.run_dir,
        alloc=alloc,
        resolved=plan.resolved,
        resume=resume_command(PROG, argv, plan.run_dir),
    )
    ended.say()
    return ended.code


def dry_run(plan: SubmitPlan) -> None:
    """Print the plan of a submission, submitting nothing.

    That is the resolved spec, where each value that is not a built-in default came from, a
    sweep's elements with their planned run directories, and the exact sbatch script of
    every job, or the srun command, or what would start locally. A --chain's later jobs wait
    for `JOB<K>`, the id the job before gets. The text is plain and uncropped: users copy
    the script from here.
    """
    spec, out = plan.spec, sys.stdout
    out.write("# ---- resolved spec ----\n" + spec_yaml(plan))
    if lines := origin_lines(plan.origins):
        out.write(
            "# ---- where each value came from (any other: the continued run's own, else a "
            "built-in default) ----\n"
        )
        out.writelines(f"# {line}\n" for line in lines)
    if plan.elements:
        n = len(plan.elements)
        out.write(f"# ---- sweep: {n} elements (dry run: nothing created) ----\n")
        for e, run_dir in zip(plan.elements, plan.element_dirs, strict=True):
            out.write(f"# {e.index:>3}  {e.label:<32} {run_dir}\n")
    if plan.executor == "allocation":
        env = [f"{k}={shlex.quote(v)}" for k, v in plan.srun_env.items()]
        out.write(
            f"# ---- srun inside the current allocation (dry run: not started) ----\n"
            f"{' '.join([*env, shlex.join(plan.srun)])}\n"
        )
    for job in plan.jobs:  # every job of a --chain: each its own script
        what = "sbatch script of the job array" if plan.elements else "sbatch script"
        if spec.chain > 1:
            what += f" of job {job.link} of {spec.chain} of the chain"
            what += (
                f", after {job.after[0]}: the id job {job.link - 1} gets" if job.link > 1 else ""
            )
        out.write(f"# ---- {what} (dry run: not submitted{_no_slurm_here(spec)}) ----\n")
        out.write(job.script)
    if plan.executor == "local":
        what = (
            f"{len(plan.elements)} local jobs of {spec.ranks_per_node} rank(s) each, all at once"
            if plan.elements
            else f"{spec.ranks_per_node} rank(s) of {spec.train.task}, run directory {plan.run_dir}"
        )
        out.write(f"# ---- local executor (dry run: not started) ----\n# {what} on this machine\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mjlab-submit` with `argv` and return its exit code.

    Arguments it does not know go to mjlab tasks as `--env.*` / `--agent.*` overrides, passed
    to every rank. As a command (no `argv`), a job it follows does not depend on the console.
    """
    if argv is None:
        own_console.detach()
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_command(
        SubmitSpec,
        args,
        __doc__,
        lambda s, overrides: s.replace(train=s.train.replace(overrides=overrides)),
    )
    if isinstance(parsed, int):
        return parsed
    spec, named = parsed
    # What the config files say for the flags not typed (a bad file: exit 2, nothing done).
    found = guarded(lambda: with_site_defaults(spec, named))
    return found if isinstance(found, int) else run(found[0], args, named, found[1])


if __name__ == "__main__":
    sys.exit(main())

"""`mjlab-submit TASK`: one command from a login node to a multi-node training job."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import tyro
import yaml
from rich.console import Console
from rich.table import Table

from mjlab_hpc.errors import SpecError, SubmitError
from mjlab_hpc.submit import (
    SubmitSpec,
    Submitted,
    planned_run_dir,
    render_sbatch,
    slurm_time_minutes,
    submit,
)
from mjlab_hpc.tasks import resolve_task

EXIT_BAD_INPUT = 2


def spec_yaml(spec: SubmitSpec) -> str:
    """The resolved spec as YAML (what every rank will run)."""
    import dataclasses

    data = dataclasses.asdict(spec)
    data["train"] = spec.train.to_dict()
    data["setup"] = list(spec.setup)
    data["sbatch_arg"] = list(spec.sbatch_arg)
    data["resolved"] = {
        "executor": spec.resolved_executor(),
        "ranks_per_node": spec.ranks_per_node,
        "world_size": spec.world_size,
        "time_minutes": slurm_time_minutes(spec.time),
    }
    return yaml.safe_dump(data, sort_keys=False)


def envs_per_rank(spec: SubmitSpec) -> int:
    return spec.train.num_envs or resolve_task(spec.train).num_envs


def summary_table(s: Submitted) -> Table:
    """What was submitted, where it writes, and how to watch or cancel it."""
    spec = s.spec
    n = envs_per_rank(spec)
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")  # paths are copied from here: wrap, never crop
    t.add_row("job", f"{s.job_id} ({s.executor})")
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
        t.add_row("cancel", f"scancel {s.job_id}")
    else:
        t.add_row("watch", f"tail -f {s.rank_stdout(0)}")
        t.add_row("cancel", f"kill {s.job_id}")
    return t


def follow_job(s: Submitted, console: Console) -> int:
    """Stream rank 0's output until the job ends; 0 if every rank succeeded."""
    from mjlab_hpc.launch import follow, rank_outcomes

    out = s.rank_stdout(0)
    while not out.exists() and not s.job.done():
        time.sleep(0.5)
    try:
        follow(out, s.job.done, sys.stdout)
    except KeyboardInterrupt:
        console.print(f"stopped following; job {s.job_id} keeps running")
        raise
    _, failures = rank_outcomes(s.job, s.ranks)
    if failures:
        console.print(f"[bold red]job {s.job_id} failed:[/]\n  " + "\n  ".join(failures))
        return 1
    console.print(f"[bold green]job {s.job_id} finished[/]: {s.run_dir}")
    return 0


def run(spec: SubmitSpec) -> int:
    """Validate and submit (or print, with --dry-run); the exit code."""
    console, err = Console(), Console(stderr=True)
    try:
        spec.validate()
        if spec.dry_run:
            # Plain text, uncropped: users copy the script from here.
            run_dir = planned_run_dir(spec)
            out = sys.stdout
            out.write("# ---- resolved spec ----\n" + spec_yaml(spec))
            if spec.resolved_executor() == "slurm":
                out.write("# ---- sbatch script (dry run: not submitted) ----\n")
                out.write(render_sbatch(spec, run_dir))
            else:
                out.write(
                    f"# ---- local executor (dry run: not started) ----\n"
                    f"# {spec.ranks_per_node} rank(s) of {spec.train.task} on this machine, "
                    f"run directory {run_dir}\n"
                )
            return 0
        submitted = submit(spec)
    except SpecError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    except SubmitError as exc:
        err.print(f"[bold red]not submitted:[/] {exc}")
        return 1
    console.print("[bold]submitted[/]")
    console.print(summary_table(submitted))
    if spec.follow:
        return follow_job(submitted, console)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mjlab-submit`."""
    spec = tyro.cli(SubmitSpec, args=argv, description=__doc__)
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())

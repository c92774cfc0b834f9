"""`mjlab-hpc`: tasks, sbatch templates and run directories."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import tyro
from rich.console import Console
from rich.table import Table

from mjlab_hpc.errors import SpecError
from mjlab_hpc.submit import SubmitSpec

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class ListTasks:
    """List the tasks mjlab-train and mjlab-submit accept."""


@dataclass(frozen=True)
class Render:
    """Fill an sbatch template (train, train_apptainer, or a path) from mjlab-submit's flags
    and print it; submit the result with plain `sbatch`."""

    template: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TEMPLATE")]
    spec: Annotated[SubmitSpec, tyro.conf.OmitArgPrefixes] = field(default_factory=SubmitSpec)


@dataclass(frozen=True)
class RunDir:
    """Print the run directory recorded under KEY, making it on first use (used by the
    templates so that every rank and restart of one job shares one directory)."""

    log_root: str = "logs"
    experiment: str = "cartpole"
    run_name: str = ""
    key: str = ""


Command = (
    Annotated[ListTasks, tyro.conf.subcommand("list-tasks")]
    | Annotated[Render, tyro.conf.subcommand("render")]
    | Annotated[RunDir, tyro.conf.subcommand("run-dir")]
)


def list_tasks() -> int:
    from mjlab_hpc.tasks import BUILTIN_TASKS

    table = Table(title="tasks")
    for col in ("name", "source", "envs", "iterations", "description"):
        table.add_column(col)
    for t in BUILTIN_TASKS.values():
        table.add_row(t.name, "built-in", str(t.num_envs), str(t.max_iterations), t.description)
    Console().print(table)
    return 0


def run(cmd: ListTasks | Render | RunDir) -> int:
    """Run one subcommand; the exit code."""
    err = Console(stderr=True)
    try:
        if isinstance(cmd, ListTasks):
            return list_tasks()
        if isinstance(cmd, Render):
            from mjlab_hpc.templates import render

            sys.stdout.write(render(cmd.template, cmd.spec))
            return 0
        from mjlab_hpc.rundir import run_dir_for_key

        if not cmd.key:
            raise SpecError("--key", "a key is needed, e.g. slurm-$SLURM_JOB_ID")
        print(run_dir_for_key(cmd.log_root, cmd.experiment, cmd.run_name, cmd.key))
        return 0
    except (SpecError, ValueError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mjlab-hpc`."""
    return run(tyro.cli(Command, args=argv, description=__doc__))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())

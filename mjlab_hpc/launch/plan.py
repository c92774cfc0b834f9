"""One plan per submission: what a command asks for, decided once, shown, then carried out.

`plan_submission` validates a SubmitSpec once (`validate_submit`) and decides everything the
submission does: the spec a continuation keeps, the run target and its directory, the
executor, a sweep's elements and their directories, every job of a --chain with its exact
batch script, the srun command inside an allocation, the code snapshot, and where each value
came from. `mjlab-submit --dry-run` prints the plan, `launch/submit` carries it out,
`mjlab-hpc render` fills a template from it and `mjlab-hpc doctor` checks it: nothing is
worked out again (torchx's dryrun()/schedule() is the model: what is shown is what runs).
A new run's directory is made at its planned name; only when another run took that name
meanwhile are its scripts aimed at the next free one (`realised`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.local import physical_gpu_ids
from mjlab_hpc.launch.slurm import (
    allocation_env,
    allocation_srun,
    job_script,
    read_template,
    render_template,
    template_context,
)
from mjlab_hpc.rank.context import Allocation
from mjlab_hpc.rundir.layout import SWEEPS_DIR, new_folder, realise_target, run_dir_name
from mjlab_hpc.rundir.snapshot import Snapshot, plan_snapshot, planned_record
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec, train_cli_args
from mjlab_hpc.validate import Executor, validate_submit
from mjlab_hpc.validate.continuation import continuation
from mjlab_hpc.validate.sweep import SweepElement

__all__ = [
    "Origin",
    "PlannedJob",
    "SubmitPlan",
    "job_plan",
    "plan_submission",
    "realised",
    "render",
]


@dataclass(frozen=True)
class Origin:
    """Where one value of a plan came from (a value not listed is a built-in default)."""

    field: str
    """The field (`num_envs`); its flag is `--num-envs`."""
    value: object
    """The value the plan holds."""
    kind: Literal["typed", "site", "kept"]
    """Typed on the command line, given by a config file, or kept from the run continued."""
    source: str = ""
    """site: the file and table (`FILE [TABLE]`); kept: the run (`the run DIR`)."""
    replaced: tuple[object, str] | None = None
    """A config file's value (and its file and table) that the run's own replaced."""

    @property
    def key(self) -> str:
        """The flag's name, as a config file spells it (`num-envs`)."""
        return self.field.replace("_", "-")


@dataclass(frozen=True)
class PlannedJob:
    """One batch script of a plan: a job (a sweep's: a job array) of one link of the chain."""

    link: int
    """Its place in the --chain, from 1."""
    after: tuple[str, ...]
    """The jobs it waits for: --after's, or `JOB<k>`, the id that link k gets when submitted."""
    parameters: Mapping[str, Any]
    """submitit's SlurmExecutor parameters."""
    script: str
    """The exact batch script."""

    def submitted(self, before: str | None) -> tuple[dict[str, Any], str]:
        """Its parameters and script with `JOB<k>` replaced by the id `before` that Slurm gave
        the link before (link 1: as planned)."""
        params = copy.deepcopy(dict(self.parameters))
        if self.link == 1 or before is None:
            return params, self.script
        placeholder = f"afterany:JOB{self.link - 1}"
        line = f"#SBATCH --dependency={placeholder}\n"
        assert self.script.count(line) == 1, "the planned script names the job before once"
        params["additional_parameters"]["dependency"] = f"afterany:{before}"
        return params, self.script.replace(line, f"#SBATCH --dependency=afterany:{before}\n")


@dataclass(frozen=True)
class SubmitPlan:
    """Everything one submission does, decided once (`plan_submission`)."""

    spec: SubmitSpec
    """The job as asked: typed flags, config files' values, what a continued run keeps."""
    resolved: ResolvedSpec
    """What every rank runs: the task resolved, with its run target."""
    executor: Executor
    """A new Slurm job, this machine, or the Slurm allocation this shell is in."""
    elements: tuple[SweepElement, ...]
    """A sweep's elements (none without --sweep)."""
    allocation: Allocation | None
    """The allocation the ranks run in (executor `allocation`)."""
    run_dir: Path
    """The run's directory (a new run's is made when the plan is carried out); a sweep's
    folder."""
    element_dirs: tuple[Path, ...]
    """Each sweep element's run directory, in order."""
    code: Snapshot | str
    """The code snapshot taken when the plan is carried out, or why there is none."""
    code_copy: str | None
    """Where that snapshot's copy goes, which the scripts import from (None: no copy)."""
    jobs: tuple[PlannedJob, ...]
    """Executor slurm: every job (a sweep's: job array) of the --chain, in order."""
    srun: tuple[str, ...]
    """Executor allocation: the srun command that starts every rank."""
    srun_env: Mapping[str, str]
    """Executor allocation: the variables srun gets beside the command's own."""
    gpus: tuple[str, ...]
    """Executor local: the ranks' CUDA_VISIBLE_DEVICES entries, one per rank with a GPU."""
    origins: tuple[Origin, ...]
    """Where each value that is not a built-in default came from."""

    @property
    def train_args(self) -> list[str]:
        """mjlab-train's arguments that train what every rank trains (without --run-dir),
        wherever they start (the log root is absolute).

        A run continued or restarted gets every flag: what it keeps was decided here (its
        experiment too, which the ranks hold against the run's).
        """
        train = self.resolved.train
        train = train.replace(log_root=str(Path(train.log_root).resolve()))
        if every := self.resolved.target.kind != "new":
            train = train.replace(experiment_name=self.resolved.experiment_name)
        return train_cli_args(train, every=every)


def _planned_dirs(
    spec: SubmitSpec, resolved: ResolvedSpec, elements: tuple[SweepElement, ...]
) -> tuple[Path, tuple[Path, ...]]:
    """Where the run (or the sweep and each of its elements' runs) goes; nothing is made.

    That is the run target's directory (--run-dir, the run --resume continues), or a new one
    named after now and the resolved run name (mjlab's --agent.run-name sets it too).
    """
    if resolved.target.path is not None:
        return Path(resolved.target.path), ()
    now = dt.datetime.now()
    root = (Path(spec.train.log_root) / resolved.experiment_name).resolve()
    if not elements:
        return root / run_dir_name(now, resolved.train.run_name), ()
    runs = tuple(root / run_dir_name(now, e.train.run_name) for e in elements)
    return root / SWEEPS_DIR / run_dir_name(now, spec.train.run_name), runs


def _aimed(plan: SubmitPlan, run_dir: Path) -> SubmitPlan:
    """`plan` with its scripts and srun command aimed at `run_dir` (a run's or sweep's)."""
    spec, record = plan.spec, planned_record(plan.code, run_dir)
    jobs: list[PlannedJob] = []
    if plan.executor == "slurm":
        for link in range(1, spec.chain + 1):
            after = tuple(spec.after) if link == 1 else (f"JOB{link - 1}",)
            params, script = job_script(spec, run_dir, record, link, after, len(plan.elements))
            jobs.append(PlannedJob(link, after, params, script))
    srun: tuple[str, ...] = ()
    env: dict[str, str] = {}
    if plan.allocation is not None:
        srun = tuple(allocation_srun(spec, plan.train_args, run_dir))
        env = allocation_env(plan.allocation, record)
    return dataclasses.replace(
        plan,
        run_dir=run_dir,
        code_copy=record["copy"] if record else None,
        jobs=tuple(jobs),
        srun=srun,
        srun_env=env,
    )


def _origins(
    spec: SubmitSpec,
    named: frozenset[str],
    given: Mapping[str, tuple[object, str]],
    kept: Mapping[str, str],
) -> tuple[Origin, ...]:
    """Where each value of `spec` came from: typed (`named`), a config file (`given`: value
    and where, by field) or the run a continuation keeps it from (`kept`)."""
    values = {f.name: getattr(spec.train, f.name) for f in dataclasses.fields(TrainSpec)}
    values |= {f.name: getattr(spec, f.name) for f in dataclasses.fields(SubmitSpec)}
    del values["train"]
    builtin = {**vars(TrainSpec()), **vars(SubmitSpec())}
    out = []
    for name, value in values.items():
        if name in named:
            out.append(Origin(name, value, "typed"))
        elif name in kept:
            # A run's own value that is the built-in one is said by the heading alone.
            replaced = given.get(name)
            replaced = replaced if replaced is not None and replaced[0] != value else None
            if value != builtin[name] or replaced is not None:
                out.append(Origin(name, value, "kept", kept[name], replaced))
        elif name in given:
            out.append(Origin(name, value, "site", given[name][1]))
    return tuple(out)


def plan_submission(
    spec: SubmitSpec,
    named: frozenset[str] | None = None,
    given: Mapping[str, tuple[object, str]] | None = None,
    warn: Callable[[str], None] | None = None,
) -> SubmitPlan:
    """Validate `spec` once and decide everything its submission does; nothing is made.

    `named`: the fields the command typed (`cli.common.parse_command`); a continuation takes
    every other from the run it continues (None: a library caller's spec, taken as it is).
    `given`: the config files' values (value, file and table) of fields not typed.
    SpecError names the flag of anything that cannot be submitted.
    """
    given = given or {}
    kept: dict[str, str] = {}
    if named is not None and not spec.sweep:  # a sweep makes new runs
        spec, kept = continuation(spec, named)
    checked = validate_submit(spec) if warn is None else validate_submit(spec, warn)
    code = plan_snapshot(Path.cwd(), off=not spec.snapshot)  # too large: refused
    run_dir, element_dirs = _planned_dirs(spec, checked.resolved, checked.elements)
    gpus: tuple[str, ...] = ()
    if checked.executor == "local":  # counted within this shell's CUDA_VISIBLE_DEVICES
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = tuple(physical_gpu_ids(range(spec.gpus_per_node), visible))
    plan = SubmitPlan(
        spec=spec,
        resolved=checked.resolved,
        executor=checked.executor,
        elements=checked.elements,
        allocation=checked.allocation,
        run_dir=run_dir,
        element_dirs=element_dirs,
        code=code,
        code_copy=None,
        jobs=(),
        srun=(),
        srun_env={},
        gpus=gpus,
        origins=_origins(spec, named or frozenset(), given, kept),
    )
    return _aimed(plan, run_dir)


def job_plan(
    spec: SubmitSpec,
    named: frozenset[str] | None = None,
    given: Mapping[str, tuple[object, str]] | None = None,
    warn: Callable[[str], None] | None = None,
) -> SubmitPlan:
    """The plan of the Slurm job mjlab-submit would submit for `spec` (`plan_submission`),
    as a dry run's (no sbatch needed), without a code snapshot: a rendered template, like
    the doctor's probe jobs, runs the commands installed where it runs."""
    spec = spec.replace(executor="slurm", dry_run=True, follow=False, snapshot=False)
    return plan_submission(spec, named, given, warn)


def realised(plan: SubmitPlan) -> SubmitPlan:
    """The plan with its run's directory (a sweep's folder) made at the planned name, or the
    next free one where another run took it meanwhile: its scripts are aimed there then.

    A sweep's elements' runs are made by its launcher.
    """
    if plan.elements:
        path = new_folder(plan.run_dir)
    else:
        resolved = realise_target(plan.resolved, planned=plan.run_dir)
        path = Path(str(resolved.target.path))
        plan = dataclasses.replace(plan, resolved=resolved)
    return plan if path == plan.run_dir else _aimed(plan, path)


def render(template: str, plan: SubmitPlan) -> str:
    """The template `template` (a name or a path) filled from a plan of one Slurm job.

    Its #SBATCH lines are those of the plan's script; its ranks train what the plan's
    ranks train, in the plan's run directory (a new run: the one the job's first start
    makes). SpecError for what a template cannot run: a sweep, a chain, a pyxis image, an
    image the template has no place for.
    """
    spec = plan.spec
    if plan.elements or spec.array_parallelism is not None:
        raise SpecError("--sweep", "a template renders one job; submit sweeps with mjlab-submit")
    if spec.chain > 1 or spec.after:
        raise SpecError(
            "--chain" if spec.chain > 1 else "--after",
            "a template renders one job: chain its jobs with "
            "`sbatch --dependency=afterany:JOBID job.sbatch`, or use mjlab-submit",
        )
    if spec.container_image is not None:
        raise SpecError(
            "--container-image",
            "a template's batch shell runs mjlab-hpc outside the image: submit pyxis jobs "
            "with mjlab-submit",
        )
    text = read_template(template)
    if ("{{IMAGE}}" in text) != (spec.container is not None):
        need = "needs an image: --container IMAGE"
        if spec.container is not None:
            need = "runs no image: use train_apptainer, or drop --container"
        raise SpecError("--container", f"template {template!r} {need}")
    run_dir = None if plan.resolved.target.path is None else plan.run_dir
    context = template_context(
        spec, plan.resolved, dict(plan.jobs[0].parameters), plan.train_args, run_dir
    )
    return render_template(text, context)

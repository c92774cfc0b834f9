"""The submitter: a submission's plan (`launch/plan`) carried out, on Slurm or on this machine.

On Slurm that is sbatch of the plan's scripts, one srun task per rank; here, submitit's local
executor. Each task runs `train_rank`, the same per-rank entry point as `mjlab-train`.
Everything was validated when the plan was made, before anything is created or submitted;
a bad value raises SpecError naming the flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.errors import SubmitError
from mjlab_hpc.launch.local import submit_local
from mjlab_hpc.launch.plan import SubmitPlan, plan_submission, realised
from mjlab_hpc.launch.slurm import slurm_executor
from mjlab_hpc.rank import RankJob
from mjlab_hpc.rundir.layout import (
    SUBMITIT_DIR,
    SWEEP_ELEMENTS,
    ElementRecord,
    SweepMember,
    SweepRecord,
    realise_target,
    write_element,
    write_sweep,
)
from mjlab_hpc.rundir.record import now_iso
from mjlab_hpc.rundir.snapshot import record_code, write_code_record
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec
from mjlab_hpc.validate.sweep import SweepElement

__all__ = [
    "Submitted",
    "SubmittedSweep",
    "element_spec",
    "prepare_run",
    "submit",
    "submit_chain",
    "submit_sweep",
]


@dataclass(frozen=True)
class Submitted:
    """A submitted job."""

    job: Any
    """The submitit job."""
    executor: Literal["slurm", "local"]
    run_dir: Path
    spec: SubmitSpec
    resolved: ResolvedSpec
    """What every rank runs (the task resolved once)."""
    chain: tuple[Any, ...] = ()
    """The later jobs of a --chain (submitit jobs), in order; each waits for the one before."""

    @property
    def job_ids(self) -> tuple[str, ...]:
        """Every job of the run, the --chain's later ones included."""
        return (self.job_id, *(str(j.job_id) for j in self.chain))

    @property
    def ranks(self) -> int:
        """Ranks of the job."""
        return self.spec.world_size

    @property
    def job_id(self) -> str:
        """Slurm's job id, or the local executor's (the controller's pid)."""
        return str(self.job.job_id)

    def rank_stdout(self, rank: int) -> Path:
        """Where submitit puts the stdout of one rank."""
        return Path(self.job.task(rank).paths.stdout)


def _plan(spec: SubmitSpec | SubmitPlan) -> SubmitPlan:
    return spec if isinstance(spec, SubmitPlan) else plan_submission(spec)


def _kind(plan: SubmitPlan) -> Literal["slurm", "local"]:
    return "slurm" if plan.executor == "slurm" else "local"


def prepare_run(plan: SubmitPlan) -> SubmitPlan:
    """Make the plan's run directory and copy the code there: a run whose ranks this
    command starts itself (inside an allocation)."""
    plan = realised(plan)
    _record_code(plan, plan.run_dir)
    return plan


def _record_code(plan: SubmitPlan, folder: Path) -> dict[str, Any]:
    """Copy the code into `folder` where the plan's scripts import it from; the record."""
    record = record_code(plan.code, folder)
    if record["copy"] != plan.code_copy:  # another submission copied into the run meanwhile
        raise SubmitError(f"the code copy went to {record['copy']}, not {plan.code_copy}")
    return record


def submit_chain(
    plan: SubmitPlan, submit_link: Callable[[dict[str, Any], str], list[Any]]
) -> list[list[Any]]:
    """Submit the plan's jobs (or job arrays) in order, each with `submit_link(params, script)`.

    The first waits for --after, every later one for the one before it. All or nothing: when
    one is refused, the ones already queued are cancelled.
    """
    links: list[list[Any]] = []
    try:
        for job in plan.jobs:
            before = str(links[-1][0].job_id).split("_")[0] if links else None  # an array: all
            links.append(submit_link(*job.submitted(before)))
    except Exception:
        for queued in (j for jobs in links for j in jobs):
            queued.cancel(check=False)
        raise
    return links


def _submit_run(plan: SubmitPlan, resolved: ResolvedSpec) -> list[Any]:
    """Submit the ranks of one run that trains `resolved` in its realised target's directory.

    That is its job, or the jobs of its --chain in order.
    """
    spec = plan.spec
    if _kind(plan) == "local":
        local = submit_local(
            resolved,
            ranks=spec.ranks_per_node,
            gpus=plan.gpus,
            timeout_min=slurm_time_minutes(spec.time),
            signal_delay_s=spec.signal_delay_s,
            foreground=spec.follow,
        )
        return [local.job]
    links = submit_chain(
        plan,
        lambda params, script: [
            slurm_executor(spec, plan.run_dir, params, script=script).submit(RankJob(resolved))
        ],
    )
    return [jobs[0] for jobs in links]


def submit(spec: SubmitSpec | SubmitPlan) -> Submitted:
    """Carry out the plan of one run (a spec: planned first): make its directory at the
    planned place, record the code, and submit the planned scripts. Nothing is submitted on
    error, and no run directory is left behind when the scheduler refuses the job."""
    plan = _plan(spec)
    kind = _kind(plan)
    made_here = plan.resolved.target.path is None  # else --run-dir, or the run it continues
    root = Path(plan.spec.train.log_root)
    new = [p for p in (root / plan.resolved.experiment_name, root) if not p.exists()]
    plan = realised(plan)
    try:
        _record_code(plan, plan.run_dir)
        jobs = _submit_run(plan, plan.resolved)
    except Exception as exc:
        if made_here:  # nothing ran: leave no empty run (nor folders made for it) behind
            shutil.rmtree(plan.run_dir, ignore_errors=True)
            for folder in new:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise SubmitError(f"{kind} refused the job: {str(exc).strip()}") from exc
    return Submitted(
        job=jobs[0],
        executor=kind,
        run_dir=plan.run_dir,
        spec=plan.spec,
        resolved=plan.resolved,
        chain=tuple(jobs[1:]),
    )


@dataclass(frozen=True)
class SubmittedSweep:
    """A submitted sweep: one Slurm job array, or one local job per element."""

    executor: Literal["slurm", "local"]
    sweep_dir: Path
    array_job_id: str | None
    """The job array's id (Slurm); None for local sweeps (every element is its own job)."""
    elements: tuple[SweepElement, ...]
    runs: tuple[Submitted, ...]
    """One per element, in index order."""
    spec: SubmitSpec


def element_spec(spec: SubmitSpec, element: SweepElement) -> SubmitSpec:
    """The single-job spec of one sweep element."""
    return spec.replace(train=element.train, sweep=(), array_parallelism=None)


def _submit_elements(plan: SubmitPlan, elements: list[SweepElement]) -> list[list[Any]]:
    """Submit one job per element (local), or one job array per link of the --chain (Slurm).

    Every element's run target is realised. Returns the jobs of each link of the chain, in
    element order.
    """
    if _kind(plan) == "local":
        jobs: list[Any] = []
        try:
            for element in elements:
                jobs.extend(_submit_run(plan, element.resolved))
        except Exception:
            for job in jobs:  # all or nothing: stop what already started
                job.cancel(check=False)
            raise
        return [jobs]
    # The array shares one submitit folder (submitit names its files <array>_<index>_<rank>);
    # each run directory links to it, so `<run>/submitit` works as for single jobs.
    folder = plan.run_dir / SUBMITIT_DIR
    folder.mkdir()
    for element in elements:
        run_dir = Path(str(element.resolved.target.path))
        (run_dir / SUBMITIT_DIR).symlink_to(os.path.relpath(folder, run_dir))

    def submit_array(params: dict[str, Any], script: str) -> list[Any]:
        executor = slurm_executor(plan.spec, plan.run_dir, params, sweep=True, script=script)
        with executor.batch():
            jobs = [executor.submit(RankJob(e.resolved)) for e in elements]
        return jobs

    return submit_chain(plan, submit_array)


def submit_sweep(spec: SubmitSpec | SubmitPlan) -> SubmittedSweep:
    """Carry out the plan of a sweep (a spec: planned first): make its folder and every
    element's run directory, and submit it.

    It goes as one job array (Slurm) or as one local job per element. Nothing is left behind
    on error.
    """
    plan = _plan(spec)
    kind = _kind(plan)
    plan = realised(plan)
    sweep_dir = plan.run_dir
    elements = list(plan.elements)
    run_dirs: list[Path] = []
    try:
        code_record = _record_code(plan, sweep_dir)  # one copy for every element
        (sweep_dir / SWEEP_ELEMENTS).mkdir()
        for n, (element, planned) in enumerate(zip(elements, plan.element_dirs, strict=True)):
            # One run directory each, made before submitting.
            resolved = realise_target(element.resolved, planned=planned)
            element = elements[n] = dataclasses.replace(element, resolved=resolved)
            run_dirs.append(Path(str(resolved.target.path)))
            write_code_record(run_dirs[-1], code_record)
            # Each element's job finds its run by its array index (its batch script: its
            # hang files; the healer), before the sweep's record is written.
            element_link = sweep_dir / SWEEP_ELEMENTS / str(element.index)
            element_link.symlink_to(os.path.relpath(run_dirs[-1], element_link.parent))
        links = _submit_elements(plan, elements)
    except Exception as exc:
        for path in [*run_dirs, sweep_dir]:  # nothing ran: leave no empty runs behind
            shutil.rmtree(path, ignore_errors=True)
        raise SubmitError(f"{kind} refused the sweep: {str(exc).strip()}") from exc
    spec = plan.spec
    jobs = links[0]
    job_ids = [str(job.job_id) for job in jobs]
    array_id = job_ids[0].split("_")[0] if kind == "slurm" else None
    chain_arrays = [str(later[0].job_id).split("_")[0] for later in links[1:]]
    members = []
    for i, (element, run_dir, job_id) in enumerate(zip(elements, run_dirs, job_ids, strict=True)):
        record = ElementRecord(
            sweep_dir=sweep_dir,
            index=element.index,
            job_id=job_id,
            executor=kind,
            overrides=element.as_dict(),
            # This element's job in every later array of the chain.
            chain=tuple(str(later[i].job_id) for later in links[1:]),
        )
        write_element(run_dir, record)
        members.append(SweepMember(**vars(record), run_dir=run_dir))
    write_sweep(
        sweep_dir,
        SweepRecord(
            executor=kind,
            array_job_id=array_id,
            created_at=now_iso(),
            axes={k: tuple(v) for k, v in _axes_of(elements).items()},
            array_parallelism=spec.array_parallelism,
            chain_array_job_ids=tuple(chain_arrays),
            elements=tuple(members),
        ),
    )
    runs = tuple(
        Submitted(
            job=job,
            executor=kind,
            run_dir=run_dir,
            spec=element_spec(spec, element),
            resolved=element.resolved,
            chain=tuple(later[i] for later in links[1:]),
        )
        for i, (job, run_dir, element) in enumerate(zip(jobs, run_dirs, elements, strict=True))
    )
    return SubmittedSweep(
        executor=kind,
        sweep_dir=sweep_dir,
        array_job_id=array_id,
        elements=tuple(elements),
        runs=runs,
        spec=spec,
    )


def _axes_of(elements: list[SweepElement]) -> dict[str, list[str]]:
    axes: dict[str, list[str]] = {}
    for element in elements:
        for key, value in element.overrides:
            values = axes.setdefault(key, [])
            if value not in values:
                values.append(value)
    return axes

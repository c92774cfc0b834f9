"""The submitter: a SubmitSpec becomes a submitit job on Slurm or on this machine.

On Slurm that is sbatch with one srun task per rank; here, submitit's local executor. Each
task runs `train_rank`, the same per-rank entry point as `mjlab-train`. Everything is
validated before anything is created or submitted; a bad value raises SpecError naming the
flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mjlab_hpc.errors import SubmitError
from mjlab_hpc.launch.local import physical_gpu_ids, submit_local
from mjlab_hpc.launch.slurm import array_executor, make_slurm_executor
from mjlab_hpc.rank import RankJob
from mjlab_hpc.rundir.layout import (
    SUBMITIT_DIR,
    SWEEP_ELEMENTS,
    SWEEPS_DIR,
    ElementRecord,
    SweepMember,
    SweepRecord,
    create_sweep_dir,
    realise_target,
    run_dir_name,
    write_element,
    write_sweep,
)
from mjlab_hpc.rundir.record import now_iso
from mjlab_hpc.rundir.snapshot import plan_snapshot, record_code, write_code_record
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec
from mjlab_hpc.validate import executor_for, validate_submit
from mjlab_hpc.validate.sweep import SweepElement, sweep_elements

__all__ = [
    "Submitted",
    "SubmittedSweep",
    "element_spec",
    "planned_run_dir",
    "planned_sweep",
    "submit",
    "submit_chain",
    "submit_run",
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


def planned_run_dir(spec: SubmitSpec, resolved: ResolvedSpec) -> Path:
    """Return where a dry run would put the run; nothing is created.

    That is the run target's directory (--run-dir, the run --resume continues), or a new one.
    """
    if resolved.target.path is not None:
        return Path(resolved.target.path)
    # The resolved run name: mjlab's --agent.run-name sets it too.
    name = run_dir_name(dt.datetime.now(), resolved.train.run_name)
    return (Path(spec.train.log_root) / resolved.experiment_name / name).resolve()


def submit_chain(
    spec: SubmitSpec, submit_link: Callable[[int, tuple[str, ...]], list[Any]]
) -> list[list[Any]]:
    """Submit the --chain's jobs (or job arrays) in order, each with `submit_link(link, after)`.

    The first waits for --after, every later one for the one before it. All or nothing: when
    one is refused, the ones already queued are cancelled.
    """
    links: list[list[Any]] = []
    after = tuple(spec.after)
    try:
        for link in range(1, spec.chain + 1):
            jobs = submit_link(link, after)
            links.append(jobs)
            after = (str(jobs[0].job_id).split("_")[0],)  # a job array's id: all of it
    except Exception:
        for job in (j for jobs in links for j in jobs):
            job.cancel(check=False)
        raise
    return links


def submit_run(
    spec: SubmitSpec, resolved: ResolvedSpec, kind: Literal["slurm", "local"]
) -> list[Any]:
    """Submit the ranks of one run that trains `resolved` in its realised target's directory.

    That is its job, or the jobs of its --chain in order.
    """
    run_dir = Path(str(resolved.target.path))
    if kind == "local":
        # One GPU per rank, counted within this shell's CUDA_VISIBLE_DEVICES (as mjlab-train's
        # --gpu-ids): the ranks see these, local rank k trains on the k-th.
        gpus = physical_gpu_ids(range(spec.gpus_per_node), os.environ.get("CUDA_VISIBLE_DEVICES"))
        local = submit_local(
            resolved,
            ranks=spec.ranks_per_node,
            gpus=tuple(gpus),
            timeout_min=slurm_time_minutes(spec.time),
            signal_delay_s=spec.signal_delay_s,
            foreground=spec.follow,
        )
        return [local.job]
    links = submit_chain(
        spec,
        lambda link, after: [
            make_slurm_executor(spec, run_dir, link=link, after=after).submit(RankJob(resolved))
        ],
    )
    return [jobs[0] for jobs in links]


def submit(spec: SubmitSpec) -> Submitted:
    """Validate, decide the run directory once, and submit. Nothing is submitted on error,
    and no run directory is left behind when the scheduler refuses the job."""
    resolved = validate_submit(spec)
    kind: Literal["slurm", "local"] = "slurm" if executor_for(spec) == "slurm" else "local"
    made_here = resolved.target.path is None  # else --run-dir, or the run --resume continues
    code = plan_snapshot(Path.cwd(), not spec.snapshot)  # too large: refused, nothing made
    root = Path(spec.train.log_root)
    new = [p for p in (root / resolved.experiment_name, root) if not p.exists()]
    resolved = realise_target(resolved)
    run_dir = Path(str(resolved.target.path))
    try:
        record_code(code, run_dir)
        jobs = submit_run(spec, resolved, kind)
    except Exception as exc:
        if made_here:  # nothing ran: leave no empty run (nor folders made for it) behind
            shutil.rmtree(run_dir, ignore_errors=True)
            for folder in new:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise SubmitError(f"{kind} refused the job: {str(exc).strip()}") from exc
    return Submitted(
        job=jobs[0],
        executor=kind,
        run_dir=run_dir,
        spec=spec,
        resolved=resolved,
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


def planned_sweep(spec: SubmitSpec, resolved: ResolvedSpec) -> tuple[Path, list[Path]]:
    """Where a dry run would put the sweep record and each element's run (nothing is made)."""
    now = dt.datetime.now()
    root = (Path(spec.train.log_root) / resolved.experiment_name).resolve()
    elements = sweep_elements(spec.train, spec.sweep)
    runs = [root / run_dir_name(now, e.train.run_name) for e in elements]
    return root / SWEEPS_DIR / run_dir_name(now, spec.train.run_name), runs


def _submit_elements(
    spec: SubmitSpec,
    kind: Literal["slurm", "local"],
    sweep_dir: Path,
    elements: list[SweepElement],
) -> list[list[Any]]:
    """Submit one job per element (local), or one job array per link of the --chain (Slurm).

    Every element's run target is realised. Returns the jobs of each link of the chain, in
    element order.
    """
    if kind == "local":
        jobs: list[Any] = []
        try:
            for element in elements:
                jobs.extend(submit_run(spec, element.resolved, kind))
        except Exception:
            for job in jobs:  # all or nothing: stop what already started
                job.cancel(check=False)
            raise
        return [jobs]
    # The array shares one submitit folder (submitit names its files <array>_<index>_<rank>);
    # each run directory links to it, so `<run>/submitit` works as for single jobs.
    folder = sweep_dir / SUBMITIT_DIR
    folder.mkdir()
    for element in elements:
        run_dir = Path(str(element.resolved.target.path))
        (run_dir / SUBMITIT_DIR).symlink_to(os.path.relpath(folder, run_dir))

    def submit_array(link: int, after: tuple[str, ...]) -> list[Any]:
        executor = array_executor(spec, sweep_dir, link=link, after=after)
        with executor.batch():
            jobs = [executor.submit(RankJob(e.resolved)) for e in elements]
        return jobs

    return submit_chain(spec, submit_array)


def submit_sweep(spec: SubmitSpec) -> SubmittedSweep:
    """Validate, make every element's run directory, and submit the sweep.

    It goes as one job array (Slurm) or as one local job per element. Nothing is left behind
    on error.
    """
    resolved = validate_submit(spec)
    elements = sweep_elements(spec.train, spec.sweep)
    kind: Literal["slurm", "local"] = "slurm" if executor_for(spec) == "slurm" else "local"
    log_root, experiment = spec.train.log_root, resolved.experiment_name
    code = plan_snapshot(Path.cwd(), not spec.snapshot)  # too large: refused, nothing made
    sweep_dir = create_sweep_dir(log_root, experiment, spec.train.run_name)
    run_dirs: list[Path] = []
    try:
        code_record = record_code(code, sweep_dir)  # one copy for every element
        (sweep_dir / SWEEP_ELEMENTS).mkdir()
        for n, element in enumerate(elements):  # one run directory each, made before submitting
            element = dataclasses.replace(element, resolved=realise_target(element.resolved))
            elements[n] = element
            run_dirs.append(Path(str(element.resolved.target.path)))
            write_code_record(run_dirs[-1], code_record)
            # Each element's job finds its run by its array index (its batch script: its
            # hang files; the healer), before the sweep's record is written.
            element_link = sweep_dir / SWEEP_ELEMENTS / str(element.index)
            element_link.symlink_to(os.path.relpath(run_dirs[-1], element_link.parent))
        links = _submit_elements(spec, kind, sweep_dir=sweep_dir, elements=elements)
    except Exception as exc:
        for path in [*run_dirs, sweep_dir]:  # nothing ran: leave no empty runs behind
            shutil.rmtree(path, ignore_errors=True)
        raise SubmitError(f"{kind} refused the sweep: {str(exc).strip()}") from exc
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

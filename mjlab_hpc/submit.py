"""The submitter: a SubmitSpec becomes a submitit job on Slurm (sbatch, one srun task per GPU)
or on this machine (submitit's local executor). Each task runs `train_rank`, the same per-rank
entry point as `mjlab-train`.

Everything is validated before anything is submitted; a bad value raises SpecError naming the
flag.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from mjlab_hpc.errors import SpecError, SubmitError
from mjlab_hpc.launch import RankJob
from mjlab_hpc.rundir import create_run_dir, run_dir_name, write_json_atomic
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.sweep import (
    ELEMENT_RECORD,
    SWEEP_RECORD,
    SWEEPS_DIR,
    SweepElement,
    sweep_elements,
)
from mjlab_hpc.tasks import resolve_task

ExecutorChoice = Literal["slurm", "local", "auto"]

_TIME_FORMATS = (
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d{1,2})$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2})$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2}):(\d{1,2})$"), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def slurm_time_minutes(value: str) -> int:
    """Minutes of a Slurm time limit (`30`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`,
    `D-HH:MM:SS`), rounded up to whole minutes as Slurm does."""
    text = value.strip()
    for pattern, units in _TIME_FORMATS:
        m = pattern.match(text)
        if m:
            seconds = sum(int(g) * _SECONDS[u] for g, u in zip(m.groups(), units, strict=True))
            if seconds <= 0:
                break
            return math.ceil(seconds / 60)
    raise SpecError(
        "--time",
        f"{value!r} is not a Slurm time limit; use minutes (90), HH:MM:SS (12:00:00) "
        "or D-HH:MM:SS (1-00:00:00)",
    )


@dataclass(frozen=True)
class SubmitSpec:
    """A multi-node training job (the flags of `mjlab-submit`)."""

    train: Annotated[TrainSpec, tyro.conf.OmitArgPrefixes] = field(default_factory=TrainSpec)
    nodes: int = 1
    """Nodes of the job."""
    gpus_per_node: int = 1
    """GPUs per node; one rank (srun task) per GPU. 0 for CPU-only partitions."""
    tasks_per_node: int | None = None
    """Ranks per node (default: --gpus-per-node, or 1 without GPUs)."""
    cpus_per_task: int | None = None
    """CPU cores per rank (Slurm's --cpus-per-task)."""
    mem: str | None = None
    """Memory per node, Slurm syntax (64G, 500M)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "1:00:00"
    """Time limit: minutes, HH:MM:SS or D-HH:MM:SS."""
    constraint: str | None = None
    """Node features (Slurm's --constraint), e.g. a100."""
    exclusive: bool = False
    """Whole nodes for this job."""
    job_name: str | None = None
    """Name in squeue (default: mjlab-<task>)."""
    container: str | None = None
    """Apptainer/Singularity image to run every rank in (--nv on GPUs)."""
    setup: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A shell line to run before the ranks start (repeatable), e.g. 'module load cuda'."""
    sbatch_arg: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Any other sbatch option as KEY=VALUE (repeatable), e.g. mail-type=END."""
    executor: ExecutorChoice = "auto"
    """slurm, local (this machine, CPU ranks unless GPUs), or auto (slurm if sbatch exists)."""
    signal_delay_s: int = 90
    """Seconds before the time limit at which Slurm sends USR2 (checkpoint and requeue)."""
    dry_run: bool = False
    """Print the resolved spec and the exact sbatch script; submit nothing."""
    follow: bool = False
    """Stay, stream rank 0's progress, and exit with the job's outcome."""
    sweep: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """KEY=V1,V2,... (repeatable): one job array over the cartesian product of the values,
    one run directory per element, e.g. seed=0,1,2 or num_envs=512,1024."""
    array_parallelism: int | None = None
    """With --sweep: at most N elements run at once (Slurm's --array=...%N)."""

    @property
    def ranks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def preempt_signal(self) -> str:
        """The time-limit warning signal, as Slurm names it (USR2)."""
        return self.train.preempt_signal.upper().removeprefix("SIG")

    @property
    def name(self) -> str:
        return self.job_name or f"mjlab-{self.train.task}"

    def resolved_executor(self) -> Literal["slurm", "local"]:
        """`auto` becomes slurm where sbatch can be found, else local."""
        if self.executor != "auto":
            return self.executor
        return "slurm" if shutil.which("sbatch") else "local"

    def sbatch_extra(self) -> dict[str, str | bool]:
        """--sbatch-arg KEY=VALUE pairs (a bare KEY is a flag)."""
        out: dict[str, str | bool] = {}
        for item in self.sbatch_arg:
            key, sep, value = item.partition("=")
            key = key.strip().lstrip("-")
            if not _SBATCH_KEY.match(key):
                raise SpecError(
                    "--sbatch-arg", f"{item!r} is not KEY=VALUE with an sbatch option as KEY"
                )
            out[key] = value if sep else True
        return out

    def validate(self) -> None:
        """Raise SpecError naming the flag for anything that cannot be submitted."""
        self.train.validate()
        try:
            resolve_task(self.train)
        except KeyError as exc:
            raise SpecError("TASK", str(exc.args[0])) from None
        if self.nodes < 1:
            raise SpecError("--nodes", f"must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise SpecError("--gpus-per-node", f"must be >= 0, got {self.gpus_per_node}")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise SpecError("--tasks-per-node", f"must be >= 1, got {self.tasks_per_node}")
        if self.gpus_per_node > 0 and self.ranks_per_node != self.gpus_per_node:
            raise SpecError(
                "--tasks-per-node",
                f"{self.ranks_per_node} ranks for {self.gpus_per_node} GPUs per node: the job "
                "runs one rank per GPU; drop --tasks-per-node or make it equal --gpus-per-node",
            )
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise SpecError("--cpus-per-task", f"must be >= 1, got {self.cpus_per_task}")
        if self.mem is not None and not _MEM.match(self.mem):
            raise SpecError("--mem", f"{self.mem!r} is not a Slurm memory size (e.g. 64G, 500M)")
        slurm_time_minutes(self.time)
        if self.signal_delay_s < 1:
            raise SpecError("--signal-delay-s", f"must be >= 1, got {self.signal_delay_s}")
        if self.signal_delay_s >= slurm_time_minutes(self.time) * 60:
            raise SpecError(
                "--signal-delay-s",
                f"{self.signal_delay_s} s is not shorter than --time {self.time}; "
                "the warning must come before the limit",
            )
        if self.container is not None and not Path(self.container).is_file():
            raise SpecError("--container", f"image {self.container!r} does not exist")
        if self.train.num_procs != 1:
            raise SpecError("--num-procs", "mjlab-submit starts ranks itself: use --tasks-per-node")
        if self.train.gpu_ids != "auto":
            raise SpecError(
                "--gpu-ids", "mjlab-submit gives each rank its GPU: use --gpus-per-node"
            )
        if any("\n" in line for line in self.setup):
            raise SpecError("--setup", "one shell line per --setup (no newlines)")
        self.sbatch_extra()
        executor = self.resolved_executor()
        if executor == "slurm" and not self.dry_run and shutil.which("sbatch") is None:
            raise SpecError(
                "--executor",
                "slurm, but sbatch is not on PATH: submit from a login node, load Slurm's "
                "module, or use --executor local",
            )
        if executor == "local" and self.nodes > 1:
            raise SpecError("--nodes", "the local executor runs on this one machine: use --nodes 1")
        if executor == "local" and self.container is not None:
            raise SpecError("--container", "containers run through Slurm: use --executor slurm")
        self.sweep_elements()

    def sweep_elements(self) -> list[SweepElement]:
        """The sweep's elements ([] without --sweep); SpecError naming the flag if invalid."""
        if self.array_parallelism is not None and self.array_parallelism < 1:
            raise SpecError("--array-parallelism", f"must be >= 1, got {self.array_parallelism}")
        if not self.sweep:
            if self.array_parallelism is not None:
                raise SpecError("--array-parallelism", "throttles a sweep: use it with --sweep")
            return []
        if self.train.run_dir:
            raise SpecError("--run-dir", "a sweep makes one run directory per element")
        if self.train.resume:
            raise SpecError("--resume", "a sweep starts new runs; resume each run by itself")
        return sweep_elements(self.train, self.sweep)


def experiment_of(spec: SubmitSpec) -> str:
    return spec.train.experiment_name or resolve_task(spec.train).experiment_name


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
            **spec.sbatch_extra(),
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


def _slurm_executor_class() -> type:
    import submitit

    class MjlabSlurmExecutor(submitit.SlurmExecutor):
        """submitit's SlurmExecutor that can also render a script where there is no srun."""

        allow_without_srun = False

        @classmethod
        def affinity(cls) -> int:
            return 2 if cls.allow_without_srun else super().affinity()

    return MjlabSlurmExecutor


def make_slurm_executor(spec: SubmitSpec, run_dir: Path, dry_run: bool = False) -> Any:
    """A configured submitit SlurmExecutor writing into `<run_dir>/submitit`."""
    cls = _slurm_executor_class()
    cls.allow_without_srun = dry_run
    executor = cls(folder=run_dir / "submitit", python=container_python(spec, run_dir))
    executor.update_parameters(**slurm_parameters(spec))
    return executor


def render_sbatch(spec: SubmitSpec, run_dir: Path) -> str:
    """The exact sbatch script submitit submits for this spec."""
    executor = make_slurm_executor(spec, run_dir, dry_run=True)
    return str(executor._make_submission_file_text(executor._submitit_command_str, "dry-run"))


@dataclass(frozen=True)
class Submitted:
    """A submitted job."""

    job: Any
    executor: Literal["slurm", "local"]
    run_dir: Path
    spec: SubmitSpec

    @property
    def ranks(self) -> int:
        return self.spec.world_size

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def rank_stdout(self, rank: int) -> Path:
        return Path(self.job.task(rank).paths.stdout)


def planned_run_dir(spec: SubmitSpec) -> Path:
    """Where a dry run would put the run (nothing is created)."""
    import datetime as dt

    if spec.train.run_dir:
        return Path(spec.train.run_dir)
    name = run_dir_name(dt.datetime.now(), spec.train.run_name)
    return (Path(spec.train.log_root) / experiment_of(spec) / name).resolve()


def submit(spec: SubmitSpec) -> Submitted:
    """Validate, decide the run directory once, and submit. Nothing is submitted on error."""
    spec.validate()
    executor_kind = spec.resolved_executor()
    made_here = not spec.train.run_dir
    run_dir = (
        create_run_dir(spec.train.log_root, experiment_of(spec), spec.train.run_name)
        if made_here
        else Path(str(spec.train.run_dir)).resolve()
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    train = spec.train.replace(run_dir=str(run_dir))
    try:
        if executor_kind == "local":
            from mjlab_hpc.launch import submit_local

            gpus = tuple(range(spec.gpus_per_node))
            local = submit_local(
                train,
                spec.ranks_per_node,
                gpus,
                timeout_min=slurm_time_minutes(spec.time),
                signal_delay_s=spec.signal_delay_s,
            )
            return Submitted(job=local.job, executor="local", run_dir=run_dir, spec=spec)
        executor = make_slurm_executor(spec, run_dir)
        job = executor.submit(RankJob(train))
        return Submitted(job=job, executor="slurm", run_dir=run_dir, spec=spec)
    except Exception as exc:
        if made_here:  # nothing ran: leave no empty run behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise SubmitError(f"{executor_kind} refused the job: {str(exc).strip()}") from exc


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
    return dataclasses.replace(spec, train=element.train, sweep=(), array_parallelism=None)


def planned_sweep(spec: SubmitSpec) -> tuple[Path, list[Path]]:
    """Where a dry run would put the sweep record and each element's run (nothing is made)."""
    import datetime as dt

    now = dt.datetime.now()
    root = (Path(spec.train.log_root) / experiment_of(spec)).resolve()
    runs = [root / run_dir_name(now, e.train.run_name) for e in spec.sweep_elements()]
    return root / SWEEPS_DIR / run_dir_name(now, spec.train.run_name), runs


def _array_executor(spec: SubmitSpec, sweep_dir: Path, dry_run: bool = False) -> Any:
    executor = make_slurm_executor(spec, sweep_dir, dry_run=dry_run)
    if spec.array_parallelism is not None:
        executor.update_parameters(array_parallelism=spec.array_parallelism)
    return executor


def render_array_sbatch(spec: SubmitSpec, sweep_dir: Path, count: int) -> str:
    """The exact sbatch script of a sweep's job array of `count` elements."""
    executor = _array_executor(spec, sweep_dir, dry_run=True)
    executor.parameters["map_count"] = count  # what submitit sets when it submits an array
    return str(executor._make_submission_file_text(executor._submitit_command_str, "dry-run"))


def _submit_elements(
    spec: SubmitSpec, kind: Literal["slurm", "local"], sweep_dir: Path, trains: list[TrainSpec]
) -> list[Any]:
    """Submit one job per element (local) or one job array (Slurm); the jobs in order."""
    if kind == "local":
        from mjlab_hpc.launch import submit_local

        jobs: list[Any] = []
        try:
            for train in trains:
                local = submit_local(
                    train,
                    spec.ranks_per_node,
                    tuple(range(spec.gpus_per_node)),
                    timeout_min=slurm_time_minutes(spec.time),
                    signal_delay_s=spec.signal_delay_s,
                )
                jobs.append(local.job)
        except Exception:
            for job in jobs:  # all or nothing: stop what already started
                job.cancel(check=False)
            raise
        return jobs
    # The array shares one submitit folder (submitit names its files <array>_<index>_<rank>);
    # each run directory links to it, so `<run>/submitit` works as for single jobs.
    folder = sweep_dir / "submitit"
    folder.mkdir()
    for train in trains:
        run_dir = Path(str(train.run_dir))
        (run_dir / "submitit").symlink_to(os.path.relpath(folder, run_dir))
    executor = _array_executor(spec, sweep_dir)
    with executor.batch():
        jobs = [executor.submit(RankJob(train)) for train in trains]
    return jobs


def submit_sweep(spec: SubmitSpec) -> SubmittedSweep:
    """Validate, make every element's run directory, and submit the sweep as one job array
    (Slurm) or as one local job per element. Nothing is left behind on error."""
    from mjlab_hpc.runrecord import now_iso

    spec.validate()
    elements = spec.sweep_elements()
    kind = spec.resolved_executor()
    experiment = experiment_of(spec)
    sweep_dir = create_run_dir(
        Path(spec.train.log_root) / experiment, SWEEPS_DIR, spec.train.run_name
    )
    run_dirs: list[Path] = []
    try:
        for element in elements:
            run_dirs.append(create_run_dir(spec.train.log_root, experiment, element.train.run_name))
        trains = [e.train.replace(run_dir=str(d)) for e, d in zip(elements, run_dirs, strict=True)]
        jobs = _submit_elements(spec, kind, sweep_dir, trains)
    except Exception as exc:
        for path in [*run_dirs, sweep_dir]:  # nothing ran: leave no empty runs behind
            shutil.rmtree(path, ignore_errors=True)
        raise SubmitError(f"{kind} refused the sweep: {str(exc).strip()}") from exc
    job_ids = [str(job.job_id) for job in jobs]
    array_id = job_ids[0].split("_")[0] if kind == "slurm" else None
    records = []
    for element, run_dir, job_id in zip(elements, run_dirs, job_ids, strict=True):
        record = {
            "sweep_dir": str(sweep_dir),
            "index": element.index,
            "job_id": job_id,
            "executor": kind,
            "overrides": element.as_dict(),
        }
        write_json_atomic(run_dir / ELEMENT_RECORD, record)
        records.append({**record, "run_dir": str(run_dir)})
    write_json_atomic(
        sweep_dir / SWEEP_RECORD,
        {
            "executor": kind,
            "array_job_id": array_id,
            "created_at": now_iso(),
            "axes": {k: list(v) for k, v in _axes_of(elements).items()},
            "array_parallelism": spec.array_parallelism,
            "elements": records,
        },
    )
    runs = tuple(
        Submitted(job=job, executor=kind, run_dir=d, spec=element_spec(spec, e))
        for job, d, e in zip(jobs, run_dirs, elements, strict=True)
    )
    return SubmittedSweep(kind, sweep_dir, array_id, tuple(elements), runs, spec)


def _axes_of(elements: list[SweepElement]) -> dict[str, list[str]]:
    axes: dict[str, list[str]] = {}
    for element in elements:
        for key, value in element.overrides:
            values = axes.setdefault(key, [])
            if value not in values:
                values.append(value)
    return axes

"""Checks against what exists, before anything is created, submitted or started: the log root
can be written, a run directory is a run (or new) and can be continued, this machine has the
cores, GPUs and memory local ranks ask for, a Slurm partition, allocation or job array can take
the job (its nodes' memory too), and the jobs it waits for exist."""

from __future__ import annotations

import dataclasses
import getpass
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import DamagedRecord, SpecError
from mjlab_hpc.procs import memory_room, user_name
from mjlab_hpc.rank.context import Allocation, cuda_device_count
from mjlab_hpc.rundir.checkpoint import Checkpoints, cannot_continue
from mjlab_hpc.rundir.durable import ownership
from mjlab_hpc.rundir.layout import (
    RUN_RECORD,
    RunDir,
    checkpoint_iteration,
    is_run_dir,
    latest_run,
    list_checkpoints,
)
from mjlab_hpc.rundir.state import changed_settings, read_record, resized_by_healer, versions
from mjlab_hpc.rundir.writer import busy_problem
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.slurm.units import mem_bytes, slurm_time_minutes
from mjlab_hpc.spec import (
    KEPT_ON_CONTINUATION,
    SIMULATOR_PACKAGES,
    ResolvedSpec,
    SubmitSpec,
    TrainSpec,
)
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS
from mjlab_hpc.tasks.memory import device_memory, world_bytes
from mjlab_hpc.tasks.mjlab import configured_cfgs
from mjlab_hpc.validate.continuation import override_values

__all__ = [
    "check_after_exists",
    "check_allocation",
    "check_array_size",
    "check_local_cpus",
    "check_local_gpus",
    "check_log_root",
    "check_memory",
    "check_partition",
    "check_places",
    "check_run_dir",
    "check_submit_memory",
    "check_train_memory",
    "continue_target",
    "usable_cores",
]


def check_log_root(flag: str, log_root: str, existing_only: bool = False) -> Path:
    """The log root, or SpecError when runs cannot be written there: it is a file, or the
    folder (or the nearest one that exists) is read-only or not writable. `existing_only`:
    a log root that does not exist here is not checked (a dry run for another machine)."""
    path = Path(log_root)
    if path.exists() and not path.is_dir():
        raise SpecError(flag, f"{log_root} is a file, not a folder; give a folder for the runs")
    if existing_only and not path.exists():
        return path
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SpecError(flag, f"{existing} (in {log_root}) is a file, not a folder")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise SpecError(
            flag, f"{existing} is on a read-only filesystem; give a writable folder for the runs"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        fix = (
            "continue it as its owner, or give another run directory"
            if flag in ("--run-dir", "--resume")
            else f"ask {user_name(existing.stat().st_uid)} to make it group-writable (chmod "
            "g+w), or give a folder you can write to"
        )
        raise SpecError(
            flag,
            f"{existing} is not writable by {getpass.getuser()} ({ownership(existing)}): {fix}",
        )
    return path


def check_run_dir(flag: str, run_dir: str, existing_only: bool = False) -> Path:
    """`run_dir`, or SpecError when it is a file or a folder of other files (training into it
    would mix them with the run's)."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise SpecError(flag, f"{run_dir} is a file, not a run directory")
    if path.is_dir() and any(path.iterdir()) and not is_run_dir(path):
        raise SpecError(
            flag,
            f"{run_dir} holds files but no run (no run.json, progress.jsonl, logs/, ...); give "
            "a run directory, or a new or empty folder",
        )
    check_log_root(flag, str(path), existing_only)
    return path


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a Slurm allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_local_cpus(flag: str, ranks: int, oversubscribe: bool) -> None:
    """SpecError when more CPU ranks are asked for than this machine has cores (each rank
    steps its physics on one core), unless --oversubscribe says to."""
    cores = usable_cores()
    if ranks > cores and not oversubscribe:
        raise SpecError(
            flag,
            f"{ranks} ranks on a machine with {cores} usable cores (each rank runs its physics "
            f"on one core); use at most {cores}, or --oversubscribe to run them anyway",
        )


def check_local_gpus(flag: str, wanted: int, count: Callable[[], int] = cuda_device_count) -> None:
    """SpecError when local ranks ask for more GPUs than this machine shows (`flag`:
    --gpus-per-node or --device, each answered with its own fix)."""
    if wanted <= 0:
        return
    have = count()
    if have >= wanted:
        return
    shows = f"this machine shows {have} usable GPU(s) (no driver, or a CPU build of torch)"
    if flag == "--device":
        raise SpecError(flag, f"cuda asked for, but {shows}; use --device cpu (or auto)")
    raise SpecError(
        flag,
        f"{wanted} GPU(s) per node asked for, but {shows}; use --gpus-per-node 0 for CPU "
        "ranks, or submit to a cluster (--executor slurm)",
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_memory(
    resolved: ResolvedSpec, ranks: int, room: int, where: str, ranks_flag: str,
    mem_flag: str | None = None,
) -> None:  # fmt: skip
    """SpecError when `ranks` ranks of the request cannot fit in `room` bytes (`where`: what
    gives them, for people, with `{}` for the size), counting what MuJoCo Warp's worlds alone
    take. A built-in task's bound on its per-world bytes settles most requests without loading
    Warp."""
    envs = resolved.num_envs
    task = BUILTIN_TASKS.get(resolved.task)
    if task is not None and envs * ranks * task.max_world_bytes <= room:
        return
    per_world = world_bytes(resolved)
    need = envs * ranks * per_world
    if need <= room:
        return
    most = room // (per_world * ranks)
    cut = f"--num-envs {most}" if most else "a smaller task"
    if mem_flag is not None:
        flag, fix = (
            mem_flag,
            f"raise {mem_flag} to at least {-(-need // 2**20)}M, or use at most {cut}",
        )
    elif ranks > 1 and envs * per_world <= room:
        fits = room // (envs * per_world)
        flag, fix = ranks_flag, f"use at most {fits} rank{'s' * (fits != 1)}, or at most {cut}"
    else:
        flag, fix = "--num-envs", f"use at most {cut}"
    times = f" x {ranks} ranks" if ranks > 1 else ""
    raise SpecError(
        flag,
        f"{envs} environments per rank{times} need at least {_size(need)} ({per_world} bytes "
        f"per world of {resolved.task}'s model in MuJoCo Warp, before any torch buffer), and "
        f"{where.format(_size(room))}: {fix}",
    )


def check_train_memory(resolved: ResolvedSpec) -> None:
    """The local ranks of `mjlab-train` fit this machine: in its memory (CPU ranks), or each in
    its GPU's."""
    spec = resolved.train
    gpus = spec.gpu_ids
    if spec.num_procs == 1 and (gpus not in ("auto", None) or spec.device == "cuda"):
        ids = range(cuda_device_count()) if gpus == "all" else (0,) if gpus == "auto" else gpus
        # An id beyond the GPUs there are is refused later, by name (--gpu-ids).
        for i in [i for i in ids or () if i < cuda_device_count()]:
            check_memory(resolved, 1, device_memory(i), f"GPU {i} has {{}}", "--gpu-ids")
        return
    room, why = memory_room()
    check_memory(resolved, spec.num_procs, room, f"this machine has {{}} {why}", "--num-procs")


def check_submit_memory(spec: SubmitSpec, resolved: ResolvedSpec, executor: str) -> None:
    """CPU ranks of a job fit a node: in --mem, or in this machine for the local executor (a
    partition's RealMemory: `check_partition`). GPU ranks keep their worlds on the GPUs, whose
    memory is known only on the nodes."""
    if spec.gpus_per_node > 0 or spec.sweep:
        return
    if spec.mem is not None:
        where = f"--mem {spec.mem} gives a node {{}}"
        check_memory(resolved, spec.ranks_per_node, mem_bytes(spec.mem), where,
                     "--tasks-per-node", "--mem")  # fmt: skip
    elif executor == "local":
        room, why = memory_room()
        check_memory(resolved, spec.ranks_per_node, room, f"this machine has {{}} {why}",
                     "--tasks-per-node")  # fmt: skip


def check_partition(
    spec: SubmitSpec, warn: Callable[[str], None], client: SlurmClient | None = None,
    resolved: ResolvedSpec | None = None,
) -> None:  # fmt: skip
    """SpecError when the partition cannot give the job what it asks for (nodes, GPUs per
    node, time, and for CPU ranks the memory their worlds take), from sinfo; a warning when
    sinfo cannot tell."""
    partitions = (client or SlurmClient(timeout_s=10)).partitions()
    if partitions is None:
        warn(
            "sinfo did not answer: the partition's nodes, GPUs and time limit are not checked "
            "before submitting"
        )
        return
    known = ", ".join(sorted(n for n in partitions if n)) or "none"
    names = (spec.partition or "").split(",")
    for name in names:
        if name and name not in partitions:
            raise SpecError("--partition", f"{name!r} does not exist; partitions: {known}")
    if len(names) > 1:
        return  # Slurm picks one of several: each could be the one, so none is held to it
    part = partitions.get(spec.partition or "")
    if part is None:
        warn("the cluster has no default partition: sbatch will ask for --partition")
        return
    # The whole request, spares included: Slurm would keep a job larger than the partition
    # (or its MaxNodes) pending for good (PartitionNodeLimit).
    most = min(part.nodes, part.max_nodes or part.nodes)
    if spec.nodes + spec.spare_nodes > most:
        limit = f"has {part.nodes}" if most == part.nodes else f"allows {most} per job (MaxNodes)"
        asked = f"{spec.nodes} nodes" + (f" + {spec.spare_nodes} spare" if spec.spare_nodes
                                         else "")  # fmt: skip
        raise SpecError(
            "--spare-nodes" if spec.spare_nodes and spec.nodes <= most else "--nodes",
            f"{asked} asked for; partition {part.name} {limit}",
        )
    if spec.gpus_per_node > part.gpus_per_node:
        raise SpecError(
            "--gpus-per-node",
            f"{spec.gpus_per_node} GPUs per node asked for; the nodes of partition {part.name} "
            f"have at most {part.gpus_per_node}",
        )
    if part.cpus_per_node is not None:
        cpus = spec.ranks_per_node * (spec.cpus_per_task or 1)
        if cpus > part.cpus_per_node:
            alone = spec.cpus_per_task is not None and spec.ranks_per_node <= part.cpus_per_node
            raise SpecError(
                "--cpus-per-task" if alone else "--tasks-per-node",
                f"{spec.ranks_per_node} ranks x {spec.cpus_per_task or 1} CPUs per node asked "
                f"for; the nodes of partition {part.name} have {part.cpus_per_node} CPUs",
            )
    if (
        resolved is not None
        and spec.gpus_per_node == 0
        and spec.mem is None
        and part.mem_mb_per_node
    ):
        where = f"a node of partition {part.name} has {{}} (RealMemory)"
        check_memory(resolved, spec.ranks_per_node, part.mem_mb_per_node * 2**20, where,
                     "--tasks-per-node")  # fmt: skip
    minutes = slurm_time_minutes(spec.time)
    if part.max_minutes is not None and minutes > part.max_minutes:
        raise SpecError(
            "--time",
            f"{spec.time} is longer than the time limit of partition {part.name} "
            f"({part.max_minutes} minutes)",
        )


def check_allocation(spec: SubmitSpec, alloc: Allocation) -> None:
    """SpecError when the job does not fit the allocation (or is not one srun can run)."""
    fix = "or leave the allocation and submit a new job (--executor slurm)"
    if spec.nodes > alloc.nodes:
        raise SpecError(
            "--nodes",
            f"{spec.nodes} nodes asked for; allocation {alloc.job_id} "
            f"has {alloc.nodes}: use --nodes {alloc.nodes} or fewer, {fix}",
        )
    if alloc.gpus_per_node is not None and spec.gpus_per_node > alloc.gpus_per_node:
        raise SpecError(
            "--gpus-per-node",
            f"{spec.gpus_per_node} asked for; allocation "
            f"{alloc.job_id} has {alloc.gpus_per_node} per node, {fix}",
        )
    for flag, given in (
        ("--sweep", spec.sweep),
        ("--chain", spec.chain > 1),
        ("--after", spec.after),
    ):
        if given:
            raise SpecError(
                flag,
                f"queues new jobs; inside allocation {alloc.job_id} the "
                "ranks run at once: drop it, or use --executor slurm",
            )


def check_places(
    train: TrainSpec, existing_only: bool = False, experiment: str | None = None
) -> None:
    """Where the run will be written can be written (nothing is created): the run directory,
    or the experiment's folder under the log root (`experiment`; a team's log root may hold
    one that another member made). `existing_only` (a dry run, a template, maybe for another
    machine): only what exists here is checked."""
    if train.run_dir:
        check_run_dir("--run-dir", train.run_dir, existing_only)
    else:
        folder = str(Path(train.log_root) / experiment) if experiment else train.log_root
        check_log_root("--log-root", train.log_root, existing_only)
        check_log_root("--log-root", folder, existing_only)


def continue_target(
    resolved: ResolvedSpec,
    world: tuple[int | None, str] = (None, "--num-procs"),
    say: Callable[[str], None] = lambda line: None,
    launcher: bool = True,
) -> ResolvedSpec:
    """`resolved` with the run directory --resume continues filled in, after checking that an
    existing run directory (--run-dir or --resume) holds a run of the same task, (`launcher`:
    not a rank, whose rank 0 may hold it already) that no other training writes it now and,
    when it has a checkpoint, that this start keeps what its saved environments fit (`world`:
    the number of ranks, when the launcher knows it, and the flag that sets it). The settings
    it changes are said through `say`."""
    train = resolved.train
    run_dir = Path(train.run_dir) if train.run_dir else None
    if run_dir is None and train.resume:
        try:
            run_dir = latest_run(train.log_root, resolved.experiment_name)
        except DamagedRecord as exc:
            raise SpecError("--resume", str(exc)) from None
        if run_dir is None:
            raise SpecError(
                "--resume",
                f"no earlier run of {resolved.experiment_name} under {train.log_root} to "
                "continue; drop --resume to start one, or name it with --run-dir",
            )
    if run_dir is None:
        return resolved
    if train.resume and not is_run_dir(run_dir):
        what = "does not exist" if not run_dir.exists() else "holds no run"
        raise SpecError(
            "--resume",
            f"{run_dir} {what}: nothing to continue. Drop --resume to start a new run there, "
            "or name the run to continue",
        )
    # The ranks check again (and load); refusing here starts no process at all.
    flag = "--run-dir" if train.run_dir else "--resume"
    if launcher:
        check_run_dir(flag, str(run_dir))
    if launcher and (busy := busy_problem(RunDir(run_dir))) is not None:
        raise SpecError(flag, busy)
    checkpoints = Checkpoints(run_dir, resolved.task)
    refusal = cannot_continue(checkpoints, resolved.task, train.restart_from_scratch, flag)
    if refusal is not None:
        raise refusal
    if launcher:
        try:
            read_record(run_dir, strict=True)
        except DamagedRecord as exc:
            say(f"{exc.path} is damaged ({exc.problem}): this start keeps it as "
                f"{RUN_RECORD}.damaged-<time> and begins a new record")  # fmt: skip
    valid, _ = checkpoints.newest_valid()  # verified above: no second read
    if valid is not None and not train.restart_from_scratch:
        done = checkpoint_iteration(valid) or 0
        if resolved.max_iterations < done:
            raise SpecError(
                "--max-iterations",
                f"{resolved.max_iterations}, but {run_dir} has done {done} iterations: give "
                f"at least {done} (or drop it to keep the run's own)",
            )
    if list_checkpoints(run_dir):
        _check_continuation(run_dir, resolved, world, say)
    return resolved.replace_train(run_dir=str(run_dir))


def _check_continuation(
    run_dir: Path, resolved: ResolvedSpec, world: tuple[int | None, str], say: Callable[[str], None]
) -> None:  # fmt: skip
    """Refuse a change of what the run's saved environments fit (unless --fresh-envs); say
    every change of the run's settings (docs/preemption.md, "What a continuation may
    change")."""
    record = read_record(run_dir)
    before = record.get("spec") or {}
    if not before:
        return
    train = resolved.train
    kept = []  # (flag, the run's, this start's)
    num_envs = (record.get("effective") or {}).get("num_envs")
    if num_envs not in (None, resolved.num_envs):
        kept.append(("--num-envs", num_envs, resolved.num_envs))
    for key in KEPT_ON_CONTINUATION:
        if key != "num_envs" and before.get(key, getattr(train, key)) != getattr(train, key):
            kept.append((f"--{key.replace('_', '-')}", before[key], getattr(train, key)))
    size, flag = world
    # A size the healer changed to or from (--min-nodes) goes on with what the ranks saved.
    resized = size is not None and resized_by_healer(record, size)
    if size is not None and record.get("world_size") not in (None, size) and not resized:
        kept.append((flag, f"{record['world_size']} rank(s)", f"{size} rank(s)"))
    installed = versions()
    for name in SIMULATOR_PACKAGES[resolved.source]:
        theirs = (record.get("versions") or {}).get(name)
        if theirs is not None and theirs != installed.get(name):
            kept.append(("--fresh-envs", f"{name} {theirs}", f"{name} {installed.get(name)}"))
    motion = (record.get("effective") or {}).get("motion_file")
    if motion != resolved.motion_file:
        kept.append(("--registry-name", f"motion {motion}", f"motion {resolved.motion_file}"))
    if resolved.source == "mjlab":
        change = _env_config_change(resolved.task, before.get("overrides", ()), train.overrides)
        if change is not None:
            kept.append(change)
    if kept and not train.fresh_envs:
        flag, theirs, ours = kept[0]
        raise SpecError(
            flag,
            f"{run_dir} was trained with {theirs}; this command asks for {ours}. A "
            "continuation restores the run's saved environments, which fit only the run's "
            "value: give it, or pass --fresh-envs to continue with new environments (models, "
            "optimizer and iteration kept; not exact). Nothing was changed or started",
        )
    changes = {flag: f"{flag} {a} -> {b}" for flag, a, b in kept}
    for key, (a, b) in changed_settings(before, train.to_dict()).items():
        if key == "overrides":  # each --env.* / --agent.* setting that changed
            old, new = override_values(a), override_values(b)
            for flag in dict.fromkeys([*old, *new]):
                if old.get(flag) != new.get(flag):
                    changes.setdefault(flag, f"{flag} {old.get(flag, '(unset)')} -> "
                                       f"{new.get(flag, '(unset)')}")  # fmt: skip
            continue
        flag = f"--{key.replace('_', '-')}"
        changes.setdefault(flag, f"{flag} {a} -> {b}")
    if changes:
        fresh = " with new environments (--fresh-envs)" if kept else ""
        say(f"continuing {run_dir}{fresh}: {'; '.join(changes.values())}")


def _env_config_change(
    task: str, before: Sequence[str], now: Sequence[str]
) -> tuple[str, str, str] | None:
    """The first env config field that two lists of overrides set differently (the number of
    environments aside): (--env flag, value with `before`, value with `now`); None: none."""
    cfgs = [configured_cfgs(task, 1, None, overrides)[0] for overrides in (before, now)]
    for cfg in cfgs:
        cfg.scene.num_envs = 1
    return _first_difference(*(dataclasses.asdict(c) for c in cfgs), "--env")


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, str, str] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}".replace("_", "-"))
            if found:
                return found
        return None
    return None if a == b else (path, repr(a), repr(b))


def check_after_exists(spec: SubmitSpec) -> None:
    """A --after job Slurm does not know would leave ours pending for ever."""
    if not spec.after:
        return
    known, _ = SlurmClient(timeout_s=10).query(spec.after)
    missing = [j for j in spec.after if j not in known]
    if missing:
        raise SpecError("--after", f"Slurm knows no job {', '.join(missing)} (squeue, sacct)")


def check_array_size(count: int) -> None:
    """A sweep of `count` elements larger than the cluster's job arrays (MaxArraySize) is
    refused by sbatch with "Invalid job array specification": say why, before anything is
    made."""
    if not count:
        return
    limit = (SlurmClient(timeout_s=10).config() or {}).get("MaxArraySize", "")
    # Indexes 0 .. MaxArraySize - 1: MaxArraySize elements.
    if limit.isdigit() and count > int(limit):
        raise SpecError(
            "--sweep",
            f"{count} elements; this cluster's job arrays hold at most {limit} "
            "(MaxArraySize): split the sweep into several submissions",
        )

"""Checks against what exists, before anything is created, submitted or started.

The log root and run directory can be written, this machine has the cores, GPUs and memory
that local ranks ask for, and the Slurm cluster can take the job: its partition, allocation,
job arrays and the jobs it waits for.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.procs import memory_room, user_name
from mjlab_hpc.rank.context import Allocation, cuda_device_count
from mjlab_hpc.rank.kernel_cache import AUTO, NODE, folder_problem
from mjlab_hpc.rundir.durable import ownership
from mjlab_hpc.rundir.layout import is_run_dir
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.slurm.units import mem_bytes, slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS
from mjlab_hpc.tasks.memory import device_memory, world_bytes

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
    "usable_cores",
]


def check_log_root(flag: str, log_root: str, existing_only: bool = False) -> Path:
    """Return the log root, or raise SpecError when runs cannot be written there.

    Runs cannot be written where it is a file, or where the folder (or the nearest one that
    exists) is read-only or not writable. With `existing_only`, a log root that does not
    exist here is not checked (a dry run for another machine).
    """
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
    """Return `run_dir`, or raise SpecError when it is a file or a folder of other files.

    Training into a folder of other files would mix them with the run's.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise SpecError(flag, f"{run_dir} is a file, not a run directory")
    if path.is_dir() and any(path.iterdir()) and not is_run_dir(path):
        raise SpecError(
            flag,
            f"{run_dir} holds files but no run (no run.json, progress.jsonl, logs/, ...); give "
            "a run directory, or a new or empty folder",
        )
    check_log_root(flag, str(path), existing_only=existing_only)
    return path


def usable_cores() -> int:
    """Count the cores this process may run on (its CPU affinity, e.g. a Slurm allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_local_cpus(flag: str, ranks: int, oversubscribe: bool) -> None:
    """Refuse more CPU ranks than this machine has cores, unless --oversubscribe says to.

    Each rank steps its physics on one core.
    """
    cores = usable_cores()
    if ranks > cores and not oversubscribe:
        raise SpecError(
            flag,
            f"{ranks} ranks on a machine with {cores} usable cores (each rank runs its physics "
            f"on one core); use at most {cores}, or --oversubscribe to run them anyway",
        )


def check_local_gpus(flag: str, wanted: int, count: Callable[[], int] = cuda_device_count) -> None:
    """Refuse local ranks that ask for more GPUs than this machine shows.

    `flag` is --gpus-per-node or --device, each answered with its own fix.
    """
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
    resolved: ResolvedSpec,
    ranks: int,
    room: int,
    where: str,
    ranks_flag: str,
    mem_flag: str | None = None,
) -> None:
    """Refuse `ranks` ranks of the request that cannot fit in `room` bytes.

    Only what MuJoCo Warp's worlds take is counted. `where` says what gives the room, for
    people, with `{}` for its size. A built-in task's bound on its per-world bytes settles
    most requests without loading Warp.
    """
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
        flag = mem_flag
        fix = f"raise {mem_flag} to at least {-(-need // 2**20)}M, or use at most {cut}"
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
    """Refuse local ranks of `mjlab-train` that do not fit this machine's memory or GPUs'.

    CPU ranks share the machine's memory; a GPU rank has its GPU's.
    """
    spec = resolved.train
    gpus = spec.gpu_ids
    if spec.num_procs == 1 and (gpus not in ("auto", None) or spec.device == "cuda"):
        ids = range(cuda_device_count()) if gpus == "all" else (0,) if gpus == "auto" else gpus
        # An id beyond the GPUs there are is refused later, by name (--gpu-ids).
        for i in [i for i in ids or () if i < cuda_device_count()]:
            check_memory(
                resolved,
                ranks=1,
                room=device_memory(i),
                where=f"GPU {i} has {{}}",
                ranks_flag="--gpu-ids",
            )
        return
    room, why = memory_room()
    check_memory(
        resolved,
        ranks=spec.num_procs,
        room=room,
        where=f"this machine has {{}} {why}",
        ranks_flag="--num-procs",
    )


def check_submit_memory(spec: SubmitSpec, resolved: ResolvedSpec, executor: str) -> None:
    """Refuse CPU ranks of a job that do not fit a node.

    The node's memory is --mem, or this machine's for the local executor (a partition's
    RealMemory is checked in `check_partition`). GPU ranks keep their worlds on the GPUs,
    whose memory is known only on the nodes.
    """
    if spec.gpus_per_node > 0 or spec.sweep:
        return
    if spec.mem is not None:
        check_memory(
            resolved,
            ranks=spec.ranks_per_node,
            room=mem_bytes(spec.mem),
            where=f"--mem {spec.mem} gives a node {{}}",
            ranks_flag="--tasks-per-node",
            mem_flag="--mem",
        )
    elif executor == "local":
        room, why = memory_room()
        check_memory(
            resolved,
            ranks=spec.ranks_per_node,
            room=room,
            where=f"this machine has {{}} {why}",
            ranks_flag="--tasks-per-node",
        )


def check_partition(
    spec: SubmitSpec,
    warn: Callable[[str], None],
    client: SlurmClient | None = None,
    resolved: ResolvedSpec | None = None,
) -> None:
    """Refuse a job that its partition cannot give what it asks for, as sinfo describes it.

    The partition must have the nodes, GPUs per node, CPUs and time, and for CPU ranks the
    memory their worlds take. Where sinfo cannot tell, a warning says so.
    """
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
        asked = f"{spec.nodes} nodes" + (f" + {spec.spare_nodes} spare" if spec.spare_nodes else "")
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
        check_memory(
            resolved,
            ranks=spec.ranks_per_node,
            room=part.mem_mb_per_node * 2**20,
            where=f"a node of partition {part.name} has {{}} (RealMemory)",
            ranks_flag="--tasks-per-node",
        )
    minutes = slurm_time_minutes(spec.time)
    if part.max_minutes is not None and minutes > part.max_minutes:
        raise SpecError(
            "--time",
            f"{spec.time} is longer than the time limit of partition {part.name} "
            f"({part.max_minutes} minutes)",
        )


def check_allocation(spec: SubmitSpec, alloc: Allocation) -> None:
    """Refuse a job that does not fit the allocation, or that srun cannot run in it."""
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
    """Check that where the run will be written can be written, creating nothing.

    That is the run directory, or the log root and the experiment's folder under it (a
    team's log root may hold one that another member made), and a --kernel-cache folder.
    With `existing_only` (a dry run, a template, maybe for another machine), only what exists
    here is checked.
    """
    if train.run_dir:
        check_run_dir("--run-dir", train.run_dir, existing_only=existing_only)
    else:
        folder = str(Path(train.log_root) / experiment) if experiment else train.log_root
        check_log_root("--log-root", train.log_root, existing_only=existing_only)
        check_log_root("--log-root", folder, existing_only=existing_only)
    if train.kernel_cache not in (AUTO, NODE):
        check_log_root("--kernel-cache", train.kernel_cache, existing_only=existing_only)
        problem = folder_problem(train.kernel_cache)
        if problem is not None:
            raise SpecError(
                "--kernel-cache",
                f"{problem}: the ranks would run code from it; give another folder",
            )


def check_after_exists(spec: SubmitSpec) -> None:
    """Refuse a --after job that Slurm does not know: ours would stay pending for ever."""
    if not spec.after:
        return
    known, _ = SlurmClient(timeout_s=10).query(spec.after)
    missing = [j for j in spec.after if j not in known]
    if missing:
        raise SpecError("--after", f"Slurm knows no job {', '.join(missing)} (squeue, sacct)")


def check_array_size(count: int) -> None:
    """Refuse a sweep of more elements than the cluster's job arrays hold (MaxArraySize).

    sbatch would refuse it with "Invalid job array specification", which does not say why.
    """
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

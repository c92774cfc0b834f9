"""Who this process is in the job, the process group it joins, and its Slurm allocation.

`DistContext.from_env` recognises how the process was launched (an srun task, torchrun or
torchrunx, submitit's local executor, or a plain process) and turns that launcher's variables
into one answer: rank, local rank, world size, node, master address and port. Everything after
it (device, seed, process group, the trainer) reads the context, never the raw variables.
`current_allocation` is the allocation (salloc, an interactive job) a launcher runs in.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from mjlab_hpc.errors import LaunchError

log = logging.getLogger("mjlab_hpc")

__all__ = [
    "ALLOCATION_ENV",
    "CHAIN_ENV",
    "DETACHED_ENV",
    "PORT_BASE",
    "PORT_SPAN",
    "SCRIPT_ENVS",
    "SCRIPT_MARK_ENV",
    "SIGNAL_DELAY_ENV",
    "START_ENV",
    "SUPERVISOR_ENV",
    "Allocation",
    "DistContext",
    "LaunchMode",
    "backend_for",
    "chain_link",
    "collective_timeout",
    "cuda_device_count",
    "current_allocation",
    "derive_master_port",
    "detect_mode",
    "first_host",
    "interactive_step",
    "own_mig",
    "process_group",
    "rank_device",
    "resolve_device",
    "seed_for_rank",
    "set_by_our_script",
    "tasks_on_node",
    "torch_threads",
]


LaunchMode = Literal["single", "torchrun", "slurm", "submitit-local"]

# Variables our own processes pass to the ranks they start (named `_MJLAB_HPC_*`: internal,
# not for users; docs/launching.md lists the variables a user may set).
#: Set by our foreground launchers (`mjlab-train --num-procs`, `mjlab-submit --follow`) for
#: their ranks: comma-separated PIDs whose disappearance stops the ranks.
SUPERVISOR_ENV = "_MJLAB_HPC_SUPERVISOR_PIDS"
#: Set for ranks of a job started in the background (`mjlab-submit --executor local` without
#: --follow): they ignore Ctrl-C and hang-ups of the terminal they were started from.
DETACHED_ENV = "_MJLAB_HPC_DETACHED"
#: Set in the jobs of `mjlab-submit --chain N` to "K/N": job K of N continues the run.
CHAIN_ENV = "_MJLAB_HPC_CHAIN"
#: Set for ranks that `mjlab-submit` started with srun inside an existing allocation (salloc):
#: nothing requeues them (requeueing the allocation would end the user's session).
ALLOCATION_ENV = "_MJLAB_HPC_ALLOCATION"
#: Set by the batch script for each srun step it starts (`<job>.<restart>.<n>`): the ranks
#: name it in their first log line, and the healer finds that step's ranks by it, not by
#: comparing the clocks of the nodes.
START_ENV = "_MJLAB_HPC_START"
#: Set in a job's script to its --signal-delay-s: how long before the time limit the
#: time-limit signal comes (a time limit that leaves no start-up is not requeued).
SIGNAL_DELAY_ENV = "_MJLAB_HPC_SIGNAL_DELAY"
#: Set by our batch scripts to `<job>.<restart>` of the job running them: it says that the
#: script's own variables (SCRIPT_ENVS) are ours, for the commands the script runs (the heal
#: step, `mjlab-hpc run-dir`); anywhere else they are a person's, and dropped.
SCRIPT_MARK_ENV = "_MJLAB_HPC_SCRIPT"
#: The variables our batch scripts set for the commands they run.
SCRIPT_ENVS = (START_ENV, SIGNAL_DELAY_ENV, CHAIN_ENV, SCRIPT_MARK_ENV)


def set_by_our_script(env: Mapping[str, str]) -> bool:
    """True where SCRIPT_ENVS were set by our batch script running in this very job start.

    The mark names the job and its restart: one left exported, or copied from another job's
    environment (or from before a requeue), names another or none.
    """
    job = env.get("SLURM_JOB_ID", "")
    restart = env.get("SLURM_RESTART_COUNT") or "0"
    return bool(job) and env.get(SCRIPT_MARK_ENV) == f"{job}.{restart}"


def chain_link(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(K, N) of a job of a --chain, None outside a chain (or for an unreadable value)."""
    m = re.fullmatch(r"(\d+)/(\d+)", env.get(CHAIN_ENV, "").strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        return None
    return int(m.group(1)), int(m.group(2))


# Below Linux's default ephemeral range (32768-60999), so a derived port does not collide with
# the source port of some outgoing connection, and above the privileged / well-known ports.
PORT_BASE = 15000
PORT_SPAN = 16384
# Odd stride coprime to PORT_SPAN: consecutive job ids get distinct ports, and a restart moves
# the port off the one its previous incarnation may have left in TIME_WAIT.
_PORT_STRIDE = 61

_TORCHRUN_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_REQUIRED = (
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)
_SUBMITIT_REQUIRED = ("SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID", "SUBMITIT_LOCAL_NTASKS")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""

    mode: LaunchMode
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        """Global rank 0: the process that talks to the user."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one rank: a process group is needed."""
        return self.world_size > 1

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous (and rsl_rl, mjlab) read."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size}, node {self.node_rank}/{self.num_nodes}) via {self.mode}, "
            f"master {self.master_addr}:{self.master_port}"
        )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        master_port: int | None = None,
    ) -> DistContext:
        """Build the context from a launcher's environment variables.

        `master_port` is a port the launcher chose (it loses to an explicit MASTER_PORT).
        """
        env = os.environ if env is None else env
        mode = detect_mode(env)
        if mode == "torchrun":
            ctx = _from_torchrun(env)
        elif mode == "slurm":
            ctx = _from_slurm(env, master_port)
        elif mode == "submitit-local":
            ctx = _from_submitit_local(env, master_port)
        else:
            ctx = cls(
                mode="single",
                rank=0,
                local_rank=0,
                world_size=1,
                local_world_size=1,
                node_rank=0,
                num_nodes=1,
                master_addr="127.0.0.1",
                master_port=_explicit_port(env) or master_port or PORT_BASE,
                job_id=env.get("SLURM_JOB_ID"),
                restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
            )
        ctx._check()
        return ctx

    def _check(self) -> None:
        if self.world_size < 1:
            raise LaunchError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"rank {self.rank} is outside the world of {self.world_size} processes "
                f"({self.mode} variables are inconsistent)"
            )
        if not 1 <= self.local_world_size <= self.world_size:
            raise LaunchError(
                f"local world size {self.local_world_size} must be between 1 and the world "
                f"size {self.world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"local rank {self.local_rank} is outside the {self.local_world_size} "
                f"processes of this node ({self.mode} variables are inconsistent)"
            )
        if not 0 <= self.node_rank < self.num_nodes:
            raise LaunchError(f"node rank {self.node_rank} is outside {self.num_nodes} nodes")
        if not 1 <= self.master_port <= 65535:
            raise LaunchError(f"MASTER_PORT {self.master_port} is not a TCP port")


def detect_mode(env: Mapping[str, str]) -> LaunchMode:
    """Tell which launcher started this process; torchrun inside a Slurm step is torchrun."""
    if any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return "torchrun"
    if any(k in env for k in _SUBMITIT_REQUIRED):
        return "submitit-local"
    # Only an srun task is a rank; a batch script or salloc shell has SLURM_JOB_ID but no step.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return "slurm"
    return "single"


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation this process runs in, outside any srun step.

    The process is a salloc shell, an interactive job or a batch script.
    """

    job_id: str
    nodes: int
    gpus_per_node: int | None
    """SLURM_GPUS_ON_NODE where Slurm set it."""


def current_allocation(env: Mapping[str, str]) -> Allocation | None:
    """The allocation of this process, None outside one or inside an srun step (a rank)."""
    job = env.get("SLURM_JOB_ID", "")
    if not job or "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        return None
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    return Allocation(
        job_id=job,
        nodes=int(nodes) if nodes.isdigit() else 1,
        gpus_per_node=int(gpus) if gpus.isdigit() else None,
    )


def interactive_step(env: Mapping[str, str]) -> str | None:
    """Return 'step S of job J' when this process runs in an interactive srun step.

    Such a step (`srun --pty bash`) holds the resources itself. None elsewhere: a salloc
    shell, a batch script, the ranks we start.
    """
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not job or step is None or "SLURM_PTY_PORT" not in env or ALLOCATION_ENV in env:
        return None
    return f"step {step} of job {job}"


def derive_master_port(job_id: str, restart_count: int = 0) -> int:
    """A rendezvous port that every rank of one job computes alike.

    Different for jobs running at the same time (distinct ids, up to PORT_SPAN apart), and
    different after a requeue, so a restarted job does not meet its old port in TIME_WAIT.
    """
    numeric = (
        int(job_id)
        if job_id.isdigit()
        else int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    )
    return PORT_BASE + (numeric * _PORT_STRIDE + restart_count) % PORT_SPAN


def _missing(env: Mapping[str, str], names: tuple[str, ...], mode: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise LaunchError(
            f"incomplete {mode} environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch through {mode} itself, or unset the "
            "partial variables to run as a single process."
        )


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def _explicit_port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def _from_torchrun(env: Mapping[str, str]) -> DistContext:
    _missing(env, _TORCHRUN_REQUIRED, "torchrun")
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
    if local_world < 1:
        raise LaunchError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_world}")
    num_nodes = _int(env, "GROUP_WORLD_SIZE", default=-(-world // local_world))
    return DistContext(
        mode="torchrun",
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", default=rank // local_world),
        num_nodes=num_nodes,
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        job_id=env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int(
            env, "SLURM_RESTART_COUNT", default=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0)
        ),
    )


def tasks_on_node(tasks_per_node: str, node_rank: int) -> int:
    """Tasks on node `node_rank` from Slurm's compressed SLURM_TASKS_PER_NODE (`2(x3),1`)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node_rank >= len(counts):
        raise LaunchError(
            f"SLURM_TASKS_PER_NODE={tasks_per_node!r} lists {len(counts)} nodes, "
            f"but this is node {node_rank}"
        )
    return counts[node_rank]


# One name of a node list: text and brackets of values (`rack[1-2]-node[01,03]`).
_NODE_NAME = re.compile(r"(?:[^\[\],\s]|\[[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\])+")


def first_host(nodelist: str) -> str:
    """Return the first host of a Slurm node list: `gpu[007-010],cpu1` gives `gpu007`.

    It is read without scontrol, which container images often lack: each bracket's first
    value, as written.
    """
    depth, name = 0, ""
    for ch in nodelist:
        depth += (ch == "[") - (ch == "]")
        if depth == 0 and ch in ", \t\n":
            if name:
                break
        else:
            name += ch
    if not _NODE_NAME.fullmatch(name):
        raise LaunchError(f"cannot find the master host in the Slurm node list {nodelist!r}")
    return re.sub(r"\[([0-9]+)[^\]]*\]", r"\1", name)


def _from_slurm(env: Mapping[str, str], master_port: int | None) -> DistContext:
    _missing(env, _SLURM_REQUIRED, "srun")
    # Step variables describe this srun; job variables the whole allocation.
    world = _int(env, "SLURM_STEP_NUM_TASKS", default=_int(env, "SLURM_NTASKS"))
    nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    node_rank = _int(env, "SLURM_NODEID")
    num_nodes = _int(
        env, "SLURM_STEP_NUM_NODES", default=_int(env, "SLURM_JOB_NUM_NODES", default=1)
    )
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = tasks_on_node(per_node, node_rank) if per_node else -(-world // num_nodes)
    job_id = env["SLURM_JOB_ID"]
    restarts = _int(env, "SLURM_RESTART_COUNT", default=0)
    addr = env["MASTER_ADDR"] if env.get("MASTER_ADDR") else first_host(nodelist)
    return DistContext(
        mode="slurm",
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        # Steps of one allocation (salloc) may train at the same time: one port each.
        master_port=_explicit_port(env)
        or master_port
        or derive_master_port(job_id, restarts + 997 * _int(env, "SLURM_STEP_ID", default=0)),
        job_id=job_id,
        restart_count=restarts,
    )


def _from_submitit_local(env: Mapping[str, str], master_port: int | None) -> DistContext:
    _missing(env, _SUBMITIT_REQUIRED, "submitit's local executor")
    world = _int(env, "SUBMITIT_LOCAL_NTASKS")
    job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "0")
    return DistContext(
        mode="submitit-local",
        rank=_int(env, "SUBMITIT_LOCAL_GLOBALID"),
        local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID"),
        world_size=world,
        local_world_size=world,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=_explicit_port(env) or master_port or derive_master_port(job_id),
        job_id=job_id,
        restart_count=0,
    )


def resolve_device(
    choice: str,
    local_rank: int,
    local_world_size: int,
    *,
    cuda_count: int,
    cuda_visible_devices: str | None,
) -> str:
    """The torch/Warp device of one rank.

    With all of a node's GPUs visible, local rank k uses cuda:k. When Slurm gave each task its
    own GPU (CUDA_VISIBLE_DEVICES has one entry, possibly with its real index, e.g. "3"),
    that GPU is cuda:0 inside the task. Pure function: the caller passes what CUDA reports.
    """
    if choice == "cpu":
        return "cpu"
    if choice not in ("auto", "cuda"):
        raise LaunchError(f"--device must be auto, cpu or cuda, got {choice!r}")
    shown = "unset" if cuda_visible_devices is None else repr(cuda_visible_devices)
    if cuda_count == 0:
        if choice == "cuda":
            raise LaunchError(
                f"--device cuda, but no CUDA device is visible (CUDA_VISIBLE_DEVICES={shown}). "
                "Use --device cpu, or ask the scheduler for GPUs (--gpus-per-node)."
            )
        return "cpu"
    entries = [e for e in (cuda_visible_devices or "").split(",") if e.strip()]
    if len(entries) == 1 or (cuda_count == 1 and local_world_size == 1):
        return "cuda:0"
    if local_rank < cuda_count:
        return f"cuda:{local_rank}"
    raise LaunchError(
        f"local rank {local_rank} has no GPU: this task sees {cuda_count} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={shown}) for {local_world_size} ranks on the node. Ask for "
        "as many GPUs per node as tasks per node (--gpus-per-node), or one GPU per task."
    )


def own_mig(cuda_visible_devices: str | None, local_rank: int, local_world_size: int) -> str | None:
    """Return this rank's own MIG instance when CUDA_VISIBLE_DEVICES lists one per local rank.

    CUDA shows a process one MIG instance at most, so local rank 1 would find no cuda:1. The
    caller narrows the variable to the answer before CUDA starts. None otherwise.
    """
    entries = [e.strip() for e in (cuda_visible_devices or "").split(",") if e.strip()]
    if 1 < len(entries) == local_world_size and any(e.startswith("MIG-") for e in entries):
        return entries[local_rank]
    return None


def rank_device(choice: str, ctx: DistContext) -> str:
    """The device this rank trains on, for the device the flags ask for (`device_choice`)."""
    return resolve_device(
        choice,
        ctx.local_rank,
        ctx.local_world_size,
        cuda_count=0 if choice == "cpu" else cuda_device_count(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def cuda_device_count() -> int:
    """CUDA devices torch can see (0 on CPU-only builds)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torch_threads(requested: int, ctx: DistContext, env: Mapping[str, str]) -> int:
    """Intra-op threads per rank: explicit, else Slurm's CPUs per task, else a fair share."""
    if requested > 0:
        return requested
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    return max(1, (os.cpu_count() or 1) // ctx.local_world_size)


def seed_for_rank(base_seed: int, ctx: DistContext) -> int:
    """Global rank offset, so no two ranks on any node share a seed."""
    return base_seed + ctx.rank


def backend_for(device: str) -> str:
    """NCCL on GPUs, gloo on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


@contextmanager
def process_group(ctx: DistContext, device: str, timeout_s: float) -> Iterator[None]:
    """Join the job's process group for the duration of the block, and always leave it.

    A single process gets no process group (rsl_rl then skips every collective).
    """
    if not ctx.is_distributed:
        yield
        return
    import torch
    import torch.distributed as dist

    # env:// rendezvous, because under torchrun the store belongs to the agent and a worker
    # must connect to it as a client (tcp:// would try to bind the agent's port). The
    # variables are put back afterwards: they would make this process look like a torchrun
    # worker to anything that inspects the launcher later.
    saved = {k: os.environ.get(k) for k in ctx.torch_env()}
    os.environ.update(ctx.torch_env())
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend=backend_for(device),
        init_method="env://",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def collective_timeout(timeout_s: float | None) -> None:
    """Set how long a collective of the job's process group may wait (None: for good).

    None while the hang watchdog watches the iterations: it bounds a stuck collective then,
    on time the process ran. Gloo's and NCCL's clocks run on while the process is stopped
    (`scontrol suspend`, STOP), so a collective begun before a suspend longer than the timeout
    failed after the resume. No process group: nothing to set.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    # torch has no public call that changes a formed group's timeout; its own (since 2.2) is
    # private: where it is missing or refuses, the group keeps --dist-timeout-s.
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return
    seconds = _FOREVER_S if timeout_s is None else timeout_s
    try:
        setter(timedelta(seconds=seconds))
    except (RuntimeError, ValueError) as exc:
        log.warning("the collectives' timeout stays as it was: %s", exc)


# "For good" for gloo and NCCL (their timeouts are milliseconds in 64-bit integers).
_FOREVER_S = 365 * 24 * 3600.0

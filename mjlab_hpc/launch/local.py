"""Start the ranks of one job on this machine, through submitit's local executor.

Used by `mjlab-train --num-procs N` (N CPU ranks) and `--gpu-ids 0 1 ...` (one rank per GPU).
The launcher hands the run directory it was given (the realised run target) and a rendezvous
port it picks once to every rank; each rank runs the same `train_rank` as any other launch path.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

import submitit

from mjlab_hpc.errors import EXIT_INTERRUPTED, SpecError
from mjlab_hpc.launch.executors import (
    CONTROLLER_MODULE,
    SUBMITIT_CONTROLLER_MODULE,
    TASK_MODULE,
    LocalJobExecutor,
    task_outcome,
)
from mjlab_hpc.launch.follow import Closing, follow_to_end
from mjlab_hpc.procs import ProcessTree, owner, processes, send_signal, wait_gone
from mjlab_hpc.rank import RankJob
from mjlab_hpc.rank.context import DETACHED_ENV, SUPERVISOR_ENV
from mjlab_hpc.rundir.ends import rank_ends
from mjlab_hpc.rundir.layout import SUBMITIT_DIR
from mjlab_hpc.rundir.running import run_processes
from mjlab_hpc.rundir.snapshot import import_path, snapshot_for
from mjlab_hpc.spec import ResolvedSpec, TrainSpec

__all__ = [
    "LOCAL_TIMEOUT_MIN",
    "LaunchPlan",
    "LocalControls",
    "LocalJob",
    "LocalProcess",
    "free_port",
    "local_processes",
    "physical_gpu_ids",
    "plan_launch",
    "rank_failures",
    "run_local",
    "submit_local",
]

# Local jobs run until they finish; submitit's default (2 minutes) would stop them.
LOCAL_TIMEOUT_MIN = 60 * 24 * 30
# What CUDA takes in CUDA_VISIBLE_DEVICES: an index, a GPU's UUID, a MIG instance's (also in
# its older GPU-uuid/gi/ci form).
_GPU_ENTRY = re.compile(r"\d+|(GPU|MIG)-[\w/.-]+")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def physical_gpu_ids(gpu_ids: Sequence[int], cuda_visible_devices: str | None) -> list[str]:
    """Map ids relative to CUDA_VISIBLE_DEVICES to the entries CUDA takes.

    mjlab's --gpu-ids count that way. The entries are indices, or the UUIDs some sites and MIG
    set there (`GPU-...`, `MIG-...`).
    """
    if cuda_visible_devices is None:
        return [str(i) for i in gpu_ids]
    visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
    out = []
    for i in gpu_ids:
        if i >= len(visible):
            raise SpecError(
                "--gpu-ids",
                f"GPU {i} is not visible: CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
                f"shows {len(visible)} GPU(s); ids count from 0 within that list",
            )
        if not _GPU_ENTRY.fullmatch(visible[i]):
            raise SpecError(
                "--gpu-ids",
                f"CUDA_VISIBLE_DEVICES entry {visible[i]!r} names no GPU (an index, GPU-<uuid> "
                "or MIG-<uuid>); set CUDA_VISIBLE_DEVICES to the GPUs to use",
            )
        out.append(visible[i])
    return out


@dataclass(frozen=True)
class LaunchPlan:
    """How `mjlab-train` runs a spec: in this process, or as several local ranks."""

    ranks: int = 1
    gpus: tuple[str, ...] = ()
    """GPUs given to the local ranks, as CUDA_VISIBLE_DEVICES entries (empty: CPU)."""
    single_gpu: str | None = None
    """The one GPU an in-process run uses, as a CUDA_VISIBLE_DEVICES entry."""

    @property
    def in_process(self) -> bool:
        return self.ranks == 1


def plan_launch(
    spec: TrainSpec, launched_by: str, cuda_count: Callable[[], int], cuda_visible: str | None
) -> LaunchPlan:
    """Decide how to run `spec`; `cuda_count` is asked only when GPUs are requested."""
    wants_many = spec.num_procs > 1 or (isinstance(spec.gpu_ids, tuple) and len(spec.gpu_ids) > 1)
    if launched_by != "single" and wants_many:
        flag = "--num-procs" if spec.num_procs > 1 else "--gpu-ids"
        raise SpecError(
            flag,
            f"this process is already one rank of a {launched_by} launch; "
            "let that launcher start the ranks and drop the flag",
        )
    if spec.num_procs > 1:
        return LaunchPlan(ranks=spec.num_procs)
    ids = spec.gpu_ids
    if ids in ("auto", None):
        return LaunchPlan()
    count = cuda_count()
    if count == 0:
        raise SpecError(
            "--gpu-ids",
            f"{'all' if ids == 'all' else list(ids)} asked for GPUs, but no CUDA device is "
            "visible; use --gpu-ids None (CPU) or --num-procs N for CPU ranks",
        )
    rel = tuple(range(count)) if ids == "all" else ids
    assert isinstance(rel, tuple)
    if max(rel) >= count:
        raise SpecError(
            "--gpu-ids",
            f"GPU {max(rel)} asked for, but this machine shows {count} GPU(s) (ids count from "
            "0); use --gpu-ids 0 .. " + str(count - 1),
        )
    phys = tuple(physical_gpu_ids(rel, cuda_visible))
    if len(phys) == 1:
        return LaunchPlan(single_gpu=phys[0])
    return LaunchPlan(ranks=len(phys), gpus=phys)


@dataclass(frozen=True)
class LocalJob:
    """A submitted local job and where its files are."""

    job: submitit.Job
    run_dir: Path
    ranks: int

    def rank_stdout(self, rank: int) -> Path:
        return Path(self.job.task(rank).paths.stdout)


@contextlib.contextmanager
def _controller_environment(foreground: bool, pythonpath: str | None = None) -> Iterator[None]:
    """Set what submitit's local controller, and the ranks it starts, inherit from here.

    The controller copies os.environ and the signal dispositions. It ignores Ctrl-C and a
    hang-up: a terminal's Ctrl-C reaches every process of the foreground group, and the
    controller would kill the ranks 1 s later, before their checkpoint. The ranks learn
    whether a launcher in the foreground supervises them (it forwards stops; its death stops
    them) or whether they run in the background (terminal signals do not concern them). They
    import the code snapshot first (`pythonpath`).
    """
    names = (SUPERVISOR_ENV, DETACHED_ENV, "PYTHONPATH", "PYTHONSAFEPATH")
    saved_env = {k: os.environ.get(k) for k in names}
    if pythonpath is not None:  # ahead of what is there; `python -m` puts the cwd first else
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = pythonpath + (os.pathsep + before if before else "")
        os.environ["PYTHONSAFEPATH"] = "1"
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP)}
    if foreground:
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
        os.environ.pop(DETACHED_ENV, None)
    else:
        os.environ.pop(SUPERVISOR_ENV, None)
        os.environ[DETACHED_ENV] = "1"
    try:
        for sig in saved:
            signal.signal(sig, signal.SIG_IGN)
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def submit_local(
    spec: ResolvedSpec,
    ranks: int,
    gpus: Sequence[str] = (),
    timeout_min: float = LOCAL_TIMEOUT_MIN,
    signal_delay_s: int = 90,
    foreground: bool = True,
) -> LocalJob:
    """Submit `ranks` processes of `train_rank(spec)` on this machine and return at once.

    Like Slurm, submitit's local executor sends the time-limit signal `signal_delay_s` before
    `timeout_min`, and restarts the ranks when they exit for a requeue; after a crash or a hang
    our controller heals the job (`mjlab_hpc.launch.executors`). `foreground`: this
    process stays and supervises the job (its death stops the ranks); else the job runs in
    the background, untouched by this terminal's signals.
    """
    if spec.target.path is None:
        raise ValueError("submit_local needs a realised run target (rundir.layout.realise_target)")
    run_dir = Path(spec.target.path)
    executor = LocalJobExecutor(
        folder=run_dir / SUBMITIT_DIR, max_restarts=spec.train.max_restarts, gpus=tuple(gpus)
    )
    executor.update_parameters(
        tasks_per_node=ranks, timeout_min=timeout_min, signal_delay_s=signal_delay_s
    )
    code = snapshot_for(run_dir)
    with _controller_environment(foreground, import_path(code) if code else None):
        job = executor.submit(RankJob(spec, free_port()))
    return LocalJob(job=job, run_dir=run_dir, ranks=ranks)


@dataclass(frozen=True)
class LocalProcess:
    """A process of this machine that works for a run's submitit folder."""

    pid: int
    role: Literal["controller", "rank", "launcher"]
    """controller: the local executor's controller; rank: a Python process running a task;
    launcher: anything else naming the folder (srun, the shell that runs a local job's setup
    lines before its controller)."""


def local_processes(run_dir: Path) -> list[LocalProcess]:
    """This user's live processes of this machine whose command lines name the run's submitit
    folder.

    For seeing that none is left (the tests); what the launcher waits on and signals are the
    processes it started and those the run recorded (`LocalControls.live`).
    """
    folders = {str(run_dir.absolute() / SUBMITIT_DIR), str((run_dir / SUBMITIT_DIR).resolve())}
    quoted = [re.compile(re.escape(shlex.quote(f)) + r"(?=$|\s)") for f in folders]

    def works_for_run(argv: tuple[str, ...]) -> bool:
        # A job with setup lines runs its controller under `sh -c "<setup> && python ..."`.
        return any(a in folders for a in argv) or any(p.search(a) for p in quoted for a in argv[1:])

    found = []
    for entry in processes(works_for_run):
        if owner(entry.pid) != os.getuid():  # another user's, whatever it names
            continue
        role: Literal["controller", "rank", "launcher"] = "launcher"
        if SUBMITIT_CONTROLLER_MODULE in entry.argv or CONTROLLER_MODULE in entry.argv:
            role = "controller"
        elif TASK_MODULE in entry.argv and Path(entry.argv[0]).name.startswith("python"):
            role = "rank"
        found.append(LocalProcess(entry.pid, role))
    return found


class LocalControls:
    """How a launcher in the foreground stops the local job it follows.

    `controller`: the local executor's controller (its pid is the job id), a child of this
    process; `run_dir`: the run.
    """

    def __init__(self, controller: int, run_dir: Path) -> None:
        self.controller = controller
        self.run_dir = run_dir
        self._tree = ProcessTree(controller)

    def live(self) -> list[int]:
        """The job's live processes: those the controller started (seen from this process,
        whose child it is: no heartbeat needed, e.g. while kernels compile) and those the run
        recorded; never another user's that merely names the run."""
        recorded = [p.pid for p in run_processes(self.run_dir)]
        return sorted({*self._tree.live(), *recorded} - {self.controller})

    def stop(self) -> None:
        """Stop the job at the next iteration boundary, with a checkpoint.

        submitit's controller forwards SIGTERM to the ranks, which stop for good (no requeue).
        """
        send_signal(self.controller, signal.SIGTERM)

    def kill(self, grace_s: float = 3.0) -> None:
        """Stop the job at once.

        The controller goes first (nothing restarts the ranks then); ranks that were
        interrupted twice get `grace_s` to record it in run.json, then SIGKILL.
        """
        ranks = self.live()  # while the controller lives: its children are found by it
        send_signal(self.controller, signal.SIGKILL)
        # Never by their command lines: a teammate's process may name the run's folder.
        ranks = sorted({*ranks, *self.live()})
        for pid in ranks:
            send_signal(pid, signal.SIGINT)
        for pid in wait_gone(ranks, grace_s):
            send_signal(pid, signal.SIGKILL)
        for pid in self.live():  # anything started meanwhile
            send_signal(pid, signal.SIGKILL)


def rank_failures(job: submitit.Job, ranks: int, run_dir: Path | None = None) -> list[str]:
    """A line for each rank that failed or died without a result (its result read as data).

    What ended a failed rank is its own end record's line, when it wrote one in `run_dir`
    (the rank decided it from the exception's type); else the last line of the traceback
    submitit kept, as it is (for people: nothing is decided from it).
    """
    ends = {e.rank: e for e in rank_ends(run_dir)} if run_dir is not None else {}
    failures: list[str] = []
    for k in range(ranks):
        task = job.task(k)
        outcome = task_outcome(task)
        if outcome is None:
            failures.append(
                f"rank {k} died without a result (killed, e.g. SIGKILL or out of memory); "
                f"its output: {task.paths.stderr}"
            )
        elif outcome[0] == "error":
            end = ends.get(k)
            lines = [line for line in str(outcome[1]).splitlines() if line.strip()]
            said = end.detail if end is not None and end.how == "failed" else None
            said = said or (lines[-1].strip() if lines else "see its output")
            failures.append(f"rank {k} failed: {said}; its output: {task.paths.stderr}")
    return failures


def run_local(
    spec: ResolvedSpec,
    ranks: int,
    gpus: Sequence[str] = (),
    resume: str = "the same command with --resume",
    out: TextIO | None = None,
) -> Closing:
    """Run a local multi-rank job in the foreground to its end; return its closing line.

    Rank 0's progress goes to `out`. This process's stop signals are forwarded: the first
    stops the job with a checkpoint at the next iteration boundary, the second at once.
    """
    local = submit_local(spec, ranks, gpus, foreground=True)
    controls = LocalControls(int(local.job.job_id), local.run_dir)

    def done() -> bool:
        # The controller may be gone (killed) while its ranks still save their checkpoint.
        return not controls.live() and local.job.done()

    ended, fg = follow_to_end(
        local.run_dir,
        spec.max_iterations,
        stop=controls.stop,
        kill=controls.kill,
        done=done,
        resume=resume,
        failures=lambda: rank_failures(local.job, ranks, local.run_dir),
        out=out,
        num_envs=spec.num_envs,
    )
    if fg.killed:
        left = wait_gone(controls.live(), 10)
        note = "" if not left else f" (still alive: {left})"
        return Closing(
            EXIT_INTERRUPTED,
            f"stopped at once: nothing saved since the last checkpoint{note}; "
            f"resume with: {resume}",
        )
    return ended

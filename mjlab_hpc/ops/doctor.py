"""`mjlab-hpc doctor`: check on the cluster itself that a job as asked would run there.

The request is mjlab-submit's flags. Checks that need the compute nodes run two short probe
jobs through submitit, as real jobs run. `_shape_probe` runs on every task of a job of the
job's shape (nodes, tasks, GPUs, partition, account, qos, setup lines); the tasks leave notes
for each other in the log root and return their Python, imports, GPUs and (--video) a test
render. `_RequeueProbe` is one task that waits for the time-limit signal, is checkpointed and
requeued by submitit, and says so when it runs again. `shape_checks` turns the tasks' results
into checks. The probe jobs are cancelled and their folder removed when the doctor ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.executors import task_outcome
from mjlab_hpc.launch.plan import SubmitPlan
from mjlab_hpc.launch.slurm import container_python, slurm_parameters
from mjlab_hpc.ops.limits import limit_checks, partition_grace_s
from mjlab_hpc.slurm.client import FINAL_STATES, Association, Partition, SlurmClient
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import SubmitSpec
from mjlab_hpc.tasks.video import rendering_problem
from mjlab_hpc.validate.world import check_log_root, check_partition

__all__ = ["PROBE_DIR", "Check", "DoctorReport", "cluster_profile", "diagnose", "shape_checks"]

# The probe jobs' folder under the log root (hidden: run listings skip it).
PROBE_DIR = ".doctor"

Result = Literal["ok", "warn", "fail", "skip"]
# What a task of a probe job left: its result, the last line of its error, or nothing.
Outcome = dict[str, Any] | str | None

_COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo", "scancel")
_TOKEN = "token"  # this host writes it into the probe folder; every task reads it
_NOTES_WAIT_S = 30.0  # how long a task waits for the other tasks' notes
# The requeue probe's --signal delay before its 1-minute limit. slurmctld checks limits every
# 30 s and signals at the first check within delay + 30 s of the limit: 20 s signals 10-40 s
# after the start, once the task runs (a signal before the step starts is lost; 55 s signalled
# at the first check, 0-30 s in) and 20 s before the limit, time to requeue.
_SIGNAL_DELAY_S = 20
_FIXES = {
    "slurm": "run on the cluster's login node, or load its Slurm module (module load slurm); on "
    "a machine without Slurm use mjlab-submit --executor local",
    "controller": "check that slurmctld is reachable from here (sinfo) and SLURM_CONF",
    "request": "change the flag Slurm names (account, qos, partition, time, resources)",
    "busy": "the cluster is busy or the request cannot start: try --wait-s longer, or another "
    "partition",
    "root": "give --log-root a shared filesystem that the nodes mount at the same path (not /tmp "
    "or node-local /scratch); ask your admins which one",
    "mount": "give --log-root a filesystem every node mounts at the same path",
    "realpath": "fine as long as the path resolves the same way on every node",
    "env": "install the same environment on the nodes at the same path (a shared filesystem), or "
    "activate it with --setup",
    "interpreter": "use the same interpreter on the nodes (--setup to activate it)",
    "cuda": "install torch's CUDA build on the nodes (make install GPU=1), or ask your admins "
    "about the partition's GPU gres",
    "gres": "ask for what the partition's nodes have (scontrol show partition; sinfo -o '%P %G'), "
    "or ask your admins why Slurm hides GPUs (gres.conf, cgroups)",
    "signal": "runs cannot checkpoint at the time limit: ask your admins why --signal is not "
    "delivered; use --save-every-min to bound lost work",
    "requeue": "runs cannot continue after the time limit by themselves here: use mjlab-submit "
    "--chain N (one job after another)",
    "accounting": "status then reads states from squeue and run records; ended jobs show their "
    "recorded state",
    "render": "install EGL on the nodes (libegl1 libegl-mesa0 libgl1-mesa-dri), or drop --video",
}


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    """What was checked."""
    result: Result
    detail: str
    """What was found."""
    fix: str = ""
    """What to do when it is not ok."""


@dataclass
class DoctorReport:
    """Every check, in the order they ran."""

    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, result: Result, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name, result, detail, fix))

    @property
    def ok(self) -> bool:
        """Whether a job as asked would run: no check failed."""
        return all(c.result != "fail" for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks]}


# What the probe jobs run on the nodes.


def _try_import(name: str) -> dict[str, Any]:
    """Import a module: its package's version, or the error's last line."""
    try:
        __import__(name)
    except BaseException as exc:  # a broken install raises anything, SystemExit included
        return {"ok": False, "error": traceback.format_exception_only(exc)[-1].strip()[:500]}
    return {"ok": True, "version": getattr(sys.modules[name.split(".")[0]], "__version__", "")}


def _shape_probe(folder: str, ranks: int, mjlab: bool, video: bool = False) -> dict[str, Any]:
    """Report what one task of the shape probe finds; never raises.

    That is its node, Python, imports and GPUs, why a test render fails (`video`; "": it
    works), this host's token in `folder`, and how many of the `ranks` tasks' notes it saw.
    """
    probe_dir = Path(folder)
    rank = int(os.environ.get("SLURM_PROCID", "0") or 0)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    with contextlib.suppress(OSError):  # a note not written counts as one not seen
        (probe_dir / f"note-{rank}").write_text(node)
    token_file = probe_dir / _TOKEN
    token = token_file.read_text().strip() if token_file.is_file() else None
    version = ".".join(map(str, sys.version_info[:3]))
    info: dict[str, Any] = {"rank": rank, "node": node, "python": sys.executable}
    info |= {"python_version": version, "token": token, "folder": os.path.realpath(probe_dir)}
    info["mjlab_hpc"] = _try_import("mjlab_hpc.rank.train")  # torch, warp, rsl-rl, our ranks
    names = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")
    gpus = info["gpus"] = {name: os.environ.get(name) for name in names}
    try:  # the GPUs torch can use
        import torch  # on the nodes only: the doctor's command starts without torch

        gpus["torch_cuda"] = torch.version.cuda
        gpus["torch_devices"] = torch.cuda.device_count() if torch.version.cuda else 0
    except BaseException as exc:
        gpus["torch_error"] = str(exc)[:300]
    if mjlab:
        info["mjlab"] = _try_import("mjlab.tasks")
    if video and os.environ.get("SLURM_LOCALID", "0") == "0":
        info["render"] = rendering_problem() or ""
    # After the imports the others' notes are there, where this node can see them.
    deadline = time.monotonic() + _NOTES_WAIT_S
    while len(notes := list(probe_dir.glob("note-*"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.5)
    return {**info, "seen": len(notes)}


class _RequeueProbe(Checkpointable):
    """The requeue probe: a job that waits for the time-limit signal and then runs again.

    Its first run waits for the signal, on which submitit calls `checkpoint` and requeues the
    job; the next run returns at once.
    """

    signalled = False  # True in the copy that submitit checkpoints, and so in the next run

    def __call__(self) -> dict[str, Any]:
        # Python started with the signal blocked (see diagnose): one that came before
        # submitit set its handler is taken now, and a later one by this thread only, which
        # ends the sleep (one taken by a library's thread would wait for the sleep's end).
        sig = signal.Signals[f"SIG{os.environ['SUBMITIT_PREEMPT_SIGNAL']}"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        if not self.signalled:
            time.sleep(240)  # past the time limit: no signal came
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        return {"requeued": self.signalled, "restarts": restarts}

    def checkpoint(self) -> DelayedSubmission:
        self.signalled = True
        return DelayedSubmission(self)


# On this host: what the shape probe's tasks left.


def _said(text: str) -> str:
    """Return what a failed task said: the last error line of its traceback or output.

    srun's and submitit's own lines are left out; without an error line, its last line.
    """
    skip = ("srun:", "submitit ", "-", "You can check", "Job (task=")
    lines = [s for line in text.splitlines() if (s := line.strip()) and not s.startswith(skip)]
    errors = [line for line in lines if re.search(r"error|exception", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


def _shared(folder: Path, token: str, outcomes: Sequence[Outcome], nodes: str) -> Check:
    """Whether this host and every node read each other's writes in the log root."""
    ran = [t for t in outcomes if isinstance(t, dict)]
    if all(t is None for t in outcomes):
        detail = f"no task's result or log reached {folder.parent.parent} as this host sees it"
        detail += f": the nodes ({nodes}) see a different folder there"
        return Check("log root shared", "fail", detail, _FIXES["root"])
    n = len(ran)
    problems = [f"task {t['rank']} saw {t['seen']} of {n} notes" for t in ran if t["seen"] < n]
    if blind := sorted({t["node"] for t in ran if t["token"] != token}):
        problems.insert(0, f"nodes that do not see this host's writes: {', '.join(blind)}")
    if silent := [r for r, t in enumerate(outcomes) if t is None]:
        problems.insert(0, f"tasks whose writes this host does not see: {silent[:8]}")
    if problems:
        return Check("log root shared", "fail", "; ".join(problems), _FIXES["mount"])
    if not ran:
        return Check("log root shared", "warn", "the tasks' logs reached this host; none ran")
    hosts = len({t["node"] for t in ran})
    seen = f"{len(ran)} task(s) on {hosts} node(s) and this host read each other's writes"
    # The writes went through, so the same path works everywhere; a different real path (a
    # symbolic link on one side, an automounter) is worth knowing, not a failure.
    if other := sorted({t["folder"] for t in ran} - {real := str(folder.resolve())}):
        detail = f"{seen}; its real path is {other[0]} on a node, {real} here"
        return Check("log root shared", "warn", detail, _FIXES["realpath"])
    return Check("log root shared", "ok", seen)


def _python(outcomes: Sequence[Outcome], mjlab: bool) -> list[Check]:
    """The nodes' Python, mjlab_hpc (and mjlab) against this host's."""
    ran = [t for t in outcomes if isinstance(t, dict)]
    failed = {r: t for r, t in enumerate(outcomes) if isinstance(t, str)}
    python, ours = ".".join(map(str, sys.version_info[:3])), _try_import("mjlab_hpc")["version"]
    if failed:
        said = f"could not run {sys.executable}: {next(iter(failed.values()))}"
        said = f"tasks {sorted(failed)[:8]} {said}"
        out = [Check("Python on nodes", "fail", said, _FIXES["env"])]
    elif others := sorted({t["python_version"] for t in ran} - {python}):
        detail = f"Python {others} there, {python} here"
        out = [Check("Python on nodes", "fail", detail, _FIXES["interpreter"])]
    else:
        out = [Check("Python on nodes", "ok", f"{sys.executable} ({python}) on every task")]
    for name in ("mjlab_hpc", "mjlab")[: 1 + mjlab] if ran else ():
        bad = [(t["rank"], t[name]["error"]) for t in ran if not t[name]["ok"]]
        versions = {t[name].get("version") for t in ran} - {ours}
        found = sorted(versions) if name == "mjlab_hpc" else []  # only ours must match
        if bad:
            package = "'mjlab-hpc[mjlab]'" if name == "mjlab" else "the same mjlab-hpc"
            fix = f"pip install {package} in the nodes' environment"
            out.append(Check(f"{name} on nodes", "fail", f"task {bad[0][0]}: {bad[0][1]}", fix))
        elif found:
            detail, fix = f"version {found} there, {ours} here", "install the same version on both"
            out.append(Check(f"{name} on nodes", "fail", detail, fix))
        else:
            detail = f"{ours} and the rank code's imports" if name == "mjlab_hpc" else "imports"
            out.append(Check(f"{name} on nodes", "ok", detail))
    return out


def _gpus_check(gpus_per_node: int, ran: Sequence[dict[str, Any]]) -> Check:
    """Check that every task sees GPUs from Slurm and that torch can use them.

    Each node's tasks together must see the GPUs asked for (`gpus_per_node`).
    """
    if gpus_per_node == 0:
        return Check("GPUs", "skip", "CPU ranks (--gpus-per-node 0)")
    problems, counts, seen = [], [], {}
    for task in ran:
        gpus, where = task["gpus"], f"task {task.get('rank')} on {task['node']}"
        visible = [g for g in (gpus.get("CUDA_VISIBLE_DEVICES") or "").split(",") if g]
        # A task sees its node's GPUs, or its own one, which Slurm may number 0 in every task:
        # then the GPUs Slurm names for the step (or job) on that node count.
        named = gpus.get("SLURM_STEP_GPUS") or gpus.get("SLURM_JOB_GPUS") or ""
        ids = {f"slurm:{g}" for g in named.split(",") if g} or set(visible)
        seen.setdefault(task["node"], set()).update(ids)
        if not visible:
            problems.append(f"{where}: Slurm set no CUDA_VISIBLE_DEVICES")
        elif not gpus.get("torch_devices"):
            cpu = "no driver answers" if gpus.get("torch_cuda") else "a CPU build of torch"
            why = f"torch sees no GPU ({gpus.get('torch_error') or cpu})"
            problems.append(
                f"{where}: {why}; Slurm gave {','.join(visible)}; the ranks would train on CPU"
            )
        elif gpus["torch_devices"] < len(visible):
            n = f"{gpus['torch_devices']} of the {len(visible)}"
            counts.append(f"task on {task['node']}: torch sees {n} GPU(s) Slurm gave it")
    if problems:
        return Check("GPUs", "fail", "; ".join(problems[:4]), _FIXES["cuda"])
    if short := [f"{n}: {len(i)}" for n, i in sorted(seen.items()) if len(i) < gpus_per_node]:
        asked = f"GPU(s) visible to the node's tasks, {gpus_per_node} per node asked for"
        counts.insert(0, f"{', '.join(short)} {asked}")
    if counts:
        return Check("GPUs", "fail", "; ".join(counts[:4]), _FIXES["gres"])
    return Check("GPUs", "ok", f"every task sees its GPU(s), {gpus_per_node} per node")


def shape_checks(
    folder: Path, token: str, outcomes: Sequence[Outcome], gpus: int, mjlab: bool, nodes: str = "?"
) -> list[Check]:
    """Turn what the shape probe's tasks left (`outcomes`, by rank) into checks.

    The checks: the shared log root (`folder`, where this host wrote `token`), the nodes'
    Python and imports, GPUs (`gpus` per node asked for), and offscreen rendering where
    probed. `nodes`: the job's nodes, named when none came back.
    """
    shared = _shared(folder, token, outcomes, nodes)
    if all(t is None for t in outcomes):
        return [shared]
    ran = [t for t in outcomes if isinstance(t, dict)]
    checks = [shared, *_python(outcomes, mjlab), *([_gpus_check(gpus, ran)] if ran else [])]
    if done := {t["node"]: t["render"] for t in ran if "render" in t}:  # rank 0 records videos
        bad = [f"{node}: {why}" for node, why in done.items() if why]
        ok = Check("offscreen rendering", "ok", f"a test render worked on {', '.join(done)}")
        checks.append(Check(ok.name, "fail", bad[0], _FIXES["render"]) if bad else ok)
    return checks


# The checks that ask Slurm.


def _check_slurm(report: DoctorReport, slurm: SlurmClient) -> bool:
    path = (slurm.env or {}).get("PATH")
    if missing := [c for c in _COMMANDS if shutil.which(c, path=path) is None]:
        report.add("Slurm commands", "fail", f"not on PATH: {', '.join(missing)}", _FIXES["slurm"])
        return False
    version = slurm.run(["sinfo", "--version"])
    if (parts := slurm.partitions()) is None:
        report.add("Slurm controller", "fail", "sinfo did not answer", _FIXES["controller"])
        return False
    said = (version.stdout.strip() if version else "") or "sinfo answers"
    report.add("Slurm commands", "ok", f"{said}; {len([p for p in parts if p])} partition(s)")
    return True


def _check_request(report: DoctorReport, plan: SubmitPlan, slurm: SlurmClient) -> bool:
    spec = plan.spec
    warnings: list[str] = []
    try:
        check_partition(spec, warnings.append, slurm)
    except SpecError as exc:
        report.add("partition", "fail", exc.problem, f"change {exc.flag}")
        return False
    name = spec.partition or "the default partition"
    shape = f"{spec.nodes} node(s) x {spec.ranks_per_node} task(s), {spec.gpus_per_node} GPU(s)"
    if warnings:
        report.add("partition", "warn", "; ".join(warnings))
    else:
        report.add("partition", "ok", f"{name} can give {shape} per node")
    # The options of the job's own script, as mjlab-submit submits it (what it waits for
    # aside: the request is what Slurm is asked whether it can give).
    lines = [x for x in plan.jobs[0].script.splitlines() if x.startswith("#SBATCH ")]
    args = [a for a in (shlex.split(x)[1] for x in lines) if not a.startswith("--dependency")]
    ok, said = slurm.test_only([*args, "--wrap=true"])
    if not ok:
        report.add("request", "fail", f"sbatch --test-only refused it: {said}", _FIXES["request"])
        return False
    report.add("request", "ok", said)
    return True


def _check_arrays(report: DoctorReport, elements: int, config: dict[str, str] | None) -> None:
    if not (size := int((config or {}).get("MaxArraySize", "0") or 0)):
        report.add("job arrays", "warn", "MaxArraySize unknown (scontrol show config)")
    elif elements > size:
        detail = f"--sweep has {elements} elements; MaxArraySize is {size}"
        report.add("job arrays", "fail", detail, "split the sweep into several submissions")
    else:
        asked = f" ({elements} asked)" if elements else ""
        report.add("job arrays", "ok", f"sweeps of up to {size} elements{asked}")


# The probe jobs.


def _executor(spec: SubmitSpec, folder: Path, signal_delay_s: int, **params: Any) -> Any:
    """Return a submitit executor writing into `folder` for a probe job of `spec`'s resources.

    Its parameters are the real jobs' (`slurm_parameters`) with `params` over them.
    """
    python = container_python(spec, folder / "run" / "dir") or shlex.quote(sys.executable)
    executor = submitit.SlurmExecutor(folder, python=python)
    base = slurm_parameters(spec.replace(signal_delay_s=signal_delay_s))
    # submitit's handler in the job takes the signal the job asks for (--preempt-signal).
    setup = [*spec.setup, f"export SUBMITIT_PREEMPT_SIGNAL={spec.preempt_signal}"]
    executor.update_parameters(**{**base, "setup": setup, **params})
    return executor


def _submit(executor: Any, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Submit `fn(**kwargs)`: the job, or what sbatch said when it refused it."""
    try:
        return executor.submit(fn, **kwargs)
    except Exception as exc:  # submitit's FailedJobError carries sbatch's stderr
        return " ".join(str(exc).split()) or type(exc).__name__


def _ended(slurm: SlurmClient, job: Any) -> bool:
    """Tell whether the probe job ended.

    Slurm says so (its tasks exit a while after their results are in; scontrol answers
    without accounting too), or submitit does once slurmctld forgot the job.
    """
    state = slurm.job_state(job.job_id)
    return state in FINAL_STATES or (state is None and job.done())


def _finish(
    report: DoctorReport, name: str, job: Any, slurm: SlurmClient, wait_s: float
) -> tuple[dict[str, str], list[Outcome]] | None:
    """Wait up to `wait_s` for a probe job to end; return its fields and its tasks' outcomes.

    The fields are `scontrol show job`'s. None after a failing check `name`: sbatch refused
    the job, or it did not end in time.
    """
    if isinstance(job, str):
        report.add(name, "fail", f"sbatch refused the probe: {job}", "see the request check")
        return None
    deadline = time.monotonic() + wait_s
    while not (ended := _ended(slurm, job)) and time.monotonic() < deadline:
        time.sleep(1.0)
    info = slurm.job_fields(job.job_id) or {}
    if not ended:
        why = f" ({reason})" if (reason := slurm.pending_reason(job.job_id)) else ""
        detail = f"probe job {job.job_id} still {info.get('JobState', 'unknown')}{why}"
        report.add(name, "fail", f"{detail} after {wait_s:g} s", _FIXES["busy"])
        return None
    tasks = [job.task(k) for k in range(job.num_tasks)]
    for _ in range(10):  # a shared filesystem may show a result a moment after the job ended
        if all(t.paths.result_pickle.exists() or not t.paths.stderr.exists() for t in tasks):
            break
        time.sleep(1.0)
    outcomes: list[Outcome] = []
    for task in tasks:
        if (outcome := task_outcome(task)) is not None:  # read as data, never as code
            outcomes.append(outcome[1] if outcome[0] == "success" else _said(str(outcome[1])))
        else:  # None: nothing of the task reached this host
            outcomes.append(None if (log := task.stderr()) is None else _said(log))
    return info, outcomes


def _check_requeue(report: DoctorReport, job: Any, slurm: SlurmClient, wait_s: float) -> None:
    """A signal before the time limit, then a run after the requeue that followed it."""
    finished = _finish(report, "time-limit signal", job, slurm=slurm, wait_s=wait_s)
    if finished is None:
        return
    state, got = finished[0].get("JobState", "unknown"), finished[1][0]
    signalled = "--signal reached the job before its time limit"
    if isinstance(got, dict) and got["requeued"]:
        report.add("time-limit signal", "ok", signalled)
        restarts = f"(SLURM_RESTART_COUNT={got['restarts']})"
        report.add("requeue", "ok", f"the job requeued itself and ran again {restarts}")
    elif state == "TIMEOUT" or isinstance(got, dict):
        detail = "the job got no signal before its time limit"
        report.add("time-limit signal", "fail", detail, _FIXES["signal"])
    elif "requeue" in str(got):  # submitit's `scontrol requeue` failed
        report.add("time-limit signal", "ok", signalled)
        detail = f"scontrol requeue was refused ({got})"
        report.add("requeue", "fail", detail, _FIXES["requeue"])
    else:  # it never got to wait for the signal
        detail = f"the probe could not run: {got or 'nothing of it came back'}"
        fix = f"see the {'Python on nodes' if got else 'log root shared'} check"
        report.add("time-limit signal", "fail", detail, fix)


def _limit(minutes: int) -> str:
    """Minutes as Slurm's D-HH:MM:SS."""
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _gpu_partition(parts: dict[str, Partition], asked: str | None) -> Partition:
    """The partition asked for; else the default one with GPUs, or the one with the most."""
    if asked is not None:
        if asked not in parts or not asked:
            there = ", ".join(sorted(p for p in parts if p))
            raise SpecError("--partition", f"no partition {asked!r} here; there are: {there}")
        return parts[asked]
    named = [p for name, p in parts.items() if name]
    gpus = sorted((p for p in named if p.gpus_per_node), key=lambda p: -p.gpus_per_node)
    default = parts.get("")
    if default is not None and (default.gpus_per_node or not gpus):
        return default
    if not gpus:
        raise SpecError("--partition", "sinfo lists no partition")
    return gpus[0]


def cluster_profile(
    spec: SubmitSpec, user: str, slurm: SlurmClient | None = None
) -> tuple[dict[str, object], list[str]] | None:
    """What the cluster says a job of `user` asks for: flag values and notes on them.

    The values: the partition (`spec.partition`, else the default one with GPUs, else the
    one with the most GPUs per node), its GPUs per node and MaxTime, and the account and QOS
    of the user's associations (`spec.account` / `spec.qos` where given, else the default
    ones). The notes say what else there is. None when sinfo does not answer.
    """
    slurm = slurm or SlurmClient(timeout_s=30)
    if (parts := slurm.partitions()) is None:
        return None
    part = _gpu_partition(parts, spec.partition)
    values: dict[str, object] = {"partition": part.name, "gpus-per-node": part.gpus_per_node}
    gres = f"gres {part.gres}" if part.gres else "no GPUs"
    limit = _limit(part.max_minutes) if part.max_minutes else "no time limit"
    notes = [f"partition {part.name}: {part.nodes} node(s), {gres}, {limit}"]
    if part.max_minutes:
        values["time"] = _limit(part.max_minutes)
    if others := [p.name for n, p in parts.items() if n and p.gpus_per_node and p != part]:
        notes.append(f"other partitions with GPUs: {', '.join(sorted(others))}")
    assocs = slurm.associations(user)
    if not assocs:  # what was typed is kept, unchecked
        typed = {k: v for k, v in (("account", spec.account), ("qos", spec.qos)) if v}
        values |= typed
        why = "sacctmgr did not answer (no accounting?)" if assocs is None else "none"
        left = f"{' and '.join(typed)} as given, not checked" if typed else "left to Slurm"
        notes.append(f"{user}'s accounts: {why}; account and qos {left}")
        return values, notes
    assoc = _association(assocs, part.name, spec, user)
    values["account"] = assoc.account
    if spec.qos or assoc.default_qos or len(assoc.qos) == 1:
        values["qos"] = spec.qos or assoc.default_qos or assoc.qos[0]
    usable = [a for a in assocs if a.partition in ("", part.name)] or assocs
    accounts = sorted({a.account for a in usable})
    notes.append(f"{user}'s accounts here: {', '.join(accounts)}")
    if assoc.qos:
        notes.append(f"QOS under {assoc.account}: {', '.join(assoc.qos)}")
    return values, notes


def _association(
    assocs: Sequence[Association], partition: str, spec: SubmitSpec, user: str
) -> Association:
    """The association a profile charges: --account's (else the default one) on `partition`.

    SpecError for an account or a QOS sacctmgr does not give the user there, as for a
    partition sinfo does not list.
    """
    usable = [a for a in assocs if a.partition in ("", partition)] or list(assocs)
    if spec.account is not None:
        if not (mine := [a for a in usable if a.account == spec.account]):
            there = ", ".join(sorted({a.account for a in usable}))
            where = f"on partition {partition}" if partition else "here"
            raise SpecError(
                "--account",
                f"sacctmgr gives {user} no account {spec.account!r} {where}; "
                f"{user}'s accounts: {there}",
            )
        usable = mine
    assoc = next((a for a in usable if a.default_account), usable[0])
    if spec.qos is not None and assoc.qos and spec.qos not in assoc.qos:
        raise SpecError(
            "--qos",
            f"sacctmgr gives {user} no QOS {spec.qos!r} under account "
            f"{assoc.account}; there: {', '.join(assoc.qos)}",
        )
    return assoc


def diagnose(
    plan: SubmitPlan,
    wait_s: float = 300.0,
    slurm: SlurmClient | None = None,
    keep: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> DoctorReport:
    """Run every check for the job a plan of mjlab-submit's flags submits."""
    spec, resolved = plan.spec, plan.resolved
    slurm = slurm or SlurmClient(timeout_s=30)
    report = DoctorReport()
    if not _check_slurm(report, slurm):
        return report
    request_ok = _check_request(report, plan, slurm)
    log_root = Path(spec.train.log_root).absolute()
    try:
        check_log_root("--log-root", str(log_root))
    except SpecError as exc:
        report.add("log root here", "fail", exc.problem, "give --log-root a folder you can write")
        return report
    config = slurm.config()
    _check_arrays(report, len(plan.elements), config)
    limit_checks(report.add, spec, config, grace_s=partition_grace_s(slurm, spec.partition))
    if not request_ok:
        return report
    made = [p for p in (log_root / PROBE_DIR, *(log_root / PROBE_DIR).parents) if not p.exists()]
    folder = log_root / PROBE_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
    folder.mkdir(parents=True)
    token = secrets.token_hex(16)
    (folder / _TOKEN).write_text(token + "\n")
    # The shape probe's time-limit signal at the last second: it is long done by then. A task
    # that fails leaves the others running, to report.
    minutes = min(slurm_time_minutes(spec.time), 10)
    shape_ex = _executor(
        spec,
        folder,
        signal_delay_s=1,
        job_name="mjlab-doctor",
        time=minutes,
        srun_args=["--kill-on-bad-exit=0"],
    )
    # One task (one GPU where GPUs are asked for: a GPU partition may refuse a job without one).
    gpus = min(spec.gpus_per_node, 1)
    single = spec.replace(nodes=1, tasks_per_node=1, gpus_per_node=gpus, exclusive=False)
    single = single.replace(mem=None, cpus_per_task=None)
    requeue_ex = _executor(
        single, folder, signal_delay_s=_SIGNAL_DELAY_S, job_name="mjlab-doctor-requeue", time=1
    )
    # Python starts with the signal blocked (_RequeueProbe unblocks it): on a loaded node the
    # signal may still come before submitit has set its handler.
    block = f"signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIG{spec.preempt_signal}])"
    requeue_ex.python += f" -c 'import os, signal, sys; {block}; os.execv(sys.executable, "
    requeue_ex.python += "[sys.executable, *sys.argv[1:]])'"
    mjlab, video = resolved.source == "mjlab", spec.train.video
    jobs: list[str] = []
    try:
        progress("submitting two probe jobs (job shape; time-limit signal and requeue)")
        shape = _submit(
            shape_ex,
            _shape_probe,
            folder=str(folder),
            ranks=spec.world_size,
            mjlab=mjlab,
            video=video,
        )
        requeue = _submit(requeue_ex, _RequeueProbe())
        jobs = [j.job_id for j in (shape, requeue) if not isinstance(j, str)]
        progress(f"waiting for probe jobs {', '.join(jobs)} (up to {wait_s:g} s)")
        if finished := _finish(report, "probe job", shape, slurm=slurm, wait_s=wait_s):
            info, outcomes = finished
            nodes = info.get("NodeList", "?")
            state = info.get("JobState", "?")
            report.add("probe job", "ok", f"job {shape.job_id} ran on {nodes} ({state})")
            report.checks += shape_checks(
                folder,
                token,
                outcomes,
                gpus=spec.gpus_per_node,
                mjlab=mjlab,
                nodes=nodes,
            )
        _check_requeue(report, requeue, slurm, wait_s)
        if jobs and slurm.sacct(jobs[:1]):
            report.add("accounting", "ok", "sacct knows the probe job")
        else:
            detail = "sacct does not answer (accounting disabled?)"
            report.add("accounting", "warn", detail, _FIXES["accounting"])
    finally:
        if jobs:
            slurm.scancel(jobs)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
            # The folders made here, when empty (another doctor may use them).
            for path in [folder.parent, *made]:
                with contextlib.suppress(OSError):
                    path.rmdir()
    return report

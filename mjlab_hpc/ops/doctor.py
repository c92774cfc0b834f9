"""`mjlab-hpc doctor`: whether a job as asked would run on this cluster, checked on the
cluster itself before the first real submission.

The request is mjlab-submit's flags. Checks that need the compute nodes run two short probe
jobs: one with the job's shape (nodes, tasks, GPUs, partition, account, qos, setup lines)
whose tasks exchange tokens through the log root and report their Python, imports and GPUs
(`mjlab_hpc.ops.probe`), and one single-task job that waits for the time-limit signal and
requeues itself once, which is how our runs survive the time limit. Probe jobs are cancelled
and their folder removed when the doctor ends, however it ends.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.slurm import container_python
from mjlab_hpc.ops.probe import TOKEN_FILE, Check, Result, read_probe
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec
from mjlab_hpc.validate.rules import sbatch_options
from mjlab_hpc.validate.sweep import sweep_elements
from mjlab_hpc.validate.world import check_log_root, check_partition

__all__ = ["PROBE_DIR", "Check", "DoctorReport", "diagnose", "probe_script"]

#: The probe jobs' folder under the log root (hidden: run listings skip it).
PROBE_DIR = ".doctor"


_COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo", "scancel")


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


def _directives(spec: SubmitSpec, minutes: int, name: str) -> list[str]:
    """sbatch options of a probe job with the job's resources (`minutes` of time)."""
    args = [
        f"--job-name={name}",
        f"--time={minutes}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.ranks_per_node}",
    ]
    if spec.gpus_per_node > 0:
        args.append(f"--gpus-per-node={spec.gpus_per_node}")
    for flag, value in (
        ("partition", spec.partition),
        ("account", spec.account),
        ("qos", spec.qos),
        ("constraint", spec.constraint),
        ("cpus-per-task", spec.cpus_per_task),
        ("mem", spec.mem),
    ):
        if value is not None:
            args.append(f"--{flag}={value}")
    if spec.exclusive:
        args.append("--exclusive")
    for key, value in sbatch_options(spec).items():
        args.append(f"--{key}" if value is True else f"--{key}={value}")
    return args


def probe_script(spec: SubmitSpec, folder: Path, mjlab: bool) -> str:
    """The shape probe's batch script: three steps over every task. 1 (shell): note this
    node and the submitting host's token; 2 (shell): list the notes every other task left
    (so every node reads what the others wrote); 3 (Python): `mjlab_hpc.ops.probe`."""
    d = shlex.quote(str(folder))
    python = container_python(spec, folder / "run" / "dir") or shlex.quote(sys.executable)
    lines = ["#!/bin/bash", *spec.setup, f"D={d}"]
    lines += [
        "srun --kill-on-bad-exit=0 bash -c "
        """'echo "${SLURMD_NODENAME:-$(hostname)} $(cat "$0/token" 2>/dev/null)" """
        """> "$0/shell-$SLURM_PROCID"' "$D" """.rstrip(),
        "srun --kill-on-bad-exit=0 bash -c "
        """'cd "$0" && ls shell-* > "seen-$SLURM_PROCID" 2>/dev/null' "$D" """.rstrip(),
        f'srun --kill-on-bad-exit=0 --error="$D/py-%t.err" {python} -m mjlab_hpc.ops.probe '
        f'"$D"{" --mjlab" if mjlab else ""}',
        "",
    ]
    return "\n".join(lines)


# The requeue probe: waits for the time-limit signal (the job's --preempt-signal, up to 55 s
# before a 1-minute limit), then requeues itself once. Exit 7: no signal came; 8: requeue
# refused. {signal} is filled in.
_REQUEUE_SCRIPT = """#!/bin/bash
if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then exit 0; fi
srun --ntasks=1 bash -c 'trap "exit 0" {signal}; sleep 120 & wait; exit 7' || exit 7
scontrol requeue "$SLURM_JOB_ID" || exit 8
sleep 120
"""


def _job_field(text: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\S+)", text)
    return m.group(1) if m else None


def _wait(slurm: SlurmClient, job: str, done: Callable[[str], bool], wait_s: float) -> str:
    """`scontrol show job` once `done(text)` says so, or the last text after `wait_s`."""
    deadline = time.monotonic() + wait_s
    text = ""
    while True:
        text = slurm.show_job(job) or text
        if done(text) or time.monotonic() > deadline:
            return text
        time.sleep(1.0)


def _ended(text: str) -> bool:
    return _job_field(text, "JobState") in {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
    }


def _check_slurm(report: DoctorReport, slurm: SlurmClient) -> bool:
    missing = [c for c in _COMMANDS if shutil.which(c, path=(slurm.env or {}).get("PATH")) is None]
    if missing:
        report.add(
            "Slurm commands",
            "fail",
            f"not on PATH: {', '.join(missing)}",
            "run on the cluster's login node, or load its Slurm module (module load slurm); "
            "on a machine without Slurm use mjlab-submit --executor local",
        )
        return False
    version = slurm.run(["sinfo", "--version"])
    parts = slurm.partitions()
    if parts is None:
        report.add(
            "Slurm controller",
            "fail",
            "sinfo did not answer",
            "check that slurmctld is reachable from here (sinfo) and SLURM_CONF",
        )
        return False
    said = (version.stdout.strip() if version else "") or "sinfo answers"
    report.add("Slurm commands", "ok", f"{said}; {len([p for p in parts if p])} partition(s)")
    return True


def _check_request(report: DoctorReport, spec: SubmitSpec, slurm: SlurmClient) -> bool:
    warnings: list[str] = []
    try:
        check_partition(spec, warnings.append, slurm)
    except SpecError as exc:
        report.add("partition", "fail", exc.problem, f"change {exc.flag}")
        return False
    name = spec.partition or "the default partition"
    if warnings:
        report.add("partition", "warn", "; ".join(warnings))
    else:
        report.add(
            "partition",
            "ok",
            f"{name} can give {spec.nodes} node(s) x "
            f"{spec.ranks_per_node} task(s), {spec.gpus_per_node} GPU(s) per node",
        )
    minutes = slurm_time_minutes(spec.time)
    args = [*_directives(spec, minutes, "mjlab-doctor-test"), "--wrap=true"]
    ok, said = slurm.test_only(args)
    if not ok:
        report.add(
            "request",
            "fail",
            f"sbatch --test-only refused it: {said}",
            "change the flag Slurm names (account, qos, partition, time, resources)",
        )
        return False
    report.add("request", "ok", said)
    return True


def _check_shape(
    report: DoctorReport,
    spec: SubmitSpec,
    folder: Path,
    job: str | None,
    said: str,
    mjlab: bool,
    slurm: SlurmClient,
    wait_s: float,
) -> None:
    """Read the shape probe's results: log root, Python, imports, GPUs."""
    if job is None:
        report.add("probe job", "fail", f"sbatch refused it: {said}", "see the request check")
        return
    text = _wait(slurm, job, _ended, wait_s)
    state = _job_field(text, "JobState") or "unknown"
    if not _ended(text):
        why = slurm.pending_reason(job)
        report.add(
            "probe job",
            "fail",
            f"job {job} still {state}{f' ({why})' if why else ''} after {wait_s:g} s",
            "the cluster is busy or the request cannot start: try --wait-s longer, "
            "or another partition",
        )
        return
    nodes = slurm.hostnames(_job_field(text, "NodeList") or "") or []
    report.add("probe job", "ok", f"job {job} ran on {','.join(nodes) or '?'} ({state})")
    report.checks.extend(read_probe(folder, nodes, spec.world_size, spec.gpus_per_node, mjlab))


def _check_requeue(
    report: DoctorReport, job: str | None, said: str, slurm: SlurmClient, wait_s: float
) -> None:
    if job is None:
        report.add("time-limit signal", "fail", f"sbatch refused the probe: {said}")
        return
    text = _wait(slurm, job, lambda t: _ended(t) and "Restarts=" in t, wait_s)
    restarts = int(_job_field(text, "Restarts") or 0)
    code = (_job_field(text, "ExitCode") or "0:0").split(":")[0]
    state = _job_field(text, "JobState") or "unknown"
    if not _ended(text):
        report.add(
            "time-limit signal",
            "fail",
            f"probe job {job} still {state} after {wait_s:g} s",
            "try --wait-s longer",
        )
        return
    if (restarts == 0 and code == "7") or state == "TIMEOUT":
        report.add(
            "time-limit signal",
            "fail",
            "the job got no signal before its time limit",
            "runs cannot checkpoint at the time limit: ask your admins why --signal is "
            "not delivered; use --save-every-min to bound lost work",
        )
        return
    report.add("time-limit signal", "ok", "--signal reached the job before its time limit")
    if restarts >= 1:
        report.add("requeue", "ok", "the job requeued itself and ran again")
    else:
        report.add(
            "requeue",
            "fail",
            f"scontrol requeue was refused (job {state}, exit {code})",
            "runs cannot continue after the time limit by themselves here: use "
            "mjlab-submit --chain N (one job after another)",
        )


def _check_accounting(report: DoctorReport, job: str | None, slurm: SlurmClient) -> None:
    rows = slurm.sacct([job]) if job else None
    if rows:
        report.add("accounting", "ok", "sacct knows the probe job")
    else:
        report.add(
            "accounting",
            "warn",
            "sacct does not answer (accounting disabled?)",
            "status then reads states from squeue and run records; ended jobs show "
            "their recorded state",
        )


def _check_arrays(report: DoctorReport, spec: SubmitSpec, config: dict[str, str] | None) -> None:
    size = int((config or {}).get("MaxArraySize", "0") or 0)
    if not size:
        report.add("job arrays", "warn", "MaxArraySize unknown (scontrol show config)")
        return
    elements = len(sweep_elements(spec.train, spec.sweep)) if spec.sweep else 0
    if elements > size:
        report.add(
            "job arrays",
            "fail",
            f"--sweep has {elements} elements; MaxArraySize is {size}",
            "split the sweep into several submissions",
        )
    else:
        report.add(
            "job arrays",
            "ok",
            f"sweeps of up to {size} elements" + (f" ({elements} asked)" if elements else ""),
        )


def diagnose(
    spec: SubmitSpec,
    resolved: ResolvedSpec,
    wait_s: float = 300.0,
    slurm: SlurmClient | None = None,
    keep: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> DoctorReport:
    """Run every check for the job `spec` asks for (its flags already validated)."""
    slurm = slurm or SlurmClient(timeout_s=30)
    report = DoctorReport()
    if not _check_slurm(report, slurm):
        return report
    request_ok = _check_request(report, spec, slurm)
    log_root = Path(spec.train.log_root).absolute()
    try:
        check_log_root("--log-root", str(log_root))
    except SpecError as exc:
        report.add("log root here", "fail", exc.problem, "give --log-root a folder you can write")
        return report
    _check_arrays(report, spec, slurm.config())
    if not request_ok:
        return report
    made = [p for p in (log_root / PROBE_DIR, *(log_root / PROBE_DIR).parents) if not p.exists()]
    folder = log_root / PROBE_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
    folder.mkdir(parents=True)
    (folder / TOKEN_FILE).write_text(secrets.token_hex(16) + "\n")
    mjlab = resolved.source == "mjlab"
    (folder / "shape.sh").write_text(probe_script(spec, folder, mjlab))
    (folder / "requeue.sh").write_text(_REQUEUE_SCRIPT.format(signal=spec.preempt_signal))
    jobs: list[str] = []
    try:
        progress("submitting two probe jobs (job shape; time-limit signal and requeue)")
        shape, said = slurm.sbatch(
            [
                *_directives(spec, min(slurm_time_minutes(spec.time), 10), "mjlab-doctor"),
                f"--output={folder}/shape.out",
                str(folder / "shape.sh"),
            ]
        )
        # One task (one GPU where GPUs are asked for: a GPU partition may refuse a job
        # without one).
        single = spec.replace(
            nodes=1,
            tasks_per_node=1,
            gpus_per_node=min(spec.gpus_per_node, 1),
            exclusive=False,
            mem=None,
            cpus_per_task=None,
        )
        requeue, said_rq = slurm.sbatch(
            [
                *_directives(single, 1, "mjlab-doctor-requeue"),
                f"--signal={spec.preempt_signal}@55",
                "--requeue",
                "--output=/dev/null",
                str(folder / "requeue.sh"),
            ]
        )
        jobs = [j for j in (shape, requeue) if j]
        progress(f"waiting for probe jobs {', '.join(jobs)} (up to {wait_s:g} s)")
        _check_shape(report, spec, folder, shape, said, mjlab, slurm, wait_s)
        _check_requeue(report, requeue, said_rq, slurm, wait_s)
        _check_accounting(report, shape, slurm)
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

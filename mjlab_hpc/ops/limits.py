"""Slurm's own limits against the flags of a job, for `mjlab-hpc doctor`.

The limits come from `scontrol show config`: MaxBatchRequeue, preemption (PreemptMode,
PreemptParameters, the partition's GraceTime), KillWait, SlurmdTimeout and
UnkillableStepTimeout. A check warns where --max-restarts, --signal-delay-s or
--hang-timeout-s cannot work with them (docs/submit.md, "Slurm's own limits").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.spec import SubmitSpec

__all__ = ["MAX_BATCH_REQUEUE_BEFORE_23_02", "limit_checks", "partition_grace_s"]

# Slurm before 23.02 holds a batch job after this many restarts when its launch fails (a
# constant then; `MaxBatchRequeue` in slurm.conf since).
MAX_BATCH_REQUEUE_BEFORE_23_02 = 5

# (name, result, detail, fix): one line of the doctor's table.
Add = Callable[[str, str, str, str], None]


def _seconds(config: Mapping[str, str], key: str) -> int | None:
    m = re.match(r"\s*(\d+)", config.get(key, ""))
    return int(m.group(1)) if m else None


def partition_grace_s(slurm: SlurmClient, partition: str | None) -> int | None:
    """The partition's GraceTime (the default partition's without --partition)."""
    proc = slurm.run(["scontrol", "-o", "show", "partition", *([partition] if partition else [])])
    lines = proc.stdout.splitlines() if proc is not None and proc.returncode == 0 else []
    m = re.search(
        r"GraceTime=(\d+)", next((x for x in lines if partition or "Default=YES" in x), "")
    )
    return int(m.group(1)) if m else None


def limit_checks(
    add: Add, spec: SubmitSpec, config: Mapping[str, str] | None, grace_s: int | None = None
) -> None:
    """Report Slurm's limits and check the job's flags against them, through `add`.

    `config` is `scontrol show config`; `grace_s` the partition's GraceTime.
    """
    if not config:
        add("Slurm limits", "warn", "scontrol show config did not answer", "")
        return
    train = spec.train
    kill_wait = _seconds(config, "KillWait") or 30
    slurmd_timeout = _seconds(config, "SlurmdTimeout")
    unkillable = _seconds(config, "UnkillableStepTimeout")
    # Shown since 23.02; a constant 5 before.
    configured = _seconds(config, "MaxBatchRequeue")
    shown = str(configured) if configured is not None else "5 (built in before 23.02)"
    max_batch = MAX_BATCH_REQUEUE_BEFORE_23_02 if configured is None else configured
    mode = config.get("PreemptMode", "OFF").upper()
    # 23.02 moved the setting from SlurmctldParameters=preempt_send_user_signal.
    params = f"{config.get('PreemptParameters', '')},{config.get('SlurmctldParameters', '')}"
    user_signal = "send_user_signal" in params
    summary = (
        f"MaxBatchRequeue {shown}, PreemptMode {mode}"
        f"{', send_user_signal' if user_signal else ''}, KillWait {kill_wait} s, "
        f"SlurmdTimeout {slurmd_timeout} s, UnkillableStepTimeout {unkillable} s"
    )
    add("Slurm limits", "ok", summary, "")

    if train.max_restarts > max_batch:
        detail = (
            f"--max-restarts {train.max_restarts} is above MaxBatchRequeue {max_batch}: after "
            f"{max_batch} restarts a start that fails to launch (a node failing as the job "
            "starts) holds the job (JobHeldAdmin) instead of requeueing it"
        )
        fix = (
            f"use --max-restarts {max_batch} or less, or ask your admins to raise "
            "MaxBatchRequeue (scontrol release JOB lets a held job run)"
        )
        add("--max-restarts", "warn", detail, fix)
    if "OFF" not in mode:
        grace = (grace_s or 0) + kill_wait
        if not user_signal:
            detail = (
                f"PreemptMode {mode} without send_user_signal: a preempted job gets SIGTERM, "
                f"not --preempt-signal {spec.preempt_signal}, and {grace} s (GraceTime + "
                "KillWait) before SIGKILL; the ranks checkpoint on SIGTERM too, in that time"
            )
            fix = (
                "keep iterations and checkpoints shorter than that, or ask your admins for "
                "PreemptParameters=send_user_signal"
            )
            add("preemption", "warn", detail, fix)
        elif grace < spec.signal_delay_s:
            detail = (
                f"a preempted job gets {grace} s (GraceTime + KillWait) after the signal, "
                f"not the --signal-delay-s {spec.signal_delay_s} s the time limit gives"
            )
            fix = (
                "keep an iteration and a checkpoint within that, or use a partition with a "
                "longer GraceTime"
            )
            add("preemption", "warn", detail, fix)
    hang = train.hang_timeout_s
    if hang and slurmd_timeout is not None and hang >= slurmd_timeout:
        detail = (
            f"--hang-timeout-s {hang:g} is not below SlurmdTimeout {slurmd_timeout} s: when a "
            "node is lost its ranks fall silent, and Slurm ends the job (NODE_FAIL) and "
            "requeues it itself before the watchdog notices; the healer records no fault and "
            "excludes no node"
        )
        add("--hang-timeout-s", "warn", detail, f"use --hang-timeout-s below {slurmd_timeout}")

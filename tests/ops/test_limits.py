"""Slurm's own limits against a job's flags (`mjlab-hpc doctor`'s "Slurm limits" checks).

The limits come from `scontrol show config` as 22.05 and 24.11 print it, with the test
clusters' own values; the doctor test reads them from the real clusters.
"""

from __future__ import annotations

import pytest

from mjlab_hpc.ops.limits import limit_checks
from mjlab_hpc.spec import SubmitSpec, TrainSpec

# What the test clusters print (22.05 has no MaxBatchRequeue and no PreemptParameters).
SLURM_22_05 = {
    "KillWait": "2 sec",
    "PreemptMode": "OFF",
    "SlurmctldParameters": "(null)",
    "SlurmdTimeout": "300 sec",
    "UnkillableStepTimeout": "60 sec",
}
SLURM_24_11 = {**SLURM_22_05, "MaxBatchRequeue": "5", "PreemptParameters": "(null)"}


def checks(
    config: dict[str, str] | None, grace_s: int | None = None, **flags: object
) -> dict[str, tuple[str, str, str]]:
    train = {k: v for k, v in flags.items() if k in ("max_restarts", "hang_timeout_s")}
    submit = {k: v for k, v in flags.items() if k not in train}
    spec = SubmitSpec(train=TrainSpec(task="cartpole", **train), **submit)  # type: ignore[arg-type]
    out: dict[str, tuple[str, str, str]] = {}
    limit_checks(lambda name, *rest: out.__setitem__(name, rest), spec, config, grace_s)
    return out


@pytest.mark.parametrize(
    ("config", "shown"),
    [(SLURM_22_05, "5 (built in before 23.02)"), (SLURM_24_11, "MaxBatchRequeue 5,")],
)
def test_the_limits_are_named_and_flags_within_them_pass(
    config: dict[str, str], shown: str
) -> None:
    got = checks(config, max_restarts=5, hang_timeout_s=120.0)
    assert set(got) == {"Slurm limits"}
    result, detail, _ = got["Slurm limits"]
    assert result == "ok" and shown in detail, detail
    for part in (
        "PreemptMode OFF",
        "KillWait 2 s",
        "SlurmdTimeout 300 s",
        "UnkillableStepTimeout 60 s",
    ):
        assert part in detail, detail


def test_more_restarts_than_slurm_requeues_after_failed_launches() -> None:
    result, detail, fix = checks({**SLURM_24_11, "MaxBatchRequeue": "3"}, max_restarts=10)[
        "--max-restarts"
    ]
    assert result == "warn" and "above MaxBatchRequeue 3" in detail and "JobHeldAdmin" in detail
    assert "--max-restarts 3" in fix


def test_preemption_without_the_user_signal_and_with_a_short_grace_time() -> None:
    requeue = {**SLURM_24_11, "PreemptMode": "REQUEUE"}
    result, detail, fix = checks(requeue, grace_s=60)["preemption"]
    assert result == "warn" and "gets SIGTERM, not --preempt-signal USR2" in detail
    assert "62 s" in detail and "send_user_signal" in fix
    # 23.02+ spelling, then 22.05's (SlurmctldParameters): the signal comes, but the grace
    # time is shorter than the checkpoint time the time limit gives.
    for config in (
        {**requeue, "PreemptParameters": "send_user_signal"},
        {**requeue, "SlurmctldParameters": "preempt_send_user_signal"},
    ):
        result, detail, _ = checks(config, grace_s=30, signal_delay_s=120)["preemption"]
        assert result == "warn" and "32 s" in detail and "--signal-delay-s 120" in detail
        assert "preemption" not in checks(config, grace_s=300, signal_delay_s=120)


def test_a_hang_limit_slurm_would_beat_on_a_lost_node() -> None:
    result, detail, fix = checks(SLURM_24_11, hang_timeout_s=300.0)["--hang-timeout-s"]
    assert result == "warn" and "not below SlurmdTimeout 300 s" in detail
    assert "below 300" in fix
    assert "--hang-timeout-s" not in checks(SLURM_24_11, hang_timeout_s=None)


def test_no_config_is_a_warning() -> None:
    assert checks(None)["Slurm limits"][0] == "warn"

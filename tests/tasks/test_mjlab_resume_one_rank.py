"""mjlab runs continue where they stopped, on one rank (issue 29).

Rough G1 (terrain curriculum) is stopped by Ctrl-C and continued with `--resume`. A tracking
task (adaptive sampling, a motion file the test makes) is requeued at its time limit by
submitit's local executor. Each ends with the parameters of a run that never stopped. A
continuation that changes the env config is refused before anything starts.

Each task family (terrain curriculum, flat, tracking) and each interruption (Ctrl-C and
--resume, a time-limit requeue, a healed crash) runs once, on one rank here and on two in
test_mjlab_resume_two_ranks.py. Every interruption ends in the same restore of each rank's
saved state (`rank/resume.load_plan`); each interruption's own path is checked exact on 1 and
2 ranks with the built-in tasks (tests/rank/test_preemption.py,
tests/launch/test_healing.py). Every registered task's state on its own:
test_mjlab_state.py. Few envs and iterations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import (
    BIN,
    cli_env,
    make_motion,
    only_run,
    reference_digests,
    time_limit_stop,
    wait_for_iteration,
)

from mjlab_hpc.errors import EXIT_BAD_INPUT, EXIT_STOPPED
from mjlab_hpc.rundir.record import Start, read_record

if os.environ.get("CI") == "true":
    import mjlab  # noqa: F401  (make install brings the extra: on CI a missing mjlab fails)
else:
    pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

# Several G1 starts per test (runs, restarts, a reference run): minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.mjlab, pytest.mark.training, pytest.mark.timeout(1200)]

SMALL = ["--num-envs", "2", "--agent.num-steps-per-env", "4", "--agent.logger", "tensorboard"]
SMALL += ["--torch-threads", "1", "--seed", "3", "--save-interval", "2", "--max-iterations", "5"]
ROUGH = ["Mjlab-Velocity-Rough-Unitree-G1", *SMALL]


def starts(run_dir: Path) -> tuple[Start, ...]:
    return read_record(run_dir).starts


def test_rough_g1_ctrl_c_then_resume_is_exact(tmp_path: Path, shared_tmp: Path) -> None:
    """Ctrl-C after iteration 2: a checkpoint with the env's whole state (terrain levels,
    commands, episode counters, the simulator, the generators), exit 3; `--resume` restores it
    and ends bit-identical to the uninterrupted run."""
    root = tmp_path / "logs"
    proc = subprocess.Popen(
        [BIN / "mjlab-train", *ROUGH, "--log-root", str(root)],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_iteration(root, 2, timeout=400)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    run = only_run(root)
    stopped_at = int(json.loads(run.restarts.read_text())["iteration"])
    assert stopped_at < 5
    levels = run.path / "rank_states" / f"model_{stopped_at}" / "rank0-of-1.pt"
    assert levels.is_file() and levels.with_name(levels.name + ".sha256").is_file()

    again = subprocess.run(
        [BIN / "mjlab-train", *ROUGH, "--log-root", str(root), "--resume"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(run.summary.read_text())
    assert summary["resumed_from"] == stopped_at and summary["iterations"] == 5
    last = starts(run.path)[-1]
    assert (last.environments, last.changed) == ("restored", {}), last
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, ROUGH)

    # The env config is what the saved environments were made with: another is refused.
    continued = ["--max-iterations", "6", "--run-dir", str(run.path)]
    other = subprocess.run(
        [BIN / "mjlab-train", *ROUGH, *continued, "--env.episode-length-s", "7"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert other.returncode == EXIT_BAD_INPUT, other.stderr[-2000:]
    said = " ".join(other.stderr.split())
    assert "--env.episode-length-s:" in said and "20.0" in said and "--fresh-envs" in said, said
    assert len(starts(run.path)) == 2  # nothing started


def test_tracking_time_limit_requeue_is_exact(tmp_path: Path, shared_tmp: Path) -> None:
    """A tracking task through `mjlab-submit --executor local`: USR2 (the time-limit signal)
    after iteration 2 checkpoints, the executor requeues, the start restores the env's state
    (motion phases, adaptive sampling's failure counts) and ends exact."""
    motion = shared_tmp / "motion-one-rank.npz"
    if not motion.exists():
        made = make_motion(tmp_path / "motion.npz")
        os.replace(made, motion)
    motion_file = ["--env.commands.motion.motion-file", str(motion)]
    args = ["Mjlab-Tracking-Flat-Unitree-G1", *SMALL, *motion_file]
    root = tmp_path / "job"
    cmd = [BIN / "mjlab-submit", *args, "--executor", "local", "--gpus-per-node", "0"]
    cmd += ["--tasks-per-node", "1", "--log-root", str(root), "--follow"]
    proc = subprocess.Popen(
        cmd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = wait_for_iteration(root, 2, timeout=400)
    time_limit_stop(run)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    (stop,) = [json.loads(x) for x in run.restarts.read_text().splitlines()]
    assert stop["reason"] == "time-limit"
    summary = json.loads(run.summary.read_text())
    assert summary["resumed_from"] == stop["iteration"] and summary["iterations"] == 5
    assert starts(run.path)[-1].environments == "restored"
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, args)

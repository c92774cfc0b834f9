"""mjlab runs continue where they stopped, on two ranks (issue 29).

A Flat G1 job of `mjlab-submit --executor local` is requeued at its time limit, then healed
after its rank 1 is killed (kill -9). It ends with both ranks' parameters of a run that never
stopped. One rank, and why these combinations cover the class: test_mjlab_resume_one_rank.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import (
    BIN,
    cli_env,
    rank_pids,
    reference_digests,
    time_limit_stop,
    wait_for_iteration,
)

from mjlab_hpc.rundir.record import read_record

if os.environ.get("CI") == "true":
    import mjlab  # noqa: F401  (make install brings the extra: on CI a missing mjlab fails)
else:
    pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

# Several G1 starts per test (runs, restarts, a reference run): minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.mjlab, pytest.mark.training, pytest.mark.timeout(1200)]

FLAT = ["Mjlab-Velocity-Flat-Unitree-G1", "--num-envs", "2", "--agent.num-steps-per-env", "4"]
FLAT += ["--agent.logger", "tensorboard", "--torch-threads", "1", "--seed", "3"]
FLAT += ["--save-interval", "2", "--max-iterations", "5"]


def test_flat_g1_time_limit_then_crash_is_exact(tmp_path: Path, shared_tmp: Path) -> None:
    """USR2 (the time-limit signal) to both ranks after iteration 2: they checkpoint with
    their environments and the executor requeues them; then rank 1 dies (kill -9) after
    iteration 4 and the controller heals the job from that stop's checkpoint. Every start
    restores both ranks' environments, and the run ends exact."""
    root = tmp_path / "job"
    cmd = [BIN / "mjlab-submit", *FLAT, "--executor", "local", "--gpus-per-node", "0"]
    cmd += ["--tasks-per-node", "2", "--log-root", str(root), "--follow"]
    proc = subprocess.Popen(
        cmd,
        env=cli_env({"MJLAB_HPC_FAULT": "kill@4:rank1:once"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = wait_for_iteration(root, 2, timeout=500)
    time_limit_stop(run)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    record = read_record(run.path)
    (stop,) = record.restarts
    (fault,) = record.faults
    assert stop.reason == "time-limit" and stop.resumed_from == stop.iteration, stop
    assert (fault.reason, fault.iteration) == ("crash", 4), fault
    assert fault.resumed_from == stop.iteration, fault
    assert [s.environments for s in record.starts] == ["new", "restored", "restored"]
    saved = sorted(p.name for p in (run.path / "rank_states" / "model_5").glob("*.pt"))
    assert saved == ["rank0-of-2.pt", "rank1-of-2.pt"]
    summary = json.loads(run.summary.read_text())
    assert summary["iterations"] == 5 and summary["ranks_in_sync"]
    assert summary["param_digest_per_rank"] == reference_digests(shared_tmp, FLAT, ranks=2)
    assert rank_pids(run) == []

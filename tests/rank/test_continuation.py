"""What a continuation may change (issue 35, class 3; the rules: docs/preemption.md, "What a
continuation may change"), through the real CLIs: a setting the run's saved environments fit
(--num-envs, --seed, the number of ranks) is refused with exit 2 before anything starts, naming
the flag and the run's value, unless --fresh-envs; every other change is applied, said on the
console and recorded in run.json; a damaged rank state makes its checkpoint damaged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run

from mjlab_hpc.errors import EXIT_BAD_INPUT
from mjlab_hpc.rundir.state import read_record
from mjlab_hpc.spec import SubmitSpec, TrainSpec

BASE = ["cartpole", "--num-envs", "16", "--torch-threads", "1", "--save-interval", "1"]


def train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN / "mjlab-train", *BASE, *args], env=cli_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.training
def test_kept_settings_are_refused_and_others_applied(tmp_path: Path) -> None:
    first = train("--max-iterations", "2", "--log-root", str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(tmp_path).path
    where = ["--run-dir", str(run)]
    before = run.joinpath("run.json").read_text()
    for args, flag, theirs in (
        (["--num-envs", "32"], "--num-envs", "16"),
        (["--seed", "7"], "--seed", "42"),
        (["--num-procs", "2"], "--num-procs", "1 rank(s)"),
    ):
        refused = train(*args, "--max-iterations", "3", *where)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-2000:]
        assert said.startswith(f"error: {flag}:") and f"trained with {theirs};" in said, said
        assert "--fresh-envs" in said and "Traceback" not in refused.stderr
        assert run.joinpath("run.json").read_text() == before  # nothing started

    # With --fresh-envs: 1 -> 2 ranks, applied, said and recorded.
    fresh = train("--num-procs", "2", "--fresh-envs", "--max-iterations", "4", *where)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    (note,) = [x for x in fresh.stderr.splitlines() if x.startswith("note: continuing")]
    assert "with new environments (--fresh-envs)" in note
    assert "--num-procs 1 rank(s) -> 2 rank(s)" in note and "--max-iterations 2 -> 4" in note
    record = read_record(run)
    assert record["spec"]["num_procs"] == 2 and record["world_size"] == 2
    last = record["starts"][-1]
    assert last["environments"] == "fresh" and last["resumed_from_iteration"] == 2
    assert last["changed"] == {"max_iterations": [2, 4], "num_procs": [1, 2],
                               "world_size": [1, 2]}  # fmt: skip

    # 2 -> 1 is refused the same way; a free setting alone is applied and said.
    back = train("--max-iterations", "5", *where)
    assert back.returncode == EXIT_BAD_INPUT and "trained with 2 rank(s)" in back.stderr
    more = train("--num-procs", "2", "--max-iterations", "5", "--save-interval", "2", *where)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "note: continuing" in more.stderr and "--save-interval 1 -> 2" in more.stderr
    assert "--fresh-envs" not in more.stderr
    last = read_record(run)["starts"][-1]
    assert last["environments"] == "restored"
    assert last["changed"] == {"max_iterations": [4, 5], "save_interval": [1, 2]}

    # A damaged rank state (one byte of rank 1's, of the newest checkpoint): that checkpoint
    # is damaged as a whole, set aside, and the run continues from the one before.
    damaged = run / "rank_states" / "model_5" / "rank1-of-2.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = train("--num-procs", "2", "--max-iterations", "6", "--save-interval", "2", *where)
    assert again.returncode == 0, again.stderr[-2000:]
    (skipped,) = read_record(run)["starts"][-1]["skipped_checkpoints"]
    assert skipped["name"] == "model_5.pt" and "rank1-of-2.pt does not match" in skipped["why"]
    assert (run / "rank_states" / "model_5.damaged").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and summary["iterations"] == 6


def test_every_setting_has_a_rule_in_the_docs() -> None:
    """docs/preemption.md's table names every flag of mjlab-train and mjlab-submit."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "preemption.md").read_text()
    table = text.split("## What a continuation may change", 1)[1].split("\n## ", 1)[0]
    fields = [*TrainSpec.__dataclass_fields__, *SubmitSpec.__dataclass_fields__]
    missing = [f for f in fields if f != "train" and f"`--{f.replace('_', '-')}`" not in table]
    assert not [m for m in missing if m not in ("task", "overrides")], missing
    assert "`TASK`" in table and "`--env.*`" in table and "`--agent.*`" in table

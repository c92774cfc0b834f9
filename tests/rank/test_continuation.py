"""What a continuation may change, through the real CLIs (issue 35, class 3, and issue 41).

The rules are in docs/preemption.md, "What a continuation may change". What a command does
not name is the run's. A setting the run's saved environments fit (--num-envs, --seed, the
number of ranks) is refused with exit 2 before anything starts, naming the flag and the run's
value, unless --fresh-envs. Every other change is applied, said on the console and recorded
in run.json. Rank states that do not belong make their checkpoint damaged.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run

from mjlab_hpc.cli.common import parse_command
from mjlab_hpc.errors import EXIT_BAD_INPUT, SpecError
from mjlab_hpc.rundir.checkpoint import save_checkpoint
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.spec import RunTarget, SubmitSpec, TrainSpec
from mjlab_hpc.validate import resolve
from mjlab_hpc.validate.continuation import continue_target, continued

BASE = ["cartpole", "--num-envs", "16", "--torch-threads", "1", "--save-interval", "1"]


def train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BIN / "mjlab-train", *BASE, *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.training
def test_kept_settings_are_refused_and_others_applied(tmp_path: Path) -> None:
    first = train("--max-iterations", "2", "--log-root", str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(tmp_path).path
    where = ["--run-dir", str(run)]
    before = run.joinpath("run.json").read_text()
    for args, flag, theirs in (
        (["--num-envs", "32"], "--num-envs", "trained with 16;"),
        (["--seed", "7"], "--seed", "trained with 42;"),
        (["--num-procs", "2"], "--num-procs", "trained with 1 rank(s);"),
        (["--max-iterations", "1"], "--max-iterations", "has done 2 iterations"),
        (["--experiment-name", "other"], "--experiment-name", "experiment 'cartpole', not"),
    ):
        refused = train(*args, *where)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-2000:]
        assert said.startswith(f"error: {flag}:") and theirs in said, said
        assert "Traceback" not in refused.stderr
        assert run.joinpath("run.json").read_text() == before  # nothing started

    # With --fresh-envs: 1 -> 2 ranks, applied, said and recorded.
    fresh = train("--num-procs", "2", "--fresh-envs", "--max-iterations", "4", *where)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    (note,) = [x for x in fresh.stderr.splitlines() if x.startswith("note: continuing")]
    assert "with new environments (--fresh-envs)" in note
    assert "--num-procs 1 rank(s) -> 2 rank(s)" in note and "--max-iterations 2 -> 4" in note
    record = read_record(run)
    assert record.spec.num_procs == 2 and record.world_size == 2
    last = record.last_start
    assert last.environments == "fresh" and last.resumed_from_iteration == 2
    assert last.changed == {"max_iterations": [2, 4], "world_size": [1, 2]}

    # What the command does not name is the run's (2 ranks, --save-interval 1, 16 envs): the
    # new --save-interval and --max-iterations are applied and said, nothing else.
    more = subprocess.run(
        [BIN / "mjlab-train", "cartpole", "--max-iterations", "5", "--save-interval", "2", *where],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert more.returncode == 0, more.stderr[-2000:]
    (note,) = [x for x in more.stderr.splitlines() if x.startswith("note: continuing")]
    assert note.endswith(": --max-iterations 4 -> 5; --save-interval 1 -> 2"), note
    record = read_record(run)
    last = record.last_start
    assert last.environments == "restored" and record.world_size == 2
    assert last.changed == {"max_iterations": [4, 5], "save_interval": [1, 2]}
    assert record.spec.num_envs == 16 and record.spec.torch_threads == 1
    back = train("--num-procs", "1", "--max-iterations", "6", *where)  # named: compared
    assert back.returncode == EXIT_BAD_INPUT and "trained with 2 rank(s)" in back.stderr

    # Rank states from elsewhere (issue 41): model_5's two swapped with their checksums, and
    # rank 1's of model_4 a link to /dev/zero. Both checkpoints are damaged, set aside and
    # named; the run continues from model_3, and the launcher never read /dev/zero. Its
    # environment states were pruned (--keep-env-states 2 kept model_4's and model_5's): that
    # is refused before anything starts, naming --fresh-envs, and continued with it.
    states = run / "rank_states"
    for name in ("rank0-of-2.pt", "rank0-of-2.pt.sha256"):
        a, b = states / "model_5" / name, states / "model_5" / name.replace("0-of", "1-of")
        a.rename(a.with_name("x"))
        b.rename(a)
        a.with_name("x").rename(b)
    zero = states / "model_4" / "rank1-of-2.pt"
    zero.unlink()
    zero.symlink_to("/dev/zero")
    before = run.joinpath("run.json").read_text()
    refused = train("--max-iterations", "6", *where)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-2000:]
    assert said.startswith("error: --fresh-envs: model_3.pt of ") and "were pruned" in said, said
    assert run.joinpath("run.json").read_text() == before  # nothing started
    again = train("--max-iterations", "6", "--fresh-envs", *where)
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_record(run).last_start.environments == "fresh"
    skipped = {s.name: s.why for s in read_record(run).last_start.skipped_checkpoints}
    assert "is not the state rank 0 saved: it is rank 1's" in skipped["model_5.pt"], skipped
    assert "rank1-of-2.pt is a character device, not a file" in skipped["model_4.pt"], skipped
    assert "skipped damaged checkpoint model_5.pt" in again.stderr + again.stdout
    assert (states / "model_5.damaged").is_dir() and (states / "model_4.damaged").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 3 and summary["iterations"] == 6


def test_every_setting_has_a_rule_in_the_docs() -> None:
    """docs/preemption.md's table names every flag of mjlab-train and mjlab-submit."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "preemption.md").read_text()
    table = text.split("## What a continuation may change", 1)[1].split("\n## ", 1)[0]
    fields = [*TrainSpec.__dataclass_fields__, *SubmitSpec.__dataclass_fields__]
    missing = [f for f in fields if f != "train" and f"`--{f.replace('_', '-')}`" not in table]
    assert not [m for m in missing if m not in ("task", "overrides")], missing
    assert "`TASK`" in table and "`--env.*`" in table and "`--agent.*`" in table


def _recorded_run(root: Path, world_size: int, device: str = "cpu") -> Path:
    """A run directory as a job of `world_size` ranks on one node left it (run.json and a
    checkpoint at iteration 4), made without training."""
    run = root / "cartpole" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    spec = TrainSpec(
        num_envs=16,
        max_iterations=6,
        save_interval=2,
        torch_threads=1,
        overrides=("--agent.learning-rate", "0.001", "--agent.gamma=0.9"),
    )
    effective = {"experiment_name": "cartpole", "num_envs": 16}
    record = {
        "spec": spec.to_dict(),
        "world_size": world_size,
        "num_nodes": 1,
        "device": device,
        "effective": effective,
    }
    (run / "run.json").write_text(json.dumps(record))
    save_checkpoint(run / "model_4.pt", {"iter": 4})
    return run


def test_a_continuation_keeps_what_it_does_not_name(tmp_path: Path) -> None:
    """Issue 41: every setting of the run the command does not name is the run's (a job's CPU
    ranks, its overrides, its log root), what it names is kept as named (then compared), and
    what it names of where the run is must be where it is."""
    run = _recorded_run(tmp_path / "logs", 2)
    argv = ["cartpole", "--max_iterations=8", "--no-video", "--run-dir", str(run)]
    argv += ["--agent.gamma", "0.95"]
    parsed = parse_command(TrainSpec, argv, None, lambda s, o: s.replace(overrides=o))
    assert not isinstance(parsed, int)
    spec, named = parsed
    assert spec == TrainSpec(
        run_dir=str(run), max_iterations=8, overrides=("--agent.gamma", "0.95")
    )
    # What the command set, from how it parsed: a default value given counts as set.
    assert named == {"task", "max_iterations", "video", "run_dir"}
    again = parse_command(TrainSpec, ["--seed", "42", "--video", "False"], None, lambda s, o: s)
    assert not isinstance(again, int) and again[1] == {"seed", "video"}
    got = continued(spec, named)
    assert (got.max_iterations, got.save_interval, got.num_envs, got.torch_threads) == (8, 2, 16, 1)
    assert got.num_procs == 2  # the job's two CPU ranks (--tasks-per-node 2): here --num-procs
    assert got.overrides == ("--agent.learning-rate", "0.001", "--agent.gamma", "0.95")
    assert got.log_root == str(tmp_path / "logs")
    named = continued(spec.replace(num_procs=1), frozenset({"num_procs", "run_dir"}))
    assert named.num_procs == 1 and named.max_iterations == 6  # compared, then refused
    assert continued(spec, frozenset({"run_dir"}), rank=True).num_procs == 1  # its launcher's
    job = continued(SubmitSpec(train=TrainSpec(run_dir=str(run))), frozenset({"run_dir"}))
    shape = (job.nodes, job.gpus_per_node, job.ranks_per_node, job.train.max_iterations)
    assert shape == (1, 0, 2, 6)
    for flag, value in (
        ("experiment_name", "other"),
        ("run_name", "x"),
        ("log_root", str(tmp_path / "elsewhere")),
    ):
        with pytest.raises(SpecError) as refused:
            continued(spec.replace(**{flag: value}), frozenset({flag, "run_dir"}))
        assert refused.value.flag == f"--{flag.replace('_', '-')}"
    # --num-procs 2 on a run of two ranks (a job's --tasks-per-node 2) is no change to say.
    notes: list[str] = []
    given = frozenset({"num_procs", "run_dir", "max_iterations"})
    target = resolve(continued(spec.replace(num_procs=2), given))
    resolved = continue_target(target, world=(2, "--num-procs"), say=notes.append)
    assert notes == [f"continuing {run}: --max-iterations 6 -> 8; --agent.gamma 0.9 -> 0.95"]
    assert resolved.train.num_procs == 2
    # The run target, decided once: this run, continued from its checkpoint.
    assert resolved.target == RunTarget(kind="continue", path=str(run.resolve()))
    assert resolved.train.run_dir == str(run.resolve())


def test_resume_of_nothing_is_an_error(tmp_path: Path) -> None:
    """Issue 41: `--resume --run-dir DIR` where DIR is empty or missing trains nothing new."""
    (tmp_path / "empty").mkdir()
    for name, what in (("empty", "holds no run"), ("missing", "does not exist")):
        proc = subprocess.run(
            [BIN / "mjlab-train", "cartpole", "--resume", "--run-dir", str(tmp_path / name)],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = " ".join(proc.stderr.split())
        assert proc.returncode == EXIT_BAD_INPUT and said.startswith("error: --resume:"), said
        assert what in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert list((tmp_path / "empty").iterdir()) == []

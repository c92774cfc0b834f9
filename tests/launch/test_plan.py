"""One plan per submission: the dry run, what is submitted and the rendered template agree.

The fast tier, through the commands as users run them (in this process): for a new run,
`--resume`, `--run-dir`, `--restart-from-scratch`, a profile, a sweep, a chain and a run
inside an allocation, `mjlab-submit --dry-run`, `mjlab-submit` (its scripts reach a
recording `sbatch`) and `mjlab-hpc render` agree on the run directory and on every #SBATCH
line. The Slurm test cluster submits and sbatches them for real
(tests/launch/test_chain_and_allocation.py::test_what_is_submitted_is_what_the_dry_run_shows,
tests/launch/test_slurm_jobs.py::test_rendered_template_with_sbatch). Also: where each value
of a continuation came from, and a profile's values on a continuation.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path

import pytest

from mjlab_hpc.cli.common import parse_command
from mjlab_hpc.cli.hpc import main as hpc_main
from mjlab_hpc.cli.submit import main as submit_main
from mjlab_hpc.launch.plan import plan_submission, realised
from mjlab_hpc.rundir.checkpoint import save_checkpoint
from mjlab_hpc.spec import SubmitSpec, TrainSpec
from mjlab_hpc.validate.continuation import continued

# The sbatch options that say where the batch script's own log goes: the submitted script's
# into the run's submitit folder (and submitit's mark), a template's where sbatch runs.
_LOG_OPTIONS = ("--output=", "--error=", "--wckey=")


def _run(root: Path, name: str, nodes: int = 1, damaged: bool = False) -> Path:
    """A run as a job of `nodes` nodes x 1 CPU rank left it (run.json, a checkpoint at 4)."""
    run = root / "cartpole" / name
    run.mkdir(parents=True)
    spec = TrainSpec(num_envs=16, max_iterations=6, seed=7, save_interval=2, log_root=str(root))
    record = {
        "spec": spec.to_dict(),
        "world_size": nodes,
        "num_nodes": nodes,
        "device": "cpu",
        "effective": {"experiment_name": "cartpole", "num_envs": 16},
    }
    (run / "run.json").write_text(json.dumps(record))
    if damaged:
        (run / "model_4.pt").write_bytes(b"not a checkpoint")
    else:
        save_checkpoint(run / "model_4.pt", {"iter": 4})
    return run


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with a log root, a config of the user's, and a recording sbatch."""
    bin_dir, record = tmp_path / "bin", tmp_path / "submitted"
    bin_dir.mkdir()
    record.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f'n=$(ls "{record}" | wc -l); n=$((n + 1)); cp "$1" "{record}/$n.sh"\n'
        'echo "Submitted batch job $((4700 + n))"\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    config = tmp_path / "xdg" / "mjlab-hpc" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        '[defaults]\nseed = 3\nsave-interval = 10\npartition = "site"\n\n'
        '[profile.wide]\nnodes = 1\ntasks-per-node = 2\ngpus-per-node = 0\nqos = "high"\n'
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    for name in ("SLURM_JOB_ID", "SLURM_CONF", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no git repository: no code snapshot
    return tmp_path


def _out(capsys: pytest.CaptureFixture[str], main, args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    got = capsys.readouterr()
    return code, got.out, got.err


def _scripts(dry_run: str) -> list[str]:
    parts = re.split(r"^# ---- sbatch script.*----\n", dry_run, flags=re.M)
    return [p.split("\n# ---- ")[0] for p in parts[1:]]


def _sbatch(script: str) -> list[str]:
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    return sorted(line for line in lines if not line[8:].startswith(_LOG_OPTIONS))


def _folder(script: str) -> Path:
    """The run (or sweep) directory a submitted script writes into."""
    return Path(re.search(r"--output=(\S+)/submitit/", script).group(1))  # type: ignore[union-attr]


def _template_run_dir(template: str) -> str:
    return shlex.split(re.search(r"^RUN_DIR=(.*)$", template, re.M).group(1) or "''")[0]  # type: ignore[union-attr]


CASES = {
    "new run": [],
    "--resume": ["--resume", "--max-iterations", "8"],
    "--run-dir": ["--run-dir", "{root}/logs/mine"],
    "--restart-from-scratch": ["--run-dir", "{damaged}", "--restart-from-scratch"],
    "a profile": ["--profile", "wide"],
    "a sweep": ["--sweep", "seed=1,2"],
    "a chain": ["--chain", "2"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_dry_run_what_is_submitted_and_the_template_agree(
    case: str, place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = place / "logs"
    run = _run(logs, "2026-01-01_00-00-00")
    damaged = _run(logs, "2025-01-01_00-00-00", damaged=True)
    hour_ago = time.time() - 3600  # --resume continues the run written last: `run`
    os.utime(damaged / "run.json", (hour_ago, hour_ago))
    extra = [a.format(root=place, damaged=damaged) for a in CASES[case]]
    args = ["cartpole", "--time", "10", "--log-root", str(logs), *extra]
    code, dry, err = _out(capsys, submit_main, [*args, "--executor", "slurm", "--dry-run"])
    assert code == 0, err
    planned = _scripts(dry)
    assert len(planned) == (2 if case == "a chain" else 1), dry
    expected = {
        "--resume": run,
        "--run-dir": logs / "mine",
        "--restart-from-scratch": damaged,
    }.get(case)
    if expected is not None:  # the run the command names: every view trains there
        assert _folder(planned[0]) == expected, planned[0]

    code, out, err = _out(capsys, hpc_main, ["render", "train", *args])
    if case in ("a sweep", "a chain"):
        flag = "--sweep" if case == "a sweep" else "--chain"
        assert code == 2 and err.startswith(f"error: {flag}: a template renders one job"), err
    else:
        assert code == 0, err
        assert _sbatch(out) == _sbatch(planned[0]), (out, planned[0])
        assert "#SBATCH --output=slurm-%x-%j.out\n" in out  # where sbatch runs
        if expected is not None:
            assert _template_run_dir(out) == str(expected)
        else:  # a new run: the job's first start makes it where the dry run plans it
            assert _template_run_dir(out) == ""
            key = f"--log-root {logs} --experiment cartpole"
            assert key in out and _folder(planned[0]).parent == logs / "cartpole"

    code, out, err = _out(capsys, submit_main, [*args, "--executor", "slurm"])
    assert code == 0, err
    sent = sorted((place / "submitted").iterdir(), key=lambda p: int(p.stem))
    assert len(sent) == len(planned)
    folder = _folder(sent[0].read_text())
    assert expected is None or folder == expected
    for n, (shown, script) in enumerate(zip(planned, sent, strict=True)):
        # The dry run's planned directory (named after its second) is the one made now; a
        # later job of the chain waits for the id the first got.
        shown = shown.replace(str(_folder(shown)), str(folder)).replace("JOB1", "4701")
        assert script.read_text() == shown, n
    assert folder.is_dir()


def test_inside_an_allocation_the_srun_trains_where_the_template_does(
    place: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside an allocation the dry run shows the srun that starts the ranks: it trains the
    run --resume continues, as the template for the same flags does, with the same arguments
    (every setting the run keeps decided here)."""
    run = _run(place / "logs", "2026-01-01_00-00-00", nodes=2)
    args = ["cartpole", "--resume"]
    args += ["--log-root", str(place / "logs")]
    code, out, err = _out(capsys, hpc_main, ["render", "train", *args])
    assert code == 0, err
    train = shlex.split(re.search(r"^train=\((.*) --run-dir", out, re.M).group(1))  # type: ignore[union-attr]
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    code, dry, err = _out(capsys, submit_main, [*args, "--dry-run"])
    assert code == 0, err
    srun = shlex.split(dry.split("(dry run: not started) ----\n")[1].splitlines()[0])
    srun = srun[srun.index("srun") :]
    assert srun[-2:] == ["--run-dir", str(run)] and _template_run_dir(out) == str(run)
    assert srun[srun.index("mjlab_hpc.cli.train") + 1 : -2] == train[1:]
    assert "--num-envs 16 --max-iterations 6 --seed 7" in " ".join(train)  # the run's own
    # What the ranks make of them: the run continued as planned, nothing taken or refused.
    parsed = parse_command(TrainSpec, [*train[1:], "--run-dir", str(run)], None, lambda s, o: s)
    assert not isinstance(parsed, int)
    spec, named = parsed
    assert continued(spec, named, rank=True) == spec and spec.num_envs == 16


def test_where_each_value_came_from_on_a_continuation(
    place: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 54: a continued run's own seed and save interval are said as kept from it, and
    the config file's [defaults] that they replaced as not applied; a profile's --nodes 1
    --tasks-per-node 2 likewise (the run keeps its 2 nodes x 1 rank), while the same flags
    typed change the layout (the same number of ranks)."""
    run = _run(place / "logs", "2026-01-01_00-00-00", nodes=2)
    config = place / "xdg" / "mjlab-hpc" / "config.toml"
    args = ["cartpole", "--executor", "slurm", "--run-dir", str(run)]
    code, dry, err = _out(capsys, submit_main, [*args, "--profile", "wide", "--dry-run"])
    assert code == 0, err
    said = dry.split("# ---- where each value came from")[1].split("\n# ---- ")[0]
    kept = f"kept from the run {run}"
    for line in (
        f"# seed = 7  ({kept}; seed = 3 of {config} [defaults] is not applied: the run keeps",
        f"# save-interval = 2  ({kept}; save-interval = 10 of {config} [defaults] is not",
        f"# num-envs = 16  ({kept})",
        f"# nodes = 2  ({kept}; nodes = 1 of {config} [profile.wide] is not applied",
        f"# tasks-per-node = 1  ({kept}; tasks-per-node = 2 of {config} [profile.wide] is",
        f'# partition = "site"  ({config} [defaults])',
        f'# qos = "high"  ({config} [profile.wide])',
        f'# run-dir = "{run}"  (typed)',
    ):
        assert line in said, said
    assert "[defaults])\n" not in said.split("# seed")[1].split("\n")[0]
    script = _scripts(dry)[0]
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=1\n" in script
    # Submitted, the console says the same.
    code, _, err = _out(capsys, submit_main, [*args, "--profile", "wide"])
    assert code == 0, err
    assert f"note: nodes = 1 of {config} [profile.wide] is not applied" in err, err
    assert f'site default: qos = "high"  ({config} [profile.wide])' in err, err
    # Typed, they change the run's layout (2 ranks either way).
    typed = ["--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "0", "--dry-run"]
    code, dry, err = _out(capsys, submit_main, [*args, *typed])
    assert code == 0, err
    script = _scripts(dry)[0]
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --ntasks-per-node=2\n" in script


def test_a_planned_name_taken_meanwhile_aims_the_scripts_at_the_next(place: Path) -> None:
    """A new run's directory is made at its planned name; where another run took that name
    since (the same second), at the next free one, and the plan's scripts are aimed there."""
    spec = SubmitSpec(train=TrainSpec(log_root=str(place / "logs")), gpus_per_node=0)
    plan = plan_submission(spec.replace(executor="slurm", dry_run=True))
    assert realised(plan).run_dir == plan.run_dir  # made where planned
    again = realised(plan)  # the same planned name, now taken
    assert again.run_dir == plan.run_dir.with_name(plan.run_dir.name + "-2")
    assert again.run_dir.is_dir() and again.resolved.target.path == str(again.run_dir)
    assert f"--output={again.run_dir}/submitit/" in again.jobs[0].script
    assert str(plan.run_dir) + "/" not in again.jobs[0].script

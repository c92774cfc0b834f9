"""Hostile and wrong input, property-based, in every string flag of a job script or a path.

For arbitrary text, each flag gives either a clean refusal (SpecError naming the flag) or
scripts (the sbatch template and submitit's own) that pass `bash -n` and keep their `#SBATCH`
block intact. Executed with stand-in srun / mjlab-hpc / mjlab-train, they run no injected
command and put the run under the log root.

Generated cases are derandomized (the same on every run) and include, besides arbitrary
Unicode, the payloads that break scripts: newlines and other control characters, quotes,
`$(...)`, backticks, `;`, `../`, `--option=` look-alikes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, recording_tools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.plan import job_plan, render
from mjlab_hpc.spec import SubmitSpec, TrainSpec

MARKER = "PWNED"
PAYLOADS = [
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"; touch {MARKER}",
    f"\ntouch {MARKER}\n",
    f"\rtouch {MARKER}",
    f"' ; touch {MARKER} ; '",
    f'" ; touch {MARKER} ; "',
    "../../escape",
    "/abs/path",
    "a/b",
    "..",
    ".",
    "",
    " ",
    "--requeue",
    "x --time=1",
    "#SBATCH --time=1",
    "\x00",
    "\x1b[31m",
    "\t",
    "ü💥",
    "${HOME}",
    "%j",
    "*",
    "?",
    "\\",
    "'",
    '"',
]
TEXT = st.one_of(
    st.sampled_from(PAYLOADS),
    st.lists(st.sampled_from(PAYLOADS), min_size=2, max_size=4).map("".join),
    st.text(st.characters(codec="utf-8"), max_size=40),
)
# Where each flag's text goes: a TrainSpec field, a SubmitSpec field, or a tuple field.
FLAGS = {
    "--run-name": ("train", "run_name"),
    "--experiment-name": ("train", "experiment_name"),
    "--log-root": ("train", "log_root"),
    "--job-name": ("submit", "job_name"),
    "--partition": ("submit", "partition"),
    "--account": ("submit", "account"),
    "--qos": ("submit", "qos"),
    "--constraint": ("submit", "constraint"),
    "--setup": ("submit-tuple", "setup"),
    "--after": ("submit-tuple", "after"),
    "--sbatch-arg": ("sbatch-arg", "sbatch_arg"),
    "--mem": ("submit", "mem"),
    "--time": ("submit", "time"),
    "--agent.learning_rate": ("override", "overrides"),
}
SLURM_DRY_RUN = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run"]
SLURM_DRY_RUN += ["--gpus-per-node", "0"]
SETTINGS = settings(
    max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "40")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def spec_with(flag: str, text: str, log_root: Path) -> SubmitSpec:
    where, field = FLAGS[flag]
    train = TrainSpec(task="cartpole", log_root=str(log_root), num_envs=16)
    submit: dict[str, object] = {
        "gpus_per_node": 0,
        "nodes": 2,
        "time": "30",
        "executor": "slurm",
        "dry_run": True,
    }
    if where == "train":
        train = dataclasses.replace(train, **{field: text})
    elif where == "override":
        train = dataclasses.replace(train, overrides=(f"{flag}={text}",))
    elif where == "submit":
        submit[field] = text
    elif where == "submit-tuple":
        submit[field] = (text,)
    else:
        submit[field] = (f"comment={text}",)
    return SubmitSpec(train=train, **submit)  # type: ignore[arg-type]


def sbatch_block_intact(script: str) -> None:
    """Every line from the shebang to the last `#SBATCH` line is a comment, an `#SBATCH`
    option or empty: no value broke out of its line."""
    lines = script.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    for line in lines[1 : last + 1]:
        assert line.startswith("#") or not line.strip(), line
    options = [
        re.match(r"#SBATCH --([a-z-]+)", line) for line in lines if line.startswith("#SBATCH")
    ]
    assert all(options), lines
    names = [m.group(1) for m in options if m]
    assert names.count("time") == 1 and names.count("signal") == 1, names


def run_script(script: str, work: Path, commands_allowed: bool = False) -> None:
    """Run the script as Slurm would, with stand-ins for what it calls; nothing injected
    may run (`commands_allowed`: a --setup line is a command by design)."""
    path = work / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, script
    record = work / "argv.txt"
    recording_tools(work / "bin", record, ("srun", "mjlab-train", "mjlab-hpc", "module", "python3"))
    env = {
        "PATH": f"{work / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(work),
        "SLURM_JOB_ID": "42",
    }
    subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, timeout=30)
    if not commands_allowed:
        assert not list(work.rglob(f"*{MARKER}*")), script


# The flags whose text is accepted run their rendered scripts: two groups of them, so that
# `make test-fast`'s two workers share them (the file's other tests stay in its group).
_SPREAD = {
    "--sbatch-arg": "a",
    "--setup": "a",
    "--run-name": "a",
    "--job-name": "b",
    "--log-root": "b",
    "--experiment-name": "b",
}


@pytest.mark.parametrize(
    "flag",
    [
        pytest.param(f, marks=[pytest.mark.xdist_group(f"hostile-input-{_SPREAD[f]}")])
        if f in _SPREAD
        else f
        for f in sorted(FLAGS)
    ],
)
def test_arbitrary_text_is_refused_or_stays_in_its_place(flag: str, tmp_path: Path) -> None:
    log_root = tmp_path / "logs"
    cases: list[str] = []

    @SETTINGS
    @given(text=TEXT)
    def check(text: str) -> None:
        cases.append(text)
        work = tmp_path / f"case{len(cases)}"
        work.mkdir()
        spec = spec_with(flag, text, log_root)
        try:
            plan = job_plan(spec, warn=lambda message: None)
            template = render("train", plan)
        except SpecError as exc:
            # A refusal names a flag; the text itself may be what broke another check
            # (a run name that is fine alone can make the job name or path too long).
            assert exc.flag.startswith("-") or exc.flag == "TASK", exc
            return
        root = Path(spec.train.log_root).resolve()
        assert plan.run_dir.resolve().is_relative_to(root), (plan.run_dir, root)
        submitit = plan.jobs[0].script
        for script in (template, submitit):
            sbatch_block_intact(script)
            if flag == "--setup":  # one shell line by design: it stays one line
                assert sum(line == text for line in script.splitlines()) == 1, script
            run_script(script, work, commands_allowed=flag == "--setup")
            shutil.rmtree(work / "bin")

    check()
    # Hypothesis tried the examples asked for (distinct texts: not one string again and again).
    wanted = SETTINGS.max_examples
    assert len(cases) >= wanted and len(set(cases)) >= wanted // 2, (flag, len(set(cases)))


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--run-name", "a\nb"], "--run-name", "control character"),
        (["--experiment-name", "../../x"], "--experiment-name", "plain name"),
        (["--experiment-name", "/abs"], "--experiment-name", "plain name"),
        (["--experiment-name", "a/b"], "--experiment-name", "plain name"),
        (["--run-name", "r" * 300], "--run-name", "too long"),
        (["--partition", "gpu\n#SBATCH --time=9"], "--partition", "control character"),
        (["--partition", "gpu --time=1"], "--partition", "not a Slurm name"),
        (["--sbatch-arg", "time=10"], "--sbatch-arg", "use --time"),
        (["--sbatch-arg", "signal=USR1@10"], "--sbatch-arg", "--preempt-signal"),
        (["--sbatch-arg", "mail-tpye=END"], "--sbatch-arg", "did you mean mail-type"),
        (["--sbatch-arg", "comment=a\nb"], "--sbatch-arg", "control character"),
        (["--time", "25:61:00"], "--time", "not a valid number of minutes"),
        (["--time", "10000000000"], "--time", "more than 365 days"),
        (["--setup", "echo 'unterminated"], "--setup", "not a complete shell line"),
        (["--sweep", "preempt-signal=USR1,USR2"], "--sweep", "cannot be swept"),
        # Found by a hostile-input probe after the first round:
        (["--mem", "64G\n"], "--mem", "not a Slurm memory size"),
        (["--mem", "\u0666\u0664G"], "--mem", "not a Slurm memory size"),
        (["--time", "30\n"], "--time", "not a Slurm time limit"),
        (["--run-name", "x "], "--run-name", "white space"),
        (["--run-name", "x\u2028y"], "--run-name", "control character"),
        (["--run-name", "x\x85y"], "--run-name", "control character"),
        (["--setup", "cat <<EOF"], "--setup", "here-document"),
        (["--setup", "echo \\"], "--setup", "continued into the next line"),
        (["--sbatch-arg", "time-min=5"], "--sbatch-arg", "use --time"),
        (["--mem", "4G", "--sbatch-arg", "mem-per-cpu=1G"], "--sbatch-arg", "use --mem"),
        (["--sbatch-arg", "gres=gpu:a100:4"], "--sbatch-arg", "use --gpus-per-node"),
        (["--preempt-signal", "INT"], "--preempt-signal", "use one of"),
        (["--sbatch-arg", "input=/etc/passwd"], "--sbatch-arg", "set by mjlab-submit"),
        (["--sbatch-arg", "clusters=other"], "--sbatch-arg", "set by mjlab-submit"),
        (["--sbatch-arg", "mail-type"], "--sbatch-arg", "needs a value"),
        (["--job-name", "../../x"], "--job-name", "holds '/'"),
        (["--run-dir", "/etc"], "--run-dir", "holds files but no run"),
        (["--run-dir", ""], "--run-dir", "must not be empty"),
        (["--log-root", "/dev/null"], "--log-root", "is a file"),
        (["--log-root", "~/x"], "--log-root", "'~' is not expanded"),
        (["--seed", "99999999999999999999"], "--seed", "must be at most"),
        (["--num-envs", "99999999999999999999"], "--num-envs", "must be at most"),
        (["--torch-threads", "99999999999999999999"], "--torch-threads", "must be at most"),
        (["--dist-timeout-s", "nan"], "--dist-timeout-s", "must be between 1 and"),
        (["--dist-timeout-s", "1e-9"], "--dist-timeout-s", "between 1 and 2.592e+06 seconds"),
        (["--dist-timeout-s", "1e300"], "--dist-timeout-s", "must be between 1 and"),
        (["--hang-timeout-s", "0"], "--hang-timeout-s", "`none` disables"),
        (["--hang-timeout-s", "-5"], "--hang-timeout-s", "must be between 1 and"),
        (["--hang-timeout-s=inf"], "--hang-timeout-s", "must be between 1 and"),
        (["--save-every-min", "0"], "--save-every-min", "between 0.0166667 and 43200 minutes"),
        (["--save-every-min", "nan"], "--save-every-min", "must be between"),
        (["--nodes", "99999999999"], "--nodes", "at most"),
        (["--agent.learning_rate", "nan"], "--agent.learning_rate", "nan and inf"),
        (["--agent.learning_rate=-inf"], "--agent.learning_rate", "nan and inf"),
        (["--agent.learning-rate", "1e6"], "--agent.learning-rate", "at most 1"),
        (["--agent.algorithm.learning_rate=0"], "--agent.algorithm.learning_rate", "> 0"),
        (["--sweep", "seed=4,04"], "--sweep", "the same value"),
        (["--sweep", "device=cuda,cpu"], "--sweep", "cannot be swept"),
        (["--after", "12;rm -rf x"], "--after", "not a Slurm job id"),
        (["--after", "12\n"], "--after", "not a Slurm job id"),
        (["--after", "afterok:12"], "--after", "not a Slurm job id"),
        (["--chain", "0"], "--chain", "between 1 and 1000"),
        (["--chain", "99999999999"], "--chain", "between 1 and 1000"),
        (["--sbatch-arg", "dependency=afterok:1"], "--sbatch-arg", "use --after"),
        (["--executor", "local", "--chain", "2"], "--chain", "local executor"),
        (["--executor", "allocation"], "--executor", "in no Slurm allocation"),
        # Issue 41: invisible characters that reorder or hide what ls and status show.
        (["--run-name", "abc\u202edef"], "--run-name", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
        (["--experiment-name", "a\u200bb"], "--experiment-name", "ZERO WIDTH SPACE"),
        (["--setup", "echo \ufeffx"], "--setup", "ZERO WIDTH NO-BREAK SPACE"),
        (["--run-name", "a\udcffb"], "--run-name", "not UTF-8"),
    ],
)
def test_wrong_values_exit_2_naming_the_flag(
    tmp_path: Path, args: list[str], flag: str, words: str
) -> None:
    proc = subprocess.run(
        [*SLURM_DRY_RUN, "--log-root", str(tmp_path / "logs"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr
    assert f"error: {flag}" in said and words in said, said
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["run-dir", "--experiment", "../../escaped", "--key", "k1"], "--experiment"),
        (["run-dir", "--experiment", "..", "--key", "k1"], "--experiment"),
        (["run-dir", "--key", "k\n3"], "--key"),
        (["run-dir", "--run-name", "/../../x", "--key", "k1"], "--run-name"),
        (["run-dir", "--run-name", "x ", "--key", "k1"], "--run-name"),
        (["status", "--watch", "--interval-s", "nan"], "--interval-s"),
        (["status", "--watch", "--interval-s", "0"], "--interval-s"),
        (["status", "--limit", "-1"], "--limit"),
        (["logs", "x", "--lines", "-1"], "--lines"),
        (["cancel", "x", "--grace-s", "-5"], "--grace-s"),
        (["doctor", "--wait-s", "0"], "--wait-s"),
        (["doctor", "--nodes", "0"], "--nodes"),
        (["doctor", "--after", "x"], "--after"),
    ],
)
def test_mjlab_hpc_subcommands_refuse_what_they_cannot_use(
    tmp_path: Path, args: list[str], flag: str
) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-hpc", *args, "--log-root", str(tmp_path / "logs")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {flag}:"), proc.stderr
    assert "Traceback" not in proc.stderr and not any(tmp_path.iterdir())


def test_render_fails_cleanly_too(tmp_path: Path) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-hpc", "render", "train", "cartpole", "--run-name", "x\ntouch PWNED"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--run-name" in proc.stderr and proc.stdout == ""


@pytest.mark.mjlab  # the guess is made among mjlab's tasks too
def test_a_task_typo_is_answered_with_a_guess(tmp_path: Path) -> None:
    proc = subprocess.run(
        [BIN / "mjlab-train", "cartpol", "--log-root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "did you mean 'cartpole'?" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--sbatch-arg", "gres=lscratch:100"],  # a generic resource that is no GPU
        ["--sbatch-arg", "exclusive=user"],
        ["--sbatch-arg", "mem-per-cpu=4G"],  # without --mem
        ["--sbatch-arg", "mail-type=END", "--sbatch-arg", "mail-user=me@example.org"],
        ["--sbatch-arg", "overcommit"],
        ["--partition", "gpu,gpu-preempt"],
        ["--setup", "source ~/venv/bin/activate"],
        ["--setup", "module load cuda/12.4"],
        ["--setup", "export NCCL_DEBUG=INFO"],
        ["--setup", "conda activate mjlab"],
        ["--setup", "cat <<< 'here-string'"],
        ["--run-name", "ablation-a", "--job-name", "my job (v2)"],
        ["--run-name", "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"],  # Persian: a ZWNJ
        ["--after", "4711", "--after", "4712_3", "--chain", "3"],
    ],
)
def test_real_options_are_not_refused(tmp_path: Path, args: list[str]) -> None:
    """What users write on real clusters passes the checks (no false refusals)."""
    proc = subprocess.run(
        [*SLURM_DRY_RUN, "--log-root", str(tmp_path / "logs"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    scripts = proc.stdout[proc.stdout.index("#!/bin/bash") :].split("\n# ---- sbatch script")
    assert len(scripts) == (3 if "--chain" in args else 1), proc.stdout  # every job's
    for script in scripts:
        sbatch_block_intact(script[script.index("#!/bin/bash") :])

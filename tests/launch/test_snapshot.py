"""The code snapshot of a submission.

What is copied from a git repository: tracked files, untracked ones git does not ignore,
symlinks and odd names, not ignored or deleted files; and what is refused. A real local job is
submitted from a checkout that is edited right after submitting: both of its starts (the
first, and the one the healer requeues after a crash) import the code as it was at submit
time, from the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run, wait_for

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir import snapshot as snap
from mjlab_hpc.rundir.snapshot import plan_snapshot, record_code, snapshot_for

PACKAGE = Path(__file__).resolve().parents[2] / "mjlab_hpc"
MARKER = "SNAPSHOT-MARKER"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_what_a_snapshot_copies_and_records(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("data/\n*.log\n")
    (repo / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    fresh = plan_snapshot(repo)  # a repository without commits: its files, no commit
    assert not isinstance(fresh, str) and fresh.commit is None
    assert "pkg/__init__.py" in fresh.files
    (repo / "pkg" / "gone.py").write_text("")
    (repo / "pkg" / "a name\nwith newline.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    (repo / "pkg" / "gone.py").unlink()  # deleted in the checkout: not copied
    (repo / "pkg" / "__init__.py").write_text("VALUE = 2\n")  # uncommitted change
    (repo / "new.py").write_text("NEW = True\n")  # untracked, not ignored
    (repo / "link.py").symlink_to("new.py")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(b"0" * 1000)  # ignored
    (repo / "run.log").write_text("ignored")
    plan = plan_snapshot(repo / "pkg")  # from a folder inside the repository
    assert not isinstance(plan, str), plan
    assert plan.root == repo.resolve()
    odd = "pkg/a name\nwith newline.py"
    assert sorted(plan.files) == sorted([".gitignore", "pkg/__init__.py", odd, "new.py", "link.py"])
    run = tmp_path / "run"
    record = record_code(plan, run)
    copy = run / "code" / "src"
    assert (copy / "pkg" / "__init__.py").read_text() == "VALUE = 2\n"
    assert (copy / "link.py").is_symlink() and (copy / "link.py").read_text() == "NEW = True\n"
    assert not (copy / "data").exists() and not (copy / "pkg" / "gone.py").exists()
    assert record["dirty"] and record["commit"] and record["untracked"] == ["link.py", "new.py"]
    assert "+VALUE = 2" in (run / "code" / "changes.diff").read_text()
    assert snapshot_for(run) == json.loads((run / "code" / "snapshot.json").read_text())

    outside = plan_snapshot(tmp_path)
    assert isinstance(outside, str) and "not in a git repository" in outside
    off = tmp_path / "off"
    assert record_code(plan_snapshot(repo, off=True), off)["copy"] is None
    assert snapshot_for(off) is None


def test_import_roots_are_folders_the_copy_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    site = repo / ".venv" / "lib" / "site-packages"  # a venv inside the checkout, ignored
    site.mkdir(parents=True)
    (repo / "src" / "tasks").mkdir(parents=True)
    (repo / "src" / "tasks" / "__init__.py").write_text("")
    (repo / ".gitignore").write_text(".venv/\n")
    _git(repo, "init", "-q")
    monkeypatch.setattr("sys.path", [str(site), *sys.path])
    plan = plan_snapshot(repo)
    assert not isinstance(plan, str)
    # Not the ignored venv (it would stand in for the copy): the fallback, top and src/.
    assert plan.roots == (".", "src")
    monkeypatch.setattr("sys.path", [str(repo / "src"), str(site), *sys.path])
    plan = plan_snapshot(repo)
    assert not isinstance(plan, str) and plan.roots == ("src",)
    record = record_code(plan, tmp_path / "run")
    assert snap.import_path(record) == str((tmp_path / "run" / "code" / "src" / "src").resolve())


def test_a_repository_of_data_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "weights.bin").write_bytes(b"0" * 4096)
    monkeypatch.setattr(snap, "MAX_BYTES", 1024)
    with pytest.raises(
        SpecError, match=r"--no-snapshot: the repository .* add data to \.gitignore"
    ):
        plan_snapshot(repo)


@pytest.mark.training
def test_a_job_runs_the_code_of_submit_time_through_a_requeue(tmp_path: Path) -> None:
    repo = tmp_path / "checkout"
    shutil.copytree(PACKAGE, repo / "mjlab_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / ".gitignore").write_text("__pycache__/\n")
    task = repo / "mjlab_hpc" / "tasks" / "cartpole.py"
    text = task.read_text()
    head = "from __future__ import annotations\n"
    task.write_text(
        text.replace(head, head + f"import sys as _s\n_s.stderr.write('{MARKER} old\\n')\n", 1)
    )
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "the user's code")
    logs = tmp_path / "logs"
    # Rank 0 raises at iteration 2 of the first start: the healer requeues the job.
    env = cli_env({"MJLAB_HPC_FAULT": "raise@2:rank0:once"})
    cmd = [str(BIN / "mjlab-submit"), "cartpole", "--executor", "local", "--gpus-per-node", "0"]
    cmd += ["--num-envs", "16", "--max-iterations", "4", "--torch-threads", "1"]
    cmd += ["--log-root", str(logs)]
    proc = subprocess.run(
        cmd,
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    task.write_text(task.read_text().replace(f"{MARKER} old", f"{MARKER} new"))  # edited now
    run = only_run(logs)

    def done() -> dict | None:
        record = json.loads(run.record.read_text()) if run.record.exists() else {}
        return record if record.get("state") == "completed" else None

    record = wait_for(done, 150, "the job to complete after its requeue")
    assert len(record["starts"]) == 2 and record["faults"][0]["reason"] == "crash", record
    code = record["code"]
    assert code["ran_from"] == str(run.path / "code" / "src" / "mjlab_hpc")
    assert code["imported_from"] == {"mjlab_hpc": str(run.path / "code" / "src" / "mjlab_hpc")}
    # Clean at submit time: the edit came after.
    assert code["repository"] == str(repo.resolve()) and code["commit"] and not code["dirty"]
    said = "".join(p.read_text() for p in (run.path / "submitit").glob("*_0_log.err"))
    assert said.count(f"{MARKER} old") == 2 and f"{MARKER} new" not in said, said


def test_a_dry_run_shows_the_snapshot_lines_the_job_will_have(tmp_path: Path) -> None:
    repo = tmp_path / "tasks"
    (repo / "my_tasks").mkdir(parents=True)
    (repo / "my_tasks" / "__init__.py").write_text("")
    _git(repo, "init", "-q")
    tools = tmp_path / "bin"  # git, and no sbatch: a laptop; --nodes 2 asks for Slurm
    tools.mkdir()
    (tools / "git").symlink_to(shutil.which("git") or "/usr/bin/git")
    env = cli_env(path=f"{BIN}{os.pathsep}{tools}")
    base = [str(BIN / "mjlab-submit"), "cartpole", "--nodes", "2", "--gpus-per-node", "0"]
    base += ["--log-root", str(tmp_path / "logs"), "--dry-run"]
    proc = subprocess.run(base, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    path = next(line for line in lines if line.startswith("export PYTHONPATH="))
    assert "/code/src" in path and str(tmp_path / "logs" / "cartpole") in path, path
    assert "export PYTHONSAFEPATH=1" in lines
    assert not (tmp_path / "logs").exists()  # a dry run makes nothing
    proc = subprocess.run(
        [*base, "--no-snapshot"], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "PYTHONPATH" not in proc.stdout, proc.stdout

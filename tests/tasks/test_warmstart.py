"""Where a run started from another run finds its checkpoint, and mjlab's spelling of booleans.

The flags are mjlab's --agent.resume True, --agent.load-run, --agent.load-checkpoint and
--wandb-run-path, and mjlab's W&B logger without a login. No training: real folders and the
real W&B client (without network or login here).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env

from mjlab_hpc.cli.common import mjlab_booleans, resume_command
from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import SubmitSpec, TrainSpec
from mjlab_hpc.tasks.warmstart import (
    CHECKPOINT_CACHE,
    fetch_wandb_checkpoint,
    find_run_checkpoint,
    wandb_login_problem,
)


def _files(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"x")
    return folder


def test_the_latest_run_with_a_matching_checkpoint_is_chosen_as_mjlab_chooses(
    tmp_path: Path,
) -> None:
    exp = tmp_path / "cartpole"
    old = _files(
        exp / "2026-01-01_00-00-00",
        "model_50.pt",
        "model_100.pt",
        "model_100.pt.sha256",
        "model_150.pt.damaged",
        ".model_200.pt.1.tmp",
    )
    _files(exp / "2026-01-02_00-00-00_crashed-early", "progress.jsonl")  # no checkpoint yet
    _files(exp / "wandb_checkpoints" / "abc", "model_999.pt")  # mjlab's W&B cache: not a run
    _files(exp / CHECKPOINT_CACHE / "abc", "model_999.pt")
    _files(exp / ".keys")
    # mjlab's order: model_100 after model_50 (shorter numbers first), sidecars ignored.
    assert find_run_checkpoint(exp, ".*", "model_.*.pt") == old / "model_100.pt"
    assert find_run_checkpoint(exp, "2026-01-01", "model_50.pt") == old / "model_50.pt"
    with pytest.raises(SpecError, match=r"--agent\.load-checkpoint"):
        find_run_checkpoint(exp, ".*", "model_.*.pt", exclude=old)  # the run being continued
    with pytest.raises(SpecError, match=r"--agent\.load-run.*matches 'nope'"):
        find_run_checkpoint(exp, "nope", "model_.*.pt")
    with pytest.raises(SpecError, match=r"--agent\.load-run.*not a regular expression"):
        find_run_checkpoint(exp, "(", "model_.*.pt")
    with pytest.raises(SpecError, match=r"--agent\.load-run"):
        find_run_checkpoint(tmp_path / "nothing-here", ".*", "model_.*.pt")


def test_a_downloaded_wandb_checkpoint_needs_no_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cache = _files(tmp_path / CHECKPOINT_CACHE / "run1", "model_50.pt", "model_100.pt")
    named = fetch_wandb_checkpoint(tmp_path, "ent/proj/run1", "model_50.pt")
    assert named == cache / "model_50.pt"
    # "The newest" needs W&B; unreachable, the newest downloaded one stands for it.
    assert fetch_wandb_checkpoint(tmp_path, "ent/proj/run1/") == cache / "model_100.pt"
    with pytest.raises(SpecError, match=r"--wandb-run-path: cannot fetch .*'ent/proj/run2'"):
        fetch_wandb_checkpoint(tmp_path, "ent/proj/run2")
    assert not (tmp_path / CHECKPOINT_CACHE / "run2").exists()


def test_mjlabs_spelling_of_booleans_is_ours_too() -> None:
    args = ["T", "--video", "True", "--enable_nan_guard=false", "--agent.resume", "True"]
    args += ["--resume", "--use-graph", "False", "--video-length", "True"]
    ours = ["T", "--video", "--no-enable-nan-guard", "--agent.resume", "True", "--resume"]
    ours += ["--no-use-graph", "--video-length", "True"]
    assert mjlab_booleans(TrainSpec, args) == ours
    # mjlab-submit: the training flags sit at its top level.
    submitted = mjlab_booleans(SubmitSpec, ["T", "--video", "true", "--follow", "False"])
    assert submitted == ["T", "--video", "--no-follow"]
    command = resume_command(
        "mjlab-train", ["T", "--resume", "True", "--run-dir", "old", "--video", "True"], "run"
    )
    assert command == "mjlab-train T --video True --run-dir run"


@pytest.mark.mjlab
def test_wandb_without_a_login_is_refused_before_the_run_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in cli_env().items() if not k.startswith(("WANDB_", "NETRC"))}
    train = [BIN / "mjlab-train", "Mjlab-Cartpole-Balance", "--agent.max-iterations", "1"]
    train += ["--env.scene.num-envs", "4", "--log-root", tmp_path / "logs"]
    proc = subprocess.run(
        train, env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--agent.logger" in proc.stderr and "wandb login" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "logs").exists()
    # What wandb itself accepts is enough: `wandb login`'s netrc entry, offline mode, a key.
    for name in [k for k in os.environ if k.startswith(("WANDB_", "NETRC"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    assert wandb_login_problem() is not None
    (home / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    (home / ".netrc").chmod(0o600)
    assert wandb_login_problem() is None
    (home / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_login_problem() is None

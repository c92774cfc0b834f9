"""Checkpoints: a SIGKILL during writes never leaves a broken newest checkpoint, damaged
checkpoints are skipped, retention keeps the newest."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mjlab_hpc.rundir.checkpoint import Checkpoints, load_verified, save_checkpoint
from mjlab_hpc.rundir.layout import list_checkpoints


@pytest.mark.training
def test_sigkill_during_checkpoint_writes_keeps_a_valid_one(tmp_path: Path) -> None:
    """A writer SIGKILLed at random moments while writing checkpoints: the newest checkpoint
    on disk always loads, and no truncated file ever carries a checkpoint's name."""
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from mjlab_hpc.rundir.checkpoint import save_checkpoint\n"
        "d = Path(sys.argv[1]); n = int(sys.argv[2])\n"
        "print('ready', flush=True)\n"
        "for i in range(n, n + 1000):\n"
        "    save_checkpoint(d / f'model_{i}.pt', {'iter': i, 'w': torch.full((400_000,), i)})\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_checkpoint(run_dir / "model_0.pt", {"iter": 0, "w": torch.zeros(400_000)})
    rng = random.Random(0)
    newest = []
    for trial in range(6):
        p = subprocess.Popen(
            [sys.executable, str(writer), str(run_dir), str(1000 * (trial + 1))],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert p.stdout is not None and p.stdout.readline() == "ready\n"  # imports done
        time.sleep(rng.uniform(0.05, 0.6))  # into the writes
        p.kill()
        p.wait()
        path, damaged = Checkpoints(run_dir).newest_valid()
        assert path is not None and not damaged
        assert path == list_checkpoints(run_dir)[-1]  # the newest name is never a broken file
        ckpt = load_verified(path)
        assert torch.equal(ckpt["w"], torch.full((400_000,), ckpt["iter"]))
        newest.append(ckpt["iter"])
    # The writer really wrote: most kills landed after some checkpoints of that trial.
    assert sum(n >= 1000 for n in newest) >= 4, newest


def test_corrupt_newest_checkpoint_is_skipped(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        save_checkpoint(tmp_path / f"model_{i}.pt", {"iter": i, "w": torch.arange(1000) * i})
    newest = tmp_path / "model_3.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # truncated after the fact
    data = bytearray((tmp_path / "model_2.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (tmp_path / "model_2.pt").write_bytes(bytes(data))
    path, damaged = Checkpoints(tmp_path).newest_valid()
    assert path is not None and path.name == "model_1.pt"
    assert load_verified(path)["iter"] == 1
    assert [(d.name, "does not match its checksum" in d.why) for d in damaged] == [
        ("model_3.pt", True), ("model_2.pt", True)]  # fmt: skip


def test_keep_last_n_counts_only_checkpoints_that_verify(tmp_path: Path) -> None:
    for i in range(1, 6):
        save_checkpoint(tmp_path / f"model_{i}.pt", {"iter": i})
    (tmp_path / "model_5.pt").write_bytes(b"torn")  # the newest is damaged
    checkpoints = Checkpoints(tmp_path)
    deleted = checkpoints.prune(2)
    # Two valid ones are kept (3, 4); the damaged one is neither counted nor deleted.
    assert [p.name for p in deleted] == ["model_1.pt", "model_2.pt"]
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "model_3.pt",
        "model_4.pt",
        "model_5.pt",
    ]
    assert not (tmp_path / "model_1.pt.sha256").exists()
    assert checkpoints.prune(0) == []
    valid, damaged = checkpoints.newest_valid()
    assert valid is not None and valid.name == "model_4.pt"
    assert [d.name for d in damaged] == ["model_5.pt"]
    checkpoints.set_aside(damaged)
    assert (tmp_path / "model_5.pt.damaged").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["model_3.pt", "model_4.pt"]

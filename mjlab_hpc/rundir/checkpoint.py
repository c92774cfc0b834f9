"""Checkpoints that a SIGKILL at any moment cannot corrupt.

A checkpoint is written to a temporary file, fsynced, renamed over its final name and the
directory fsynced; a sidecar `<name>.sha256` written just before lets a load detect a file
damaged later (a bad disk, a partial copy). Loading walks from the newest checkpoint back and
skips, with a warning, any that is truncated or does not match its checksum.

The files stay plain `torch.save` archives, so rsl-rl's and mjlab's own `load()` read them.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mjlab_hpc.rundir.durable import publish, write_atomic
from mjlab_hpc.rundir.layout import CHECKSUM_SUFFIX, list_checkpoints

__all__ = ["latest_valid", "load_verified", "prune", "publish_file", "save_checkpoint"]


log = logging.getLogger("mjlab_hpc")


def save_checkpoint(
    path: Path, state: dict[str, Any], before_rename: Callable[[], None] | None = None
) -> None:
    """Save `state` atomically with its checksum sidecar."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(path.with_name(path.name + CHECKSUM_SUFFIX), f"{digest}\n".encode())
    write_atomic(path, data, before_rename)


def publish_file(tmp: Path, path: Path, before_rename: Callable[[], None] | None = None) -> None:
    """Publish a checkpoint some other code wrote to `tmp` (mjlab's runners write their own):
    its checksum sidecar first, then `before_rename`, then the durable rename to `path`."""
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    write_atomic(path.with_name(path.name + CHECKSUM_SUFFIX), f"{digest}\n".encode())
    publish(tmp, path, before_rename)


def load_verified(path: Path, map_location: str | None = None) -> dict[str, Any]:
    """Load one checkpoint, raising ValueError if it is truncated or fails its checksum."""
    data = path.read_bytes()
    sidecar = path.with_name(path.name + CHECKSUM_SUFFIX)
    if sidecar.exists():
        expected = sidecar.read_text().strip()
        if hashlib.sha256(data).hexdigest() != expected:
            raise ValueError(f"{path.name} does not match its checksum (damaged or truncated)")
    try:
        loaded = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as exc:
        raise ValueError(f"{path.name} cannot be read: {exc}") from None
    if not isinstance(loaded, dict) or "iter" not in loaded:
        raise ValueError(f"{path.name} is not a training checkpoint")
    return loaded


def latest_valid(
    run_dir: Path, map_location: str | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies, skipping damaged ones with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_verified(path, map_location)
        except (ValueError, OSError) as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all); returns the deleted."""
    if keep_last <= 0:
        return []
    old = list_checkpoints(run_dir)[:-keep_last]
    for path in old:
        path.unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)
    return old

"""Checkpoints that a SIGKILL at any moment cannot corrupt, and only verified ones counted.

Written to a temporary file, fsynced, renamed and the directory fsynced, with a `<name>.sha256`
sidecar; a checkpoint verifies when its bytes match its sidecar (or, written by other code,
when it loads) and so do its ranks' state files (`rank_states/model_<n>/`: each rank writes
its own, the writer publishes them, then the model file). Resuming takes the newest that
verifies, retention keeps the newest N that do, and a damaged one is set aside (`.damaged`),
never preferred. The files stay plain `torch.save` archives that rsl-rl's and mjlab's `load()`
read; torch loads only to write or read one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir.durable import fsync_dir, publish, temp_path, write_atomic, write_new
from mjlab_hpc.rundir.layout import (
    CHECKSUM_SUFFIX,
    list_checkpoints,
    rank_state_dir,
    rank_state_file,
)
from mjlab_hpc.rundir.state import read_record

__all__ = [
    "DAMAGED_SUFFIX",
    "Checkpoints",
    "Damaged",
    "cannot_continue",
    "load_rank_state",
    "load_verified",
    "publish_file",
    "publish_rank_states",
    "rank_state_world_size",
    "save_checkpoint",
    "write_rank_state",
]

log = logging.getLogger("mjlab_hpc")

_DIGEST = re.compile(r"[0-9a-f]{64}")
#: A damaged checkpoint set aside keeps its name with this suffix (listings ignore it).
DAMAGED_SUFFIX = ".damaged"


_RANK_FILE = re.compile(r"rank(\d+)-of-(\d+)\.pt")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def _serialize(state: Any) -> bytes:
    import torch  # heavy: only where a checkpoint is written

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def save_checkpoint(
    path: Path, state: dict[str, Any], before_rename: Callable[[], None] | None = None
) -> str:
    """Save `state` atomically with its checksum sidecar; the checksum."""
    data = _serialize(state)
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(_sidecar(path), f"{digest}\n".encode())
    try:
        write_atomic(path, data, before_rename)
    except BaseException:
        if not path.exists():  # no sidecar without its checkpoint (a full disk, a lost lock)
            _sidecar(path).unlink(missing_ok=True)
        raise
    return digest


def publish_file(
    tmp: Path, path: Path, before_rename: Callable[[], None] | None = None,
    digest: str | None = None,
) -> str:  # fmt: skip
    """Publish a checkpoint some other code wrote to `tmp` (mjlab's runners write their own):
    its checksum sidecar first, then `before_rename`, then the durable rename to `path`; the
    checksum (`digest`: known already)."""
    digest = digest or hashlib.sha256(tmp.read_bytes()).hexdigest()
    write_atomic(_sidecar(path), f"{digest}\n".encode())
    try:
        publish(tmp, path, before_rename)
    except BaseException:
        if not path.exists():
            _sidecar(path).unlink(missing_ok=True)
        raise
    return digest


def write_rank_state(checkpoint: Path, rank: int, world_size: int, state: Any) -> tuple[str, str]:
    """One rank's state of `checkpoint`, written by that rank to a temporary file beside its
    place and fsynced, not published: (temporary path, sha256) for the writer."""
    path = rank_state_file(checkpoint, rank, world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _serialize(state)
    tmp = temp_path(path)
    try:
        write_new(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(tmp), hashlib.sha256(data).hexdigest()


def publish_rank_states(
    checkpoint: Path, written: list[tuple[str, str]], before_rename: Callable[[], None]
) -> None:
    """The writer: publish every rank's `write_rank_state` (fenced, with checksums), before
    the checkpoint itself."""
    for rank, (tmp, digest) in enumerate(written):
        publish_file(Path(tmp), rank_state_file(checkpoint, rank, len(written)), before_rename,
                     digest)  # fmt: skip


def load_rank_state(checkpoint: Path, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state of `checkpoint`, verified (ValueError when it does not verify)."""
    import torch

    path = rank_state_file(checkpoint, rank, world_size)
    data = path.read_bytes()
    if not _check_bytes(path, data):
        raise ValueError(f"{path.name} has no checksum")
    return dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=False))


def _rank_states_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint's rank states do not verify (None: they do, or it has none)."""
    folder = rank_state_dir(checkpoint)
    if not folder.is_dir():
        return None
    found = [m for p in folder.iterdir() if (m := _RANK_FILE.fullmatch(p.name))]
    sizes = {int(m[2]) for m in found}
    ranks = {int(m[1]) for m in found}
    if len(sizes) != 1 or ranks != set(range(next(iter(sizes)))):
        return f"{checkpoint.name}'s rank states in {folder.name}/ are incomplete"
    for m in found:
        path = folder / m[0]
        try:
            if not _check_bytes(path, path.read_bytes()):
                return f"{path.name} of {checkpoint.name} has no checksum"
        except ValueError as exc:
            return f"{exc} ({checkpoint.name}'s rank state)"
    return None


def rank_state_world_size(checkpoint: Path) -> int | None:
    """How many ranks wrote `checkpoint`'s rank states (None: it has none)."""
    folder = rank_state_dir(checkpoint)
    found = {int(m[2]) for p in (folder.iterdir() if folder.is_dir() else ())
             if (m := _RANK_FILE.fullmatch(p.name))}  # fmt: skip
    return found.pop() if len(found) == 1 else None


def _check_bytes(path: Path, data: bytes) -> bool:
    """Whether `data` matches the sidecar (True: it does; False: no sidecar, or one that holds
    no checksum); ValueError when it does not match."""
    sidecar = _sidecar(path)
    try:
        expected = sidecar.read_bytes().decode(errors="replace").strip()
    except FileNotFoundError:
        return False
    if not _DIGEST.fullmatch(expected):
        # The sidecar itself is damaged (torn, overwritten): it condemns nothing, and the
        # checkpoint is judged by loading it, as one written without a sidecar.
        log.warning("%s holds no checksum: %s is checked by loading it", sidecar.name, path.name)
        return False
    if hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{path.name} does not match its checksum (damaged or truncated)")
    return True


def _parse(path: Path, data: bytes, map_location: str | None) -> dict[str, Any]:
    import torch  # heavy: only where a checkpoint is read

    try:
        loaded = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as exc:
        raise ValueError(f"{path.name} cannot be read: {exc}") from None
    if not isinstance(loaded, dict) or "iter" not in loaded:
        raise ValueError(f"{path.name} is not a training checkpoint")
    return loaded


def load_verified(path: Path, map_location: str | None = None) -> dict[str, Any]:
    """Load one checkpoint, raising ValueError if it is truncated, fails its checksum or is
    not a training checkpoint."""
    data = path.read_bytes()
    _check_bytes(path, data)
    return _parse(path, data, map_location)


@dataclass(frozen=True)
class Damaged:
    """A checkpoint that does not verify, and why."""

    name: str
    why: str

    def as_dict(self) -> dict[str, str]:
        """For run.json."""
        return {"name": self.name, "why": self.why}


@dataclass
class Checkpoints:
    """The checkpoints of one run, each verified at most once (keyed by name, size and
    modification time), as the run's writer sees them."""

    run_dir: Path
    _verdicts: dict[tuple[str, int, int], str | None] = field(default_factory=dict)

    def _key(self, path: Path) -> tuple[str, int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return path.name, st.st_size, st.st_mtime_ns

    def problem(self, path: Path) -> str | None:
        """Why `path` does not verify (None: it does)."""
        key = self._key(path)
        if key is None:
            return f"{path.name} cannot be read (it disappeared)"
        if key not in self._verdicts:
            try:
                data = path.read_bytes()
                if not _check_bytes(path, data):
                    _parse(path, data, "cpu")  # no sidecar: written by other code
                verdict = _rank_states_problem(path)
            except ValueError as exc:
                verdict = str(exc)
            except OSError as exc:  # unreadable now (a flaky filesystem): not remembered
                return f"{path.name} cannot be read: {exc.strerror or exc}"
            self._verdicts[key] = verdict
        return self._verdicts[key]

    def written(self, path: Path) -> None:
        """`path` was just written by this process: it verifies."""
        key = self._key(path)
        if key is not None:
            self._verdicts[key] = None

    def newest_valid(self) -> tuple[Path | None, list[Damaged]]:
        """The newest checkpoint that verifies (None: none does), and the damaged ones newer
        than it (all of them when none verifies), newest first."""
        damaged = []
        for path in reversed(list_checkpoints(self.run_dir)):
            why = self.problem(path)
            if why is None:
                return path, damaged
            damaged.append(Damaged(path.name, why))
        return None, damaged

    def valid(self) -> list[Path]:
        """Every checkpoint that verifies, oldest first."""
        return [p for p in list_checkpoints(self.run_dir) if self.problem(p) is None]

    def set_aside(self, damaged: list[Damaged], before: Callable[[], None] | None = None) -> None:
        """Rename damaged checkpoints (and their sidecars) to `<name>.damaged`, so that nothing
        counts them and a later save of the same iteration does not meet them."""
        if before is not None and damaged:
            before()
        for item in damaged:
            path = self.run_dir / item.name
            for src in (path, _sidecar(path), rank_state_dir(path)):
                if src.exists():
                    dst, n = src.with_name(src.name + DAMAGED_SUFFIX), 1
                    while dst.exists():  # set aside before (a folder is not replaced)
                        dst, n = src.with_name(f"{src.name}{DAMAGED_SUFFIX}.{n}"), n + 1
                    os.replace(src, dst)
        if damaged:
            fsync_dir(self.run_dir)

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the newest `keep` checkpoints that verify (0 keeps all); damaged
        ones are not counted and not deleted. Returns the deleted."""
        if keep <= 0:
            return []
        old = self.valid()[:-keep]
        for path in old:
            path.unlink(missing_ok=True)
            _sidecar(path).unlink(missing_ok=True)
            shutil.rmtree(rank_state_dir(path), ignore_errors=True)
        return old


def cannot_continue(
    checkpoints: Checkpoints, task: str, restart_from_scratch: bool, flag: str = "--run-dir"
) -> SpecError | None:
    """Why a run directory cannot be continued by a run of `task` (None: it can): it holds a
    run of another task (named as `flag`), or every checkpoint of it is damaged and
    --restart-from-scratch was not given. The launcher asks before starting anything; the
    ranks ask again before loading."""
    run_dir = checkpoints.run_dir
    theirs = (read_record(run_dir).get("spec") or {}).get("task") if run_dir.is_dir() else None
    if theirs and theirs != task:
        return SpecError(
            flag,
            f"{run_dir} holds a run of task {theirs!r}; this command trains {task!r}. "
            f"Continue it with {theirs!r}, or give another run directory",
        )
    if restart_from_scratch or not run_dir.is_dir():
        return None
    valid, damaged = checkpoints.newest_valid()
    if valid is None and damaged:
        names = ", ".join(d.name for d in damaged)
        return SpecError(
            "--restart-from-scratch",
            f"every checkpoint of {run_dir} is damaged ({names}; {damaged[0].why}). "
            "Refusing to train again from iteration 0 over them: restore a checkpoint, or "
            "pass --restart-from-scratch (they are then kept as model_<n>.pt.damaged)",
        )
    return None

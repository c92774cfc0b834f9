"""Checkpoints that a SIGKILL at any moment cannot corrupt, and only verified ones counted.

A checkpoint is written to a temporary file, fsynced and renamed, and the directory fsynced.
Its `<name>.sha256` sidecar holds its checksum, then a line saying what it belongs to (run,
task, iteration, world size, and for a model file each rank state's checksum and size). Each
rank writes its own state file (`rank_states/model_<n>/`); the writer publishes them, then
the model file.

A checkpoint verifies when its bytes match its sidecar (or, written by other code, when it
loads), and each rank's state file is exactly the one the model file lists. Nothing but a
regular file of a plausible size is read. Resuming takes the newest that verifies, retention
keeps the newest N that do, and a damaged one is set aside (`.damaged`), never preferred. The
files stay plain `torch.save` archives that rsl-rl's and mjlab's `load()` read; torch loads
only to write or read one.

A run directory may be shared, so what is read from it is data, never code: every file is
read with torch's plain weights-only load (`torch.load(..., weights_only=True)`), which builds
tensors and Python's own values only, what we, rsl-rl and mjlab save. A rank state written
before states were plain data is read by `legacy`. A file that names anything else is refused
by name, like a damaged one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from mjlab_hpc.errors import SpecError
from mjlab_hpc.rundir import legacy
from mjlab_hpc.rundir.durable import (
    fsync_dir,
    open_regular,
    publish,
    read_regular,
    temp_path,
    write_atomic,
    write_new,
)
from mjlab_hpc.rundir.layout import (
    CHECKSUM_SUFFIX,
    checkpoint_iteration,
    list_checkpoints,
    rank_state_dir,
    rank_state_file,
)
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.spec import TrainSpec

__all__ = [
    "DAMAGED_SUFFIX",
    "MODEL_LIMIT",
    "CheckpointPolicy",
    "Checkpoints",
    "Damaged",
    "cannot_continue",
    "env_states_pruned",
    "load_rank_state",
    "load_verified",
    "load_with",
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
# What a model's sidecar header says once its rank states were pruned (--keep-env-states).
_PRUNED = "rank_states_pruned"
#: The largest model file read (the networks and optimizer of a policy: megabytes).
MODEL_LIMIT = 4 << 30
# The largest rank state of a checkpoint that does not list its size (older mjlab_hpc).
_STATE_LIMIT = 64 << 30


_T = TypeVar("_T")
# torch's advice around why it refused a file (not said: we never load it otherwise).
_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _named_globals(f: IO[bytes]) -> list[str] | None:
    """The globals beyond torch's own that a `torch.save` file names (read, not built).

    None: the file is not torch's zip format (a raw pickle, or torch's legacy format).
    """
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:
        return None
    finally:
        f.seek(0)


def _refusal(path: Path, exc: BaseException, raw: bool) -> ValueError:
    """Why torch's weights-only unpickler refused `path`, in one line naming it.

    `raw`: the file is not torch.save's archive (a pickle written otherwise).
    """
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = found[1] if found else next((x for x in lines if not x.startswith(_ADVICE)), "")
    reason = reason.split(". Please use")[0].rstrip(".") or type(exc).__name__
    what = "is a raw pickle, not a torch.save archive" if raw else "holds more than weights"
    return ValueError(f"{path.name} {what} ({reason}): refused, not loaded")


def _unpickle(path: Path, data: bytes, map_location: str | None) -> Any:
    """Load `data` (the bytes of `path`) with torch's plain weights-only load.

    It builds tensors and Python's own values only: what we save, and what rsl-rl and mjlab
    save. A rank state of mjlab_hpc before plain states is read by `legacy.read` instead.
    """
    import torch  # heavy: only where a checkpoint is read

    f = io.BytesIO(data)
    names = _named_globals(f)
    try:
        if names and legacy.reads(names):
            return legacy.read(f, map_location)
        with warnings.catch_warnings():
            # A raw pickle's protocol is said as a warning: it is refused anyway.
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc, raw=names is None) from None


def load_with(load: Callable[[IO[bytes]], _T], path: Path) -> _T:
    """Let other code's `load` (mjlab's runner.load) read checkpoint `path` safely.

    It gets the bytes that verify, not the path (which another user may replace meanwhile),
    and, since it unpickles them fully (mjlab's load asks for weights_only=False), only what
    a plain weights-only load built of them, saved again.
    """
    data = read_regular(path, MODEL_LIMIT)
    _check_bytes(path, data)
    plain = _parse(path, data, "cpu")
    return load(io.BytesIO(_serialize(plain)))


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def _serialize(state: Any) -> bytes:
    import torch  # heavy: only where a checkpoint is written

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _sidecar_text(digest: str, header: Mapping[str, Any] | None) -> bytes:
    return (f"{digest}\n" + (json.dumps(dict(header)) + "\n" if header else "")).encode()


def save_checkpoint(
    path: Path,
    state: dict[str, Any],
    before_rename: Callable[[], None] | None = None,
    header: Mapping[str, Any] | None = None,
) -> str:
    """Save `state` atomically with its checksum sidecar; the checksum.

    `header` (what the checkpoint belongs to) goes into the sidecar too.
    """
    data = _serialize(state)
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(_sidecar(path), _sidecar_text(digest, header))
    try:
        write_atomic(path, data, before_rename)
    except BaseException:
        if not path.exists():  # no sidecar without its checkpoint (a full disk, a lost lock)
            _sidecar(path).unlink(missing_ok=True)
        raise
    return digest


def publish_file(
    tmp: Path,
    path: Path,
    before_rename: Callable[[], None] | None = None,
    digest: str | None = None,
    header: Mapping[str, Any] | None = None,
) -> str:
    """Publish as `path` a checkpoint that other code wrote to `tmp`; its checksum.

    mjlab's runners write their own. The checksum sidecar (with `header`) comes first, then
    `before_rename`, then the durable rename to `path`. `digest` is the checksum when it is
    known already.
    """
    digest = digest or hashlib.sha256(tmp.read_bytes()).hexdigest()
    write_atomic(_sidecar(path), _sidecar_text(digest, header))
    try:
        publish(tmp, path, before_rename)
    except BaseException:
        if not path.exists():
            _sidecar(path).unlink(missing_ok=True)
        raise
    return digest


def write_rank_state(
    checkpoint: Path,
    rank: int,
    world_size: int,
    state: dict[str, Any],
    belongs: Mapping[str, Any],
) -> tuple[str, str, int]:
    """Write one rank's state of `checkpoint` to a temporary file beside its place.

    The state is saved with what it belongs to (`belongs`: run, task, iteration; and this
    rank and world size) and fsynced, but not published. Returns (temporary path, sha256,
    size) for the writer, which publishes it. A state that is not plain data (tensors and
    Python's own values: what a plain weights-only load reads) is a TypeError, unwritten.
    """
    path = rank_state_file(checkpoint, rank, world_size)
    data = _serialize({**state, "belongs": {**belongs, "rank": rank, "world_size": world_size}})
    named = _named_globals(io.BytesIO(data))
    if named:  # what a plain weights-only load would refuse: never written
        raise TypeError(f"{path.name} would hold more than plain data (GLOBAL {named[0]})")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write_new(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(tmp), hashlib.sha256(data).hexdigest(), len(data)


def publish_rank_states(
    checkpoint: Path, written: list[tuple[str, str, int]], before_rename: Callable[[], None]
) -> list[list[Any]]:
    """Publish every rank's `write_rank_state`, fenced and with checksums (the writer's step).

    This comes before the checkpoint itself. Returns what the checkpoint's header lists of
    them: [sha256, size] by rank.
    """
    try:
        for rank, (tmp, digest, _) in enumerate(written):
            place = rank_state_file(checkpoint, rank, len(written))
            publish_file(Path(tmp), place, before_rename, digest=digest)
    except BaseException:  # (a full disk): those not published yet are not left behind
        for tmp, _, _ in written:
            Path(tmp).unlink(missing_ok=True)
        raise
    return [[digest, size] for _, digest, size in written]


def load_rank_state(
    checkpoint: Path, rank: int, world_size: int, belongs: Mapping[str, Any]
) -> dict[str, Any]:
    """Load this rank's state of `checkpoint`, verified.

    It must have been saved for what `belongs` says (run, task, iteration) and for this rank
    and world size; a ValueError names what does not fit.
    """
    path = rank_state_file(checkpoint, rank, world_size)
    data = read_regular(path, _STATE_LIMIT)
    if not _check_bytes(path, data):
        raise ValueError(f"{path.name} has no checksum")
    state = dict(_unpickle(path, data, "cpu"))
    theirs = state.pop("belongs", None)  # None: written before states carried it
    mine = {**belongs, "rank": rank, "world_size": world_size}
    wrong = [k for k in mine if theirs is not None and theirs.get(k) != mine[k]]
    if wrong:
        raise ValueError(
            f"{path.name} of {checkpoint.name} belongs to "
            + ", ".join(f"{k} {theirs.get(k)!r}" for k in wrong)
            + ", not "
            + ", ".join(f"{mine[k]!r}" for k in wrong)
        )
    return state


def _file_digest(path: Path, limit: int) -> tuple[str, int]:
    """(sha256, size) of a regular file of at most `limit` bytes, read in pieces."""
    with open_regular(path, limit) as f:
        digest = hashlib.file_digest(f, "sha256")
        return digest.hexdigest(), f.tell()


def _weights_problem(path: Path, limit: int) -> str | None:
    """Why a rank state would be refused when loaded: it names what we never save.

    Only its pickle is read (its tensors' bytes are not), and nothing is built.
    """
    with open_regular(path, limit) as f:
        names = _named_globals(f)
    if names is None:
        return f"{path.name} is no torch.save archive: refused"
    unsaved = legacy.unread(names)
    if unsaved:
        return f"{path.name} holds more than weights (GLOBAL {unsaved[0]}): refused, not loaded"
    return None


def _rank_states_problem(checkpoint: Path, header: Mapping[str, Any]) -> str | None:
    """Return why a checkpoint's rank states do not verify (None: they do, or it has none).

    Each must be a regular file, match its checksum, and be the very file the model's
    `header` lists for its rank (not another rank's, iteration's or run's).
    """
    folder = rank_state_dir(checkpoint)
    listed = header.get("rank_states")
    if header.get(_PRUNED):
        return None  # dropped on purpose (--keep-env-states): its model stands alone
    if not folder.is_dir():
        return f"{checkpoint.name}'s rank states are missing" if listed else None
    found = sorted(
        (int(m[1]), int(m[2]), m[0])
        for p in folder.iterdir()
        if (m := _RANK_FILE.fullmatch(p.name))
    )
    sizes = {n for _, n, _ in found}
    if (
        len(sizes) != 1
        or [r for r, _, _ in found] != list(range(next(iter(sizes))))
        or (listed is not None and len(listed) != len(found))
    ):
        return f"{checkpoint.name}'s rank states in {folder.name}/ are incomplete"
    digests = [entry[0] for entry in listed or []]
    for rank, _, name in found:
        path = folder / name
        expected = int(listed[rank][1]) if listed else _STATE_LIMIT
        try:
            digest, size = _file_digest(path, expected)
            # Another rank's state (of another size, when the writer's statistics differ).
            if listed and digest != digests[rank] and digest in digests:
                whose = f"rank {digests.index(digest)}'s state of this checkpoint"
                return (
                    f"{name} of {checkpoint.name} is not the state rank {rank} saved: it is {whose}"
                )
            if listed and size != expected:
                return f"{name} of {checkpoint.name} holds {size:,} bytes; {expected:,} were saved"
            if not _check_digest(path, digest) and not listed:
                return f"{name} of {checkpoint.name} has no checksum"
            if listed and digest != digests[rank]:
                whose = "another checkpoint's or run's"
                return (
                    f"{name} of {checkpoint.name} is not the state rank {rank} saved: it is {whose}"
                )
            unsafe = _weights_problem(path, expected)
        except ValueError as exc:
            return f"{exc} ({checkpoint.name}'s rank state)"
        if unsafe is not None:
            return f"{unsafe} ({checkpoint.name}'s rank state)"
    return None


def env_states_pruned(checkpoint: Path) -> bool:
    """Whether `checkpoint`'s rank states were pruned (--keep-env-states); its model stays.

    Its sidecar's header says so (`_PRUNED`).
    """
    try:
        return bool(_read_sidecar(checkpoint)[1].get(_PRUNED))
    except ValueError:  # a sidecar whose header is damaged says nothing
        return False


def rank_state_world_size(checkpoint: Path) -> int | None:
    """How many ranks wrote `checkpoint`'s rank states (None: it has none, or they were pruned)."""
    if env_states_pruned(checkpoint):
        return None
    folder = rank_state_dir(checkpoint)
    found = {
        int(m[2])
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (m := _RANK_FILE.fullmatch(p.name))
    }
    return found.pop() if len(found) == 1 else None


def _read_sidecar(path: Path) -> tuple[str | None, dict[str, Any]]:
    """Return the checksum and the header that `path`'s sidecar holds.

    The checksum is None when there is no sidecar, or one that holds no checksum; the header
    is {} when there is none.
    """
    sidecar = _sidecar(path)
    try:
        lines = read_regular(sidecar, 1 << 20).decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None, {}
    except ValueError as exc:
        lines = [str(exc)]
    digest = lines[0].strip() if lines else ""
    if not _DIGEST.fullmatch(digest):
        # The sidecar itself is damaged (torn, overwritten): it condemns nothing, and the
        # checkpoint is judged by loading it, as one written without a sidecar.
        log.warning("%s holds no checksum: %s is checked by loading it", sidecar.name, path.name)
        return None, {}
    try:
        header = json.loads(lines[1]) if len(lines) > 1 else {}
    except ValueError:
        header = None
    listed = header.get("rank_states", []) if isinstance(header, dict) else None
    if not isinstance(listed, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
        for e in listed
    ):
        raise ValueError(f"{sidecar.name}'s second line is not what {path.name} belongs to")
    return digest, header  # type: ignore[return-value]


def _check_digest(path: Path, digest: str) -> bool:
    """Whether a file of checksum `digest` was checked against its sidecar.

    True: it matches. False: there is no sidecar, or one that holds no checksum. A mismatch
    raises ValueError.
    """
    expected, _ = _read_sidecar(path)
    if expected is not None and digest != expected:
        raise ValueError(f"{path.name} does not match its checksum (damaged or truncated)")
    return expected is not None


def _check_bytes(path: Path, data: bytes) -> bool:
    """`_check_digest` of `data`."""
    return _check_digest(path, hashlib.sha256(data).hexdigest())


def _belongs_problem(path: Path, header: Mapping[str, Any], task: str | None) -> str | None:
    """Return why a model file's header says it belongs elsewhere (None: it fits).

    That is another iteration than its name, or another task than the run's. A file without
    a header fits.
    """
    saved = header.get("iteration")
    if saved is not None and saved != checkpoint_iteration(path):
        return f"{path.name} holds iteration {saved} (a file renamed or copied over it)"
    theirs = header.get("task")
    if task is not None and theirs is not None and theirs != task:
        return f"{path.name} belongs to a run of task {theirs!r}, not {task!r}"
    return None


def _parse(path: Path, data: bytes, map_location: str | None) -> dict[str, Any]:
    try:
        loaded = _unpickle(path, data, map_location)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{path.name} cannot be read: {exc}") from None
    if not isinstance(loaded, dict) or "iter" not in loaded:
        raise ValueError(f"{path.name} is not a training checkpoint")
    return loaded


def load_verified(path: Path, map_location: str | None = None) -> dict[str, Any]:
    """Load one checkpoint that verifies.

    ValueError when it is no regular file, is truncated, fails its checksum or is not a
    training checkpoint.
    """
    data = read_regular(path, MODEL_LIMIT)
    _check_bytes(path, data)
    return _parse(path, data, map_location)


@dataclass(frozen=True)
class Damaged:
    """A checkpoint that does not verify, and why."""

    name: str
    why: str


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a run saves a checkpoint, and how many it keeps."""

    save_interval: int
    """--save-interval: a checkpoint every N iterations, and one at the last."""
    save_every_min: float | None
    """--save-every-min: also one when this many minutes passed since the last (None: off)."""
    keep_checkpoints: int
    """--keep-checkpoints: the newest N that verify are kept (0: all)."""
    keep_env_states: int = 0
    """--keep-env-states: the rank states of the newest N that verify with them are kept
    (0: all)."""

    @classmethod
    def of(cls, spec: TrainSpec) -> CheckpointPolicy:
        """The policy that the flags of `spec` ask for."""
        return cls(
            save_interval=spec.save_interval,
            save_every_min=spec.save_every_min,
            keep_checkpoints=spec.keep_checkpoints,
            keep_env_states=spec.keep_env_states,
        )

    def periodic(self, iteration: int, last: int) -> bool:
        """Whether `iteration` gets a checkpoint by its number (`last`: the run's last)."""
        return iteration % self.save_interval == 0 or iteration == last

    def time_due(self, since_s: float) -> bool:
        """Whether `since_s` seconds after the last checkpoint call for one now."""
        return self.save_every_min is not None and since_s >= self.save_every_min * 60


@dataclass
class Checkpoints:
    """The checkpoints of one run as its writer sees them, each verified at most once.

    A verdict is kept by the file's name, size and modification time.
    """

    run_dir: Path
    task: str | None = None
    """The run's task (None: not checked): a model file saved for another is damaged."""
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
                data = read_regular(path, MODEL_LIMIT)
                digest, header = _read_sidecar(path)
                if digest is not None and hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError(
                        f"{path.name} does not match its checksum (damaged or truncated)"
                    )
                # Loaded even when its checksum matches: whoever wrote it may have written
                # the sidecar too, and a file that holds more than weights is refused.
                _parse(path, data, "cpu")
                verdict = _belongs_problem(path, header, self.task)
                verdict = verdict or _rank_states_problem(path, header)
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
        """Return the newest checkpoint that verifies (None: none does), and the damaged ones.

        The damaged ones are those newer than it (all of them when none verifies), newest
        first.
        """
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
        """Rename damaged checkpoints (and their sidecars) to `<name>.damaged`.

        Nothing counts them then, and a later save of the same iteration does not meet them.
        """
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
        """Delete all but the newest `keep` checkpoints that verify (0 keeps all); the deleted.

        Damaged ones are neither counted nor deleted.
        """
        if keep <= 0:
            return []
        old = self.valid()[:-keep]
        for path in old:
            path.unlink(missing_ok=True)
            _sidecar(path).unlink(missing_ok=True)
            shutil.rmtree(rank_state_dir(path), ignore_errors=True)
        return old

    def prune_env_states(self, keep: int) -> list[Path]:
        """Drop the rank states of all but the newest `keep` checkpoints whose rank states
        verify (0 keeps all); the checkpoints whose states were dropped. Their models stay.

        Checkpoints are verified newest first until `keep` verify with their states, so the
        one a continuation would take keeps them, and a damaged one (neither counted nor
        touched) never leaves the run without restorable ones. Only older states go: the
        model's sidecar says so first (`_PRUNED`), then the folder is deleted, so a
        checkpoint stopped halfway is pruned, not damaged.
        """
        if keep <= 0:
            return []
        kept, dropped = 0, []
        for path in reversed(list_checkpoints(self.run_dir)):
            folder = rank_state_dir(path)
            if not folder.is_dir():
                continue
            if kept < keep:
                restorable = rank_state_world_size(path) is not None
                if restorable and self.problem(path) is None:
                    kept += 1
                continue
            if not env_states_pruned(path):
                try:
                    digest, header = _read_sidecar(path)
                except ValueError:
                    digest = None
                if digest is None:  # no sidecar to say so: left as it is
                    continue
                write_atomic(_sidecar(path), _sidecar_text(digest, {**header, _PRUNED: True}))
                dropped.append(path)
            shutil.rmtree(folder, ignore_errors=True)  # a link is not followed
        return dropped


def cannot_continue(
    checkpoints: Checkpoints,
    task: str,
    restart_from_scratch: bool,
    flag: str = "--run-dir",
    fresh_envs: bool = False,
) -> SpecError | None:
    """Return why a run of `task` cannot continue the run directory (None: it can).

    The directory holds a run of another task (named as `flag`), every checkpoint of it is
    damaged and --restart-from-scratch was not given, or the checkpoint it would continue
    from has its rank states pruned and --fresh-envs was not given. The launcher asks before
    starting anything; the ranks ask again before loading.
    """
    run_dir = checkpoints.run_dir
    spec = read_record(run_dir).spec if run_dir.is_dir() else None
    theirs = spec.task if spec is not None else None
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
    if valid is not None and env_states_pruned(valid) and not fresh_envs:
        newer = f"; the newer {', '.join(d.name for d in damaged)} are damaged" if damaged else ""
        return SpecError(
            "--fresh-envs",
            f"{valid.name} of {run_dir}, the checkpoint to continue from, has no environment "
            f"states: they were pruned (--keep-env-states keeps the newest checkpoints' only"
            f"{newer}). Pass --fresh-envs to continue from it with new environments (models, "
            "optimizer and iteration kept; not exact). Nothing was changed or started",
        )
    return None

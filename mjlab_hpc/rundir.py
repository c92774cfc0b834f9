"""The run directory: decided once per run and shared by every rank and every restart.

Layout of `<log-root>/<experiment>/<YYYY-mm-dd_HH-MM-SS>[_<run-name>]/`:
    params/train.yaml, agent.yaml, env.yaml   the resolved spec and configs (writer)
    model_<n>.pt                              checkpoints after n iterations (writer)
    events.out.tfevents.*                     tensorboard (writer)
    progress.jsonl                            one JSON line per iteration (writer)
    summary.json                              the end of the run (writer)
    logs/rank<k>.log                          every rank's own log
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMESTAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"


def run_dir_name(now: dt.datetime, run_name: str = "") -> str:
    """`<timestamp>[_<run-name>]`, as rsl-rl and mjlab name runs."""
    stamp = now.strftime(TIMESTAMP_FORMAT)
    return f"{stamp}_{run_name}" if run_name else stamp


def create_run_dir(
    log_root: str | Path, experiment: str, run_name: str = "", now: dt.datetime | None = None
) -> Path:
    """Make a new, empty run directory and return it.

    The final mkdir is atomic, so two launches in the same second cannot share a directory:
    the one that loses gets a `-2`, `-3`, ... suffix.
    """
    parent = Path(log_root) / experiment
    parent.mkdir(parents=True, exist_ok=True)
    base = run_dir_name(now or dt.datetime.now(), run_name)
    for n in range(1, 10_000):
        candidate = parent / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate.resolve()
    raise FileExistsError(f"no free run directory name under {parent} for {base}")


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def params(self) -> Path:
        return self.path / "params"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def progress(self) -> Path:
        return self.path / "progress.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def checkpoint(self, iterations: int) -> Path:
        return self.path / f"model_{iterations}.pt"

    def checkpoints(self) -> list[Path]:
        """Checkpoints, oldest first (by iteration count)."""
        from mjlab_hpc.checkpoint import list_checkpoints  # torch: only when asked

        return list_checkpoints(self.path)

    def read_progress(self) -> list[dict[str, Any]]:
        """The progress records written so far (a torn last line is ignored)."""
        if not self.progress.exists():
            return []
        records = []
        for line in self.progress.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_dir_for_key(log_root: str | Path, experiment: str, run_name: str, key: str) -> Path:
    """The run directory recorded under `key` (e.g. `slurm-<job id>`), made on first use.

    Every rank and every restart of one job asks with the same key and gets the same
    directory; a different job gets its own. The record is published with a hard link, which
    is atomic on NFS too: of two racing callers exactly one wins, the other reads its answer.
    """
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"run directory key must be a plain name, got {key!r}")
    keys = Path(log_root) / experiment / ".keys"
    keys.mkdir(parents=True, exist_ok=True)
    record = keys / key
    if record.exists():
        return Path(record.read_text().strip())
    run = create_run_dir(log_root, experiment, run_name)
    tmp = keys / f".{key}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{run}\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, record)
    except FileExistsError:
        run.rmdir()  # another caller won the race; its directory is the run's
        return Path(record.read_text().strip())
    finally:
        tmp.unlink()
    return run


class RunWriter:
    """The one process that writes a run directory's shared files.

    It holds the run's lease lock (`<run>/.writer.lock`) from start to end; every file it
    publishes is fenced by the lock's token, so a former writer that wakes up after another
    process took over (a frozen node, a stale restart) cannot overwrite anything.
    """

    LOCK_NAME = ".writer.lock"

    def __init__(self, run: RunDir, lock: Any) -> None:
        self.run = run
        self.lock = lock

    @classmethod
    def acquire(
        cls, run: RunDir, rank: int, lease_s: float = 30.0, timeout_s: float | None = None
    ) -> RunWriter:
        """Become the writer of `run`, waiting at most `timeout_s` (default: one lease, so a
        crashed previous writer's lock can expire)."""
        from mjlab_hpc.lock import LeaseLock, OwnerInfo

        lock = LeaseLock(run.path / cls.LOCK_NAME, owner=OwnerInfo.from_env(rank), lease_s=lease_s)
        lock.acquire(timeout_s=lease_s * 1.5 + 5.0 if timeout_s is None else timeout_s)
        return cls(run, lock)

    def check(self) -> None:
        """Raise LockLost if another process has taken over."""
        self.lock.check()

    def write_text(self, path: Path, text: str) -> None:
        """Publish a whole file (temporary file, fence check, rename)."""
        from mjlab_hpc.lock import write_fenced

        write_fenced(self.lock, path, text.encode())

    def write_json(self, path: Path, data: Any) -> None:
        self.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

    def append_line(self, path: Path, line: str) -> None:
        """Append one line to a log-like file (progress.jsonl, restarts.jsonl)."""
        self.check()
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """Save a checkpoint atomically, fenced just before the rename."""
        from mjlab_hpc.checkpoint import save_checkpoint

        save_checkpoint(path, state, before_rename=self.check)

    def release(self) -> None:
        """Give the run up (the lock is left for a successor to take at once)."""
        from mjlab_hpc.lock import LockError

        with contextlib.suppress(LockError):  # lost already: nothing of ours to release
            self.lock.release()


def record_latest_run(run: Path) -> None:
    """`<log-root>/<experiment>/.latest_run`: the newest run, for tools and `--resume`."""
    tmp = run.parent / f".latest_run.{os.getpid()}.tmp"
    tmp.write_text(f"{run}\n")
    os.replace(tmp, run.parent / ".latest_run")


def latest_run(log_root: str | Path, experiment: str) -> Path | None:
    """The run `.latest_run` names, else the newest run directory of the experiment."""
    parent = Path(log_root) / experiment
    marker = parent / ".latest_run"
    if marker.exists():
        path = Path(marker.read_text().strip())
        if path.is_dir():
            return path
    runs = sorted(p for p in parent.glob("*") if p.is_dir() and not p.name.startswith("."))
    return runs[-1] if runs else None


def once(
    run: RunDir,
    name: str,
    writer: RunWriter | None,
    fn: Callable[[], Any],
    timeout_s: float = 3600.0,
    poll_s: float = 0.2,
) -> Any:
    """Run a side effect that must happen once per run (an artifact download, a video) on the
    writer only; every other rank waits for its result, and so does every restart.

    The writer publishes `{"result": ...}` (JSON-able) or `{"error": ...}` as
    `<run>/.once/<name>.json`, fenced by its lock; the others raise the writer's error instead
    of waiting for the timeout.
    """
    marker = run.path / ".once" / f"{name}.json"
    if writer is not None:
        if marker.exists():  # done by an earlier start of this run
            return _once_result(marker, name)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = fn()
        except Exception as exc:
            writer.write_json(marker, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        writer.write_json(marker, {"result": result})
        return result
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for the writer to finish {name!r}")
        time.sleep(poll_s)
    return _once_result(marker, name)


def _once_result(marker: Path, name: str) -> Any:
    data = json.loads(marker.read_text())
    if "error" in data:
        raise RuntimeError(f"the writer's {name!r} failed: {data['error']}")
    return data["result"]

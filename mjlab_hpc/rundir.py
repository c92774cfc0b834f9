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

import datetime as dt
import json
import os
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
        found = []
        for p in self.path.glob("model_*.pt"):
            stem = p.stem.removeprefix("model_")
            if stem.isdigit():
                found.append((int(stem), p))
        return [p for _, p in sorted(found)]

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

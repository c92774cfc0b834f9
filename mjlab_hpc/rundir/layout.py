"""The run directory's layout: every file name the toolkit reads or writes, in one place.

A run directory is decided once per run (validation decides the `RunTarget`; a new one is made
here, by `realise_target`) and shared by every rank and every restart.
docs/launching.md ("The run directory") shows the tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mjlab_hpc.convert import Count
from mjlab_hpc.errors import DamagedRecord
from mjlab_hpc.procs import user_name
from mjlab_hpc.rundir.durable import create_exclusive, read_regular, write_atomic, write_json_atomic
from mjlab_hpc.rundir.typed import plain, read_optional
from mjlab_hpc.spec import ResolvedSpec

__all__ = [
    "CANCEL_RECORD",
    "CODE_COPY",
    "CODE_DIFF",
    "CODE_DIR",
    "ELEMENT_RECORD",
    "FAULT_SUFFIX",
    "GROUP_WRITABLE_ENV",
    "HANG_RECORD",
    "NAN_DUMPS_DIR",
    "NODE_BEAT_GLOB",
    "PROGRESS",
    "RUN_RECORD",
    "SNAPSHOT_RECORD",
    "SUBMITIT_DIR",
    "SWEEPS_DIR",
    "SWEEP_ELEMENTS",
    "SWEEP_RECORD",
    "TIMESTAMP_FORMAT",
    "WANDB_RECORD",
    "ElementRecord",
    "RunDir",
    "SweepMember",
    "SweepRecord",
    "checkpoint_iteration",
    "create_run_dir",
    "is_run_dir",
    "keep_runs_private",
    "latest_run",
    "latest_run_record",
    "list_checkpoints",
    "new_folder",
    "rank_state_dir",
    "rank_state_file",
    "read_element",
    "read_sweep",
    "realise_target",
    "record_latest_run",
    "run_dir_for_key",
    "run_dir_name",
    "shared_mkdir",
    "write_element",
    "write_sweep",
]

TIMESTAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
#: `1`: a user's runs are writable by the group as the umask says (a team that works on each
#: other's runs). Unset, what our commands create is writable by its user alone.
GROUP_WRITABLE_ENV = "MJLAB_HPC_GROUP_WRITABLE_RUNS"

# Files of a run directory.
PARAMS_DIR = "params"
LOGS_DIR = "logs"
PROGRESS = "progress.jsonl"
RESTARTS = "restarts.jsonl"
# One line per checkpoint written: its iteration, when and how long (`mjlab-hpc report`).
CHECKPOINT_TIMES = "checkpoints.jsonl"
RUN_RECORD = "run.json"
SUMMARY = "summary.json"
ELEMENT_RECORD = "sweep_element.json"
CANCEL_RECORD = "cancelled.json"
SUBMITIT_DIR = "submitit"
WRITER_LOCK = ".writer.lock"
WRITER_RESERVE = ".writer.reserve"
ONCE_DIR = ".once"
HEARTBEAT_DIR = "heartbeat"
CHECKSUM_SUFFIX = ".sha256"
RANK_STATES_DIR = "rank_states"
#: `<run>/code`: the submitted code's copy (`src/`), its record and the uncommitted diff.
CODE_DIR = "code"
CODE_COPY = "src"
CODE_DIFF = "changes.diff"
SNAPSHOT_RECORD = "snapshot.json"
#: The run's W&B record (its W&B run id and the last step W&B was given).
WANDB_RECORD = "wandb_run.json"
#: mjlab's NaN guard's dumps, one folder per rank.
NAN_DUMPS_DIR = "nan_dumps"
#: --video's recordings.
VIDEOS_DIR = "videos/train"
# In logs/: each rank's start and end records (`rundir.ends`); in the heartbeat folder, one
# heartbeat per node, the start's hang record (`rundir.liveness`) and the fault injections'
# markers.
RANK_RECORDS_DIR = "ranks"
NODE_BEAT_GLOB = "node-*.json"
HANG_RECORD = "hang.json"
#: The end of a rank's fault marker's name (`rank<k>.<n>.fault`).
FAULT_SUFFIX = ".fault"
# Files of an experiment folder.
KEYS_DIR = ".keys"
#: `<experiment>/.latest_run.<uid>`: each user's own latest run (a team shares the folder).
LATEST_RUN = ".latest_run"
SWEEPS_DIR = ".sweeps"
SWEEP_RECORD = "sweep.json"
#: In a sweep's directory: `<index>`, a link to each element's run (made before submitting).
SWEEP_ELEMENTS = "elements"

# Files that only a run directory holds (a directory with none of them is not a run).
_RUN_MARKERS = (RUN_RECORD, PROGRESS, SUBMITIT_DIR, LOGS_DIR, PARAMS_DIR, ELEMENT_RECORD)


def run_dir_name(now: dt.datetime, run_name: str = "") -> str:
    """`<timestamp>[_<run-name>]`, as rsl-rl and mjlab name runs."""
    stamp = now.strftime(TIMESTAMP_FORMAT)
    return f"{stamp}_{run_name}" if run_name else stamp


def checkpoint_iteration(path: Path) -> int | None:
    """n of `model_<n>.pt` (None for other names)."""
    stem = path.name.removeprefix("model_").removesuffix(".pt")
    return int(stem) if path.name.startswith("model_") and stem.isdigit() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """`model_<n>.pt` files, oldest first (by iteration count)."""
    found = [(checkpoint_iteration(p), p) for p in run_dir.glob("model_*.pt")]
    return [p for n, p in sorted((n, p) for n, p in found if n is not None)]


def rank_state_dir(checkpoint: Path) -> Path:
    """The folder of a checkpoint's per-rank states: `rank_states/model_<n>/`."""
    return checkpoint.parent / RANK_STATES_DIR / checkpoint.name.removesuffix(".pt")


def rank_state_file(checkpoint: Path, rank: int, world_size: int) -> Path:
    """Rank `rank`'s state of a checkpoint written by `world_size` ranks."""
    return rank_state_dir(checkpoint) / f"rank{rank}-of-{world_size}.pt"


def _file_name(host: str) -> str:
    """`host` as a file name: itself when it is one, else made one, with a digest of it."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host)[:80]
    if safe == host and not host.startswith("."):
        return host
    return f"{safe}-{hashlib.sha256(host.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def params(self) -> Path:
        return self.path / PARAMS_DIR

    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    @property
    def progress(self) -> Path:
        return self.path / PROGRESS

    @property
    def restarts(self) -> Path:
        return self.path / RESTARTS

    @property
    def checkpoint_times(self) -> Path:
        return self.logs / CHECKPOINT_TIMES

    @property
    def record(self) -> Path:
        return self.path / RUN_RECORD

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def submitit(self) -> Path:
        return self.path / SUBMITIT_DIR

    @property
    def writer_lock(self) -> Path:
        return self.path / WRITER_LOCK

    @property
    def writer_reserve(self) -> Path:
        return self.path / WRITER_RESERVE

    def once_marker(self, name: str) -> Path:
        return self.path / ONCE_DIR / f"{name}.json"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    @property
    def heartbeats(self) -> Path:
        return self.logs / HEARTBEAT_DIR

    def node_beat(self, host: str) -> Path:
        """The heartbeat of the ranks on `host` (`NODE_BEAT_GLOB`)."""
        return self.heartbeats / f"node-{_file_name(host)}.json"

    def node_beats(self) -> list[Path]:
        """Every node's heartbeat file (this start's nodes, and those of earlier starts)."""
        return sorted(self.heartbeats.glob(NODE_BEAT_GLOB))

    @property
    def hang_record(self) -> Path:
        """What the rank that announced a hang found, in the latest start."""
        return self.heartbeats / HANG_RECORD

    def injected(self, kind: str, iteration: int, rank: int) -> Path:
        """The marker of a fault injected once (`MJLAB_HPC_FAULT`)."""
        return self.heartbeats / f"injected-{kind}@{iteration}-rank{rank}"

    @property
    def rank_records(self) -> Path:
        return self.logs / RANK_RECORDS_DIR

    def rank_start(self, rank: int, number: int) -> Path:
        """The record of the `number`th start (from 1) of rank `rank`."""
        return self.rank_records / f"rank{rank}.{number}.start.json"

    def rank_end(self, rank: int, number: int) -> Path:
        """How the `number`th start of rank `rank` ended (none: it ended without a word)."""
        return self.rank_records / f"rank{rank}.{number}.end.json"

    def rank_fault(self, rank: int, number: int) -> Path:
        """An empty marker: that start ended in a fault (the batch script's watcher's sign)."""
        return self.rank_records / f"rank{rank}.{number}{FAULT_SUFFIX}"

    def rank_numbers(self) -> dict[int, list[int]]:
        """The start numbers of each rank's start records, in order, by rank."""
        found: dict[int, list[int]] = {}
        with contextlib.suppress(OSError):
            for entry in self.rank_records.iterdir():
                rank, dot, rest = entry.name.removeprefix("rank").partition(".")
                number, _, kind = rest.partition(".")
                if dot and kind == "start.json" and rank.isdigit() and number.isdigit():
                    found.setdefault(int(rank), []).append(int(number))
        return {rank: sorted(numbers) for rank, numbers in sorted(found.items())}

    @property
    def wandb_record(self) -> Path:
        return self.path / WANDB_RECORD

    @property
    def videos(self) -> Path:
        return self.path / VIDEOS_DIR

    def nan_dumps(self, rank: int) -> Path:
        return self.path / NAN_DUMPS_DIR / f"rank{rank}"

    def checkpoint(self, iterations: int) -> Path:
        return self.path / f"model_{iterations}.pt"

    def checkpoints(self) -> list[Path]:
        """Checkpoints, oldest first (by iteration count)."""
        return list_checkpoints(self.path)

    def task_folder(self) -> Path | None:
        """The submitit folder of the run's task output, if it is one of ours.

        Its own `submitit/`, or a sweep element's link to its sweep's shared folder
        (`<experiment>/.sweeps/<sweep>/submitit`); None for none, or a link elsewhere.
        """
        if not self.submitit.is_symlink():
            return self.submitit if self.submitit.is_dir() else None
        real = Path(os.path.realpath(self.submitit))
        if not real.is_dir():
            return None
        if real.parent == Path(os.path.realpath(self.path)):
            return self.submitit
        sweeps = Path(os.path.realpath(self.path.parent / SWEEPS_DIR))
        return real if real.name == SUBMITIT_DIR and real.parent.parent == sweeps else None


def is_run_dir(path: Path) -> bool:
    """Whether `path` looks like a run directory (it holds a file only runs have)."""
    return path.is_dir() and any((path / name).exists() for name in _RUN_MARKERS)


def keep_runs_private() -> None:
    """Make what this process (and what it starts) creates writable by its user alone.

    A umask that lets the group write (002, common on team accounts) would let a teammate
    rename, delete or plant links in a user's run. `GROUP_WRITABLE_ENV=1` keeps the umask.
    """
    if os.environ.get(GROUP_WRITABLE_ENV) != "1":
        os.umask(os.umask(0o022) | 0o022)


def shared_mkdir(path: Path) -> None:
    """Make the folder `path` and its missing parents.

    A folder made in a group-shared one (setgid: a team's log root) is writable by the group
    too, whatever this user's umask: it is where every member's runs go (an experiment
    folder, its `.keys` and `.sweeps`). It is sticky, as /tmp: only an entry's owner may
    rename or delete it, so nobody moves a teammate's run or record away. Such a folder of
    this user made by an older version gets the sticky bit too.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for folder in reversed(missing):
        with contextlib.suppress(OSError):
            if folder.parent.stat().st_mode & stat.S_ISGID:
                os.chmod(folder, folder.stat().st_mode | stat.S_IRWXG | stat.S_ISVTX)
    with contextlib.suppress(OSError):
        st = path.stat()
        shared = st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX
        if shared and st.st_uid == os.geteuid():
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)


def create_run_dir(
    log_root: str | Path, experiment: str, run_name: str = "", now: dt.datetime | None = None
) -> Path:
    """Make a new, empty run directory and return it.

    The final mkdir is atomic, so two launches in the same second cannot share a directory:
    the one that loses gets a `-2`, `-3`, ... suffix. Launchers realise a target
    (`realise_target`) instead of calling this.
    """
    return _new_folder(
        Path(log_root) / experiment, run_dir_name(now or dt.datetime.now(), run_name)
    )


def realise_target(resolved: ResolvedSpec, planned: Path | None = None) -> ResolvedSpec:
    """Return `resolved` with the directory of its run made: where every new run's is made.

    A new run's target without a path gets a new directory (`create_run_dir`; `planned`:
    that name, or the next free one, `new_folder`); a new run in a --run-dir gets that
    folder made. An existing run's target is returned as it is. A spec resolved without
    validation (a library caller's) trains in its --run-dir, if any.
    """
    target = resolved.target
    if target.path is None and resolved.train.run_dir:
        target = dataclasses.replace(target, path=resolved.train.run_dir)
    if target.path is None:
        train = resolved.train
        path = (
            new_folder(planned)
            if planned is not None
            else create_run_dir(train.log_root, resolved.experiment_name, train.run_name)
        )
        return resolved.aimed(dataclasses.replace(target, path=str(path)))
    if target.kind == "new":
        Path(target.path).mkdir(parents=True, exist_ok=True)
    return resolved.aimed(target)


def new_folder(path: Path) -> Path:
    """Make the folder `path` (or `path-2`, ... when taken) atomically: a planned run's or
    sweep's directory."""
    return _new_folder(path.parent, path.name)


def _new_folder(parent: Path, base: str) -> Path:
    """Make `parent/base` (or `base-2`, `base-3`, ... when taken) atomically and return it."""
    shared_mkdir(parent)
    for n in range(1, 10_000):
        candidate = parent / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        if os.environ.get(GROUP_WRITABLE_ENV) != "1":  # the user's alone, whatever the umask
            os.chmod(candidate, stat.S_IMODE(candidate.stat().st_mode) & ~0o022)
        return candidate.resolve()
    raise FileExistsError(f"no free run directory name under {parent} for {base}")


def run_dir_for_key(log_root: str | Path, experiment: str, run_name: str, key: str) -> Path:
    """The run directory recorded under `key` (e.g. `slurm-<job id>`), made on first use.

    Every rank and every restart of one job asks with the same key and gets the same
    directory; a different job gets its own. Of two racing callers exactly one publishes its
    record (`create_exclusive`), the other reads the winner's answer. A record another user
    wrote, or one naming another user's run, is refused (DamagedRecord): a teammate's key
    never sends a job into their run.
    """
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"run directory key must be a plain name, got {key!r}")
    keys = Path(log_root) / experiment / KEYS_DIR
    shared_mkdir(keys)
    record = keys / key
    if os.path.lexists(record):  # a link too: refused as a record of another user's
        return _own_run(record)
    if not os.access(keys, os.W_OK | os.X_OK):  # refused before a run directory is made
        me = user_name(os.geteuid())
        raise ValueError(f"{keys} takes no record of {me}: {_unwritable(keys)}")
    run = create_run_dir(log_root, experiment, run_name)
    try:
        won = create_exclusive(record, f"{run.name}\n".encode())
    except OSError as exc:
        run.rmdir()  # nothing is left of a refused key
        raise ValueError(f"{record} cannot be written: {exc.strerror or exc}") from None
    if not won:
        run.rmdir()  # another caller won the race; its directory is the run's
        return _own_run(record)
    return run


def _unwritable(folder: Path) -> str:
    """Why this user cannot write into `folder`, and what to do."""
    st = folder.stat()
    return (
        f"it belongs to {user_name(st.st_uid)}, {stat.filemode(st.st_mode)}; ask them to let the "
        "group write it (chmod g+w,+t), or name your run with --run-dir"
    )


def _own_run(record: Path) -> Path:
    """The run a key record names, when both are this user's (else DamagedRecord)."""
    run = _recorded_run(record)
    me = os.geteuid()
    for path, what in ((record, "it was written by"), (run, "it names a run of")):
        with contextlib.suppress(FileNotFoundError):
            if (uid := path.lstat().st_uid) != me:
                raise DamagedRecord(
                    record,
                    f"{what} {user_name(uid)}, not {user_name(me)}",
                    "a key is its user's: name your run with --run-dir, or ask "
                    f"{user_name(uid)} to delete the record",
                )
    return run


def _recorded_run(record: Path) -> Path:
    """The run a key or `.latest_run` record names, in the folder the record lies in.

    Records hold the run's name, so a copied or moved log root resolves in the copy; records
    written with an absolute path are read by their last component for the same reason.
    """
    try:
        data = read_regular(record, 4096)
        text = data.decode().strip()
        why = f"it holds {text[:40]!r}, not the name of a run"
    except UnicodeDecodeError:
        text, why = "\n", f"it holds {len(data)} bytes that are not text, not the name of a run"
    except ValueError as exc:  # a directory, a device
        text, why = "\n", str(exc)
    name = Path(text).name
    # One line naming a folder beside the record: anything else would resume (or train) in
    # the experiment folder itself, or elsewhere.
    if not name or name in (".", "..") or "\n" in text or not name.isprintable():
        raise DamagedRecord(
            record,
            why,
            "name the run with --run-dir, or delete the file (the newest run is then used)",
        )
    return (record.parent.parent / name) if record.parent.name == KEYS_DIR else record.parent / name


def latest_run_record(experiment_dir: Path) -> Path:
    """`<experiment>/.latest_run.<uid>`: this user's latest run (each member of a team has
    their own in a shared experiment folder)."""
    return experiment_dir / f"{LATEST_RUN}.{os.geteuid()}"


def record_latest_run(run: Path) -> None:
    """Record `run` as this user's latest, for tools and `--resume`.

    A record of that name that another user made first (a sticky folder keeps it theirs) is
    left: `latest_run` ignores it.
    """
    with contextlib.suppress(PermissionError):
        write_atomic(latest_run_record(run.parent), f"{run.name}\n".encode())


def latest_run(log_root: str | Path, experiment: str) -> Path | None:
    """This user's latest run of the experiment: the one their record names, else the run
    directory of theirs written last. Another user's run is never the answer (a team's log
    root)."""
    parent = Path(log_root) / experiment
    marker = latest_run_record(parent)
    me = os.geteuid()
    with contextlib.suppress(FileNotFoundError):
        if marker.lstat().st_uid == me:
            path = _recorded_run(marker)
            with contextlib.suppress(OSError):
                if path.is_dir() and path.stat().st_uid == me:
                    return path.resolve()
    runs = []
    for p in parent.glob("*"):
        with contextlib.suppress(OSError):
            st = p.stat()
            if not p.name.startswith(".") and stat.S_ISDIR(st.st_mode) and st.st_uid == me:
                runs.append((_last_written(p, st.st_mtime), p.name, p))
    return max(runs)[2].resolve() if runs else None


def _last_written(run: Path, folder_mtime: float) -> float:
    """When a run was last written: its run.json (a start, a stop, an end), else its folder.

    Not its name: `--run-name zz`, a `-2` suffix or a --run-dir of any name would sort first.
    """
    try:
        return os.lstat(run / RUN_RECORD).st_mtime
    except OSError:
        return folder_mtime


@dataclass(frozen=True)
class ElementRecord:
    """`sweep_element.json` in a run directory: the run's place in a sweep."""

    sweep_dir: Path
    """The sweep's folder (`<experiment>/.sweeps/<sweep>`)."""
    index: Count
    """The element's index in the job array."""
    job_id: str
    """Its job (`<array>_<index>` on Slurm, the local controller's pid)."""
    executor: str
    """slurm or local."""
    overrides: Mapping[str, str]
    """The element's values by key, as typed."""
    chain: tuple[str, ...] = ()
    """This element's job in each later job array of a --chain, in order."""

    @property
    def label(self) -> str:
        """`seed=0 learning_rate=3e-4`: the element's values, as typed."""
        return " ".join(f"{k.removeprefix('agent.')}={v}" for k, v in self.overrides.items())


@dataclass(frozen=True)
class SweepMember(ElementRecord):
    """An element as the sweep's record lists it: with its run directory."""

    run_dir: Path | None = None
    """The element's run directory."""


@dataclass(frozen=True)
class SweepRecord:
    """`sweep.json` in a sweep's folder: its elements and jobs."""

    executor: str
    """slurm or local."""
    array_job_id: str | None = None
    """The job array (None: local jobs)."""
    created_at: str | None = None
    """When it was submitted, ISO 8601."""
    axes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Each swept key's values, as typed."""
    array_parallelism: Count | None = None
    """--array-parallelism."""
    chain_array_job_ids: tuple[str, ...] = ()
    """The later job arrays of a --chain."""
    elements: tuple[SweepMember, ...] = ()
    """Every element, by index."""


def write_element(run_dir: Path, element: ElementRecord) -> None:
    """Write the run's sweep element record (a chain's jobs only when it has any)."""
    data = plain(element)
    if not element.chain:
        del data["chain"]
    write_json_atomic(run_dir / ELEMENT_RECORD, data)


def read_element(run_dir: Path, unread: list[str] | None = None) -> ElementRecord | None:
    """The run's sweep element record, None if the run is not part of a sweep (or the record
    is damaged: named in `unread`)."""
    return read_optional(ElementRecord, run_dir / ELEMENT_RECORD, run_dir, unread)


def write_sweep(sweep_dir: Path, record: SweepRecord) -> None:
    """Write a sweep's record (`sweep.json`)."""
    data = plain(record)
    for element, member in zip(data["elements"], record.elements, strict=True):
        if not member.chain:
            del element["chain"]
    write_json_atomic(sweep_dir / SWEEP_RECORD, data)


def read_sweep(sweep_dir: Path, unread: list[str] | None = None) -> SweepRecord | None:
    """The sweep record (`sweep.json`) of a sweep directory, None if there is none (or it is
    damaged: named in `unread`)."""
    return read_optional(SweepRecord, sweep_dir / SWEEP_RECORD, sweep_dir, unread)

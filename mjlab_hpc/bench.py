"""`make bench` / `python -m mjlab_hpc.bench`: the performance figures of this machine.

Every figure is a ratio of two things measured alternately in the same run (A B A B ...), so a
busy machine slows both sides of a pair alike; each is reported as the median over the pairs
with its spread (quartiles, min-max). The real CLIs run as subprocesses with `--torch-threads 1`:

1. scaling efficiency: env-steps/s (collection + update) of 2 ranks / (2 x 1 rank), same envs
   per rank (`mjlab-train` vs `mjlab-submit --executor local --tasks-per-node 2`);
2. collective share: time inside torch.distributed collectives / iteration time at 2 ranks;
3. rollout overhead: `env.step` throughput / raw MuJoCo Warp graph replay (`env.simulate()`) of
   the same worlds and substeps, for each built-in task;
4. launch cost: start of `mjlab-submit --executor local` to its first finished iteration /
   the same for a plain `mjlab-train` (warm kernel cache); and Warp kernel compilations of a
   2-rank job / a 1-rank job on a cold cache (each module compiled once per node, not per rank);
5. recovery: USR2 to the 2-rank job, stop at the next iteration boundary, checkpoint, restart by
   the local executor, resume: signal to checkpoint in iterations, restart to first resumed
   iteration / first start to first iteration, and iterations lost;
6. mjlab: env-steps/s of an mjlab task through `mjlab-train` / mjlab's own `train`, on
   mjlab's physics path (no Warp graph on CPU), and with our graph replay.

Writes `<out>/bench.json` and `<out>/bench.png` and prints a table last. `--quick` is a short
smoke run (small envs, one pair, a partly cold cache) whose figures are not meaningful.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import tyro

SCHEMA_VERSION = 1
# Launcher variables of an enclosing job: a benchmark subprocess must start as a plain process.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCH_PREFIXES = ("SLURM_", "SUBMITIT_")
# Warp compiles each module in `<cache>/<module>_p<pid>_t<thread>` and renames it when done.
_BUILD_DIR = re.compile(r"^(?P<module>wp_.+)_p(?P<pid>\d+)_t\d+$")
_POLL_S = 0.02
# Left out of the copied cache by --quick: a mujoco_warp module every model's step loads (one
# compile of a few seconds instead of ~30 modules and ~40 s).
QUICK_COLD_MODULES = ("wp_mujoco_warp._src.passive_",)


@dataclass(frozen=True)
class BenchConfig:
    """Benchmarks of scaling, collectives, rollout overhead, launch and recovery on this
    machine (CPU ranks). Writes <out>/bench.json and <out>/bench.png."""

    quick: bool = False
    """Short smoke run (small envs, one pair, a partly cold cache): checks the machinery only."""
    out: Path = Path("bench-results")
    """Folder for bench.json, bench.png and runs/ (the runs' directories, replaced)."""
    repeats: int | None = None
    """Repeats of the training runs, one A/B pair each (default: 3; 1 with --quick); the
    rollout benchmark takes at least 7 pairs (they are cheap)."""
    num_envs: int | None = None
    """Envs per rank, and worlds of the rollout benchmark (default: 1024; 64 with --quick)."""
    iterations: int | None = None
    """Measured PPO iterations per run after one warm-up iteration (default: 8; 1 with --quick)."""
    task: str = "cartpole"
    """Task of the training runs (scaling, collectives, launch, recovery, compilations)."""
    rollout_tasks: tuple[str, ...] = ("cartpole", "ant")
    """Tasks of the rollout-overhead benchmark."""
    cold_compile: bool = True
    """Measure kernel compilations on a cold cache (a partly cold one with --quick)."""
    mjlab_task: str = "Mjlab-Cartpole-Balance"
    """mjlab task of the comparison with mjlab's own `train` (needs the [mjlab] extra)."""
    mjlab_envs: int | None = None
    """Envs of the mjlab comparison (default: 256; 16 with --quick)."""
    mjlab_repeats: int | None = None
    """Repeats of the mjlab comparison (default: 5; 1 with --quick): separate processes of
    the same program differ by up to ~10% on a shared machine, so it takes more than 3."""
    run_timeout_s: float = 300.0
    """Give up on one subprocess after this long."""

    @property
    def pairs(self) -> int:
        return self.repeats or (1 if self.quick else 3)

    @property
    def envs(self) -> int:
        return self.num_envs or (64 if self.quick else 1024)

    @property
    def measured(self) -> int:
        return self.iterations or (1 if self.quick else 8)

    @property
    def mjlab_pairs(self) -> int:
        return self.mjlab_repeats or (1 if self.quick else 5)

    @property
    def mjlab_num_envs(self) -> int:
        return self.mjlab_envs or (16 if self.quick else 256)


# --- statistics and figures ------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, quartiles and min-max of some samples (None when there are none)."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return {"median": None, "q1": None, "q3": None, "min": None, "max": None, "n": 0}
    q1, q3 = (
        (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2))
        if len(xs) > 1
        else (xs[0], xs[0])
    )
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


@dataclass(frozen=True)
class Figure:
    """One reported ratio: its samples (one per A/B pair) and its target."""

    key: str
    label: str
    samples: tuple[float, ...]
    target: float
    direction: Literal[">=", "<="]
    definition: str
    section: str

    def summary(self) -> dict[str, Any]:
        s = spread(self.samples)
        med = s["median"]
        met = None
        if med is not None:
            met = med >= self.target if self.direction == ">=" else med <= self.target
        return {
            "label": self.label,
            "section": self.section,
            "definition": self.definition,
            **s,
            "samples": [round(x, 5) for x in self.samples],
            "target": self.target,
            "direction": self.direction,
            "met": met,
        }


# --- processes --------------------------------------------------------------------------------


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark subprocess: ours, without an enclosing job's launcher
    variables, with this interpreter's scripts first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def cli(name: str) -> str:
    """The path of one of our console scripts, next to this interpreter if it is there."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def rank_pids(submitit_dir: Path) -> list[int]:
    """PIDs of the rank processes a local executor job runs from `submitit_dir`."""
    # The ranks' command lines carry the absolute folder (--out may be relative).
    needle = f"submitit.core._submit {Path(submitit_dir).resolve()}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in cmd:
            found.append(int(entry.name))
    return sorted(found)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def process_alive(pid: int) -> bool:
    """Whether a process exists and has not exited (a zombie awaiting its parent has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def process_start_time(pid: int) -> float | None:
    """When a live process started (epoch seconds, 1/CLK_TCK resolution)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - start_ticks / _clock_ticks())


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine have spent busy since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / _clock_ticks()


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform's answer elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a file (a torn last line is ignored)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """End a subprocess we started in its own session, and everything it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# --- one training job, watched ----------------------------------------------------------------


def session_pids(sid: int) -> list[int]:
    """Live processes of one session (a job we started with start_new_session)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) == sid:
                    found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far: per rank, by the job's launcher processes, by this benchmark
    process, and by the whole machine."""

    at: float
    ranks: dict[int, float]
    launcher: dict[int, float]
    bench: float
    machine: float

    @classmethod
    def take(cls, rank_pids: Sequence[int], session: int) -> CpuSnapshot:
        ranks = {p: c for p in rank_pids if (c := process_cpu_s(p)) is not None}
        launcher = {
            p: c
            for p in session_pids(session)
            if p not in ranks and (c := process_cpu_s(p)) is not None
        }
        return cls(time.time(), ranks, launcher, time.process_time(), machine_busy_s())


@dataclass(frozen=True)
class CpuWindow:
    """CPU use between two snapshots, in cores (CPU seconds per wall second)."""

    wall_s: float = 0.0
    rank_cores: tuple[float, ...] = ()
    launcher_cores: float = math.nan
    bench_cores: float = math.nan
    machine_cores: float = math.nan

    @classmethod
    def between(cls, a: CpuSnapshot, b: CpuSnapshot) -> CpuWindow:
        wall = b.at - a.at
        if wall <= 0:
            return cls()

        def delta(x: dict[int, float], y: dict[int, float]) -> list[float]:
            # Only processes alive at both ends: one that started or ended inside the window
            # would count its whole life.
            return [(y[p] - x[p]) / wall for p in x if p in y]

        return cls(
            wall_s=wall,
            rank_cores=tuple(delta(a.ranks, b.ranks)),
            launcher_cores=sum(delta(a.launcher, b.launcher)),
            bench_cores=(b.bench - a.bench) / wall,
            machine_cores=(b.machine - a.machine) / wall,
        )

    @property
    def rank_busy(self) -> float:
        """Mean fraction of the window each rank spent on a core."""
        return statistics.mean(self.rank_cores) if self.rank_cores else math.nan

    @property
    def other_cores(self) -> float:
        """Cores used by everything that is not this job or this benchmark (other sessions)."""
        ours = sum(self.rank_cores) + self.launcher_cores + self.bench_cores
        return self.machine_cores - ours

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "rank_cores": [round(c, 3) for c in self.rank_cores],
            "launcher_cores": round(self.launcher_cores, 3),
            "bench_cores": round(self.bench_cores, 3),
            "machine_cores": round(self.machine_cores, 3),
            "other_cores": round(self.other_cores, 3),
        }


@dataclass
class JobTrace:
    """What watching one training job saw."""

    label: str
    ranks: int
    returncode: int | None = None
    submitted_at: float = 0.0
    first_rank_start: float | None = None
    first_iteration_at: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    cpu: CpuWindow = field(default_factory=CpuWindow)
    signal_sent_at: float | None = None
    restart_rank_start: float | None = None
    old_ranks_gone_at: float | None = None
    first_resumed_at: float | None = None
    stops: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    run_dir: str | None = None
    output_tail: str = ""

    @property
    def launch_s(self) -> float | None:
        """Submission (subprocess start) to the first finished iteration on disk."""
        if self.first_iteration_at is None:
            return None
        return self.first_iteration_at - self.submitted_at

    def window(self, first: int, last: int) -> list[dict[str, Any]]:
        """Progress records of iterations first..last (1-based, inclusive) of the first start."""
        seen: dict[int, dict[str, Any]] = {}
        for r in self.records:
            seen.setdefault(int(r["iteration"]), r)
        return [seen[i] for i in range(first, last + 1) if i in seen]


@dataclass
class _Watch:
    """Mutable state of the polling loop of `watch_job`."""

    pids: set[int] = field(default_factory=set)
    cpu_start: CpuSnapshot | None = None
    stop_iteration: int | None = None
    next_pid_scan: float = 0.0
    signaled: set[int] = field(default_factory=set)


def _find_run_dir(log_root: Path) -> Path | None:
    runs = [p for p in log_root.glob("*/*") if p.is_dir() and not p.name.startswith(".")]
    return runs[0] if len(runs) == 1 else None


def watch_job(
    cmd: Sequence[str],
    *,
    label: str,
    ranks: int,
    log_root: Path,
    env: dict[str, str],
    cpu_window: tuple[int, int] | None = None,
    signal_after: int | None = None,
    timeout_s: float = 300.0,
) -> JobTrace:
    """Run one training CLI to its end while polling its run directory.

    Times the first finished iteration, the CPU the ranks and the machine used between the
    iterations `cpu_window` (first, last) were written, and with `signal_after` sends USR2 to
    every rank once that many iterations are on disk, then times the restart and resume.
    """
    trace = JobTrace(label=label, ranks=ranks)
    log_root.mkdir(parents=True, exist_ok=True)
    out_path = log_root / f"{label}.out"
    state = _Watch()
    in_process = "mjlab-submit" not in Path(cmd[0]).name
    with open(out_path, "w") as out:
        trace.submitted_at = time.time()
        # A session of its own, so that a failure can end the whole job (launcher and ranks).
        proc = subprocess.Popen(
            list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                done = proc.poll() is not None
                _poll_once(trace, state, proc, log_root, in_process, cpu_window, signal_after)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: no end within {timeout_s:.0f} s")
                time.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                kill_group(proc)
            trace.returncode = proc.returncode
    trace.output_tail = out_path.read_text(errors="replace")[-3000:]
    run = _find_run_dir(log_root)
    if run is not None:
        trace.run_dir = str(run)
        trace.records = read_jsonl(run / "progress.jsonl")
        trace.stops = read_jsonl(run / "restarts.jsonl")
        with contextlib.suppress(OSError, json.JSONDecodeError):
            trace.record = json.loads((run / "run.json").read_text())
    return trace


def _poll_once(
    trace: JobTrace,
    state: _Watch,
    proc: subprocess.Popen[Any],
    log_root: Path,
    in_process: bool,
    cpu_window: tuple[int, int] | None,
    signal_after: int | None,
) -> None:
    now = time.time()
    run = _find_run_dir(log_root)
    # The ranks: the CLI itself when it trains in-process, else the local executor's tasks.
    if in_process:
        pids = [proc.pid]
    elif run is not None and now >= state.next_pid_scan:
        pids = rank_pids(run / "submitit")
        state.next_pid_scan = now + 0.1
    else:
        pids = sorted(state.pids)
    new = [p for p in pids if p not in state.pids]
    if new:
        starts = [s for s in (process_start_time(p) for p in new) if s is not None]
        if starts and trace.first_rank_start is None:
            trace.first_rank_start = min(starts)
        elif starts and trace.signal_sent_at is not None and trace.restart_rank_start is None:
            trace.restart_rank_start = min(starts)
        state.pids.update(new)
    if run is None:
        return
    records = read_jsonl(run / "progress.jsonl")
    if records and trace.first_iteration_at is None:
        trace.first_iteration_at = now
    done_its = len(records)
    if cpu_window is not None and state.cpu_start is None and done_its >= cpu_window[0]:
        state.cpu_start = CpuSnapshot.take(pids, proc.pid)
    if (
        cpu_window is not None
        and state.cpu_start is not None
        and trace.cpu.wall_s == 0.0
        and done_its >= cpu_window[1]
    ):
        trace.cpu = CpuWindow.between(state.cpu_start, CpuSnapshot.take(pids, proc.pid))
    if signal_after is not None and trace.signal_sent_at is None and done_its >= signal_after:
        trace.signal_sent_at = time.time()
        state.signaled = set(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
    gone = state.signaled and not any(process_alive(p) for p in state.signaled)
    if gone and trace.old_ranks_gone_at is None:
        trace.old_ranks_gone_at = now
    if trace.signal_sent_at is not None and state.stop_iteration is None:
        stops = read_jsonl(run / "restarts.jsonl")
        if stops:
            state.stop_iteration = int(stops[0]["iteration"])
    if (
        state.stop_iteration is not None
        and trace.restart_rank_start is not None
        and trace.first_resumed_at is None
        and any(int(r["iteration"]) > state.stop_iteration for r in records)
    ):
        trace.first_resumed_at = now


def throughput(records: Sequence[dict[str, Any]]) -> float:
    """Env-steps/s over some iterations (all ranks): steps / (collection + update) time."""
    steps = sum(r["env_steps"] for r in records)
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return steps / secs if secs > 0 else math.nan


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RSL_ITERATION = re.compile(r"Learning iteration\s+(\d+)/\d+")
_RSL_FIELDS = {
    "Total steps": "total_steps",
    "Collection time": "collect_s",
    "Learning time": "learn_s",
    "Mean reward": "reward",
}
_RSL_FIELD = re.compile(r"^\s*(?P<key>[A-Za-z ]+):\s*(?P<value>-?[\d.]+(?:e[-+]?\d+)?)s?\s*$")


def parse_rsl_rl_log(text: str) -> list[dict[str, Any]]:
    """Progress records (iteration from 1, env_steps, collect_s, learn_s, reward) from the
    console log of rsl-rl's OnPolicyRunner, as mjlab's own `train` prints it."""
    records: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in _ANSI.sub("", text).splitlines():
        if m := _RSL_ITERATION.search(line):
            current = {"iteration": int(m.group(1)) + 1}
            records.append(current)
        elif current is not None and (m := _RSL_FIELD.match(line)):
            key = _RSL_FIELDS.get(m.group("key").strip())
            if key is not None:
                current[key] = float(m.group("value"))
    # No "Mean reward" until an episode has ended.
    needed = ("total_steps", "collect_s", "learn_s")
    complete = [r for r in records if all(k in r for k in needed)]
    previous = 0.0
    for r in complete:  # "Total steps" counts from the start
        r["env_steps"] = r["total_steps"] - previous
        previous = r["total_steps"]
    return complete


def collective_share(records: Sequence[dict[str, Any]]) -> float:
    """Time inside collectives / iteration time, over some iterations (rank 0's view)."""
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return sum(r["collective_s"] for r in records) / secs if secs > 0 else math.nan


# --- kernel compilations ----------------------------------------------------------------------


class CompileWatch:
    """Counts Warp module compilations into one kernel-cache directory, per process.

    Warp compiles every module in a fresh `<module>_p<pid>_t<thread>` folder of the cache and
    renames it into place; a module loaded from the cache makes none. Watching those folders
    appear (inotify; a fast listing poll where inotify is missing) counts real compilations by
    each process, which the finished cache alone cannot show: two ranks compiling the same
    module leave one folder.
    """

    _IN_CREATE, _IN_MOVED_TO, _IN_ISDIR, _IN_NONBLOCK = 0x100, 0x80, 0x40000000, 0o4000

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.compiles: list[tuple[str, int]] = []
        self.method = "inotify"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._seen: set[str] = set()

    def __enter__(self) -> CompileWatch:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._fd = self._inotify()
        if self._fd < 0:
            self.method = "poll"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._fd >= 0:
            os.close(self._fd)

    def _inotify(self) -> int:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = int(libc.inotify_init1(self._IN_NONBLOCK))
            if fd < 0:
                return -1
            mask = self._IN_CREATE | self._IN_MOVED_TO
            if libc.inotify_add_watch(fd, str(self.cache_dir).encode(), mask) < 0:
                os.close(fd)
                return -1
            return fd
        except (OSError, AttributeError):
            return -1

    def _record(self, name: str) -> None:
        m = _BUILD_DIR.match(name)
        if m and name not in self._seen:
            self._seen.add(name)
            self.compiles.append((m["module"], int(m["pid"])))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._fd < 0:
                with contextlib.suppress(OSError):
                    for entry in os.scandir(self.cache_dir):
                        self._record(entry.name)
                time.sleep(0.005)
                continue
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            if not ready:
                continue
            with contextlib.suppress(BlockingIOError):
                self._parse(os.read(self._fd, 65536))

    def _parse(self, buf: bytes) -> None:
        head = struct.calcsize("iIII")
        pos = 0
        while pos + head <= len(buf):
            _, mask, _, length = struct.unpack_from("iIII", buf, pos)
            name = buf[pos + head : pos + head + length].split(b"\0", 1)[0].decode()
            pos += head + length
            if mask & self._IN_ISDIR:
                self._record(name)

    def summary(self) -> dict[str, Any]:
        per_pid: dict[int, int] = {}
        for _, pid in self.compiles:
            per_pid[pid] = per_pid.get(pid, 0) + 1
        return {
            "compilations": len(self.compiles),
            "distinct_modules": len({m for m, _ in self.compiles}),
            "processes_compiling": len(per_pid),
            "per_process": sorted(per_pid.values(), reverse=True),
            "method": self.method,
        }


def warp_version() -> str:
    """The installed warp-lang version (Warp's cache has a folder per version)."""
    return importlib.metadata.version("warp-lang")


def default_kernel_cache() -> Path:
    """Where Warp keeps compiled kernels for subprocesses started with our environment."""
    base = os.environ.get("WARP_CACHE_PATH")
    if base:
        return Path(base).resolve() / warp_version()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "warp" / warp_version()


def prepare_cache(base: Path, warm_from: Path | None, drop: Sequence[str] = ()) -> Path:
    """A kernel cache under `base` (WARP_CACHE_PATH): empty, or a copy of `warm_from` without
    the modules whose names start with one of `drop` (a partly cold cache). Returns the
    version folder that Warp fills."""
    shutil.rmtree(base, ignore_errors=True)
    cache = base / warp_version()
    cache.mkdir(parents=True)
    if warm_from is None or not warm_from.is_dir():
        return cache
    for p in warm_from.iterdir():
        if _BUILD_DIR.match(p.name) or p.name.startswith(tuple(drop)):
            continue
        if p.is_dir():
            shutil.copytree(p, cache / p.name)
        else:
            shutil.copy2(p, cache / p.name)
    return cache


# --- rollout overhead: runs in a subprocess ---------------------------------------------------


def rollout_worker(args_json: str) -> dict[str, Any]:
    """env.step vs raw graph replay of the same worlds, alternately, for each task.

    Runs in a fresh process with one torch thread (called through `python -c`). The two
    alternate at every step from the same state with the same fixed actions.
    """
    import torch
    import warp as wp

    from mjlab_hpc.tasks import get_task

    args = json.loads(args_json)
    wp.config.quiet = True
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in args["tasks"]:
        task = get_task(name)
        if task.make_env is None:
            raise ValueError(f"{name}: the rollout benchmark takes built-in tasks")
        with wp.ScopedDevice("cpu"):
            env = task.make_env(args["num_envs"], "cpu", 0, True)
            out[name] = _rollout_pairs(env, args["pairs"], args["block_s"])
    return out


def _rollout_pairs(env: Any, pairs: int, block_s: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    actions = torch.rand((env.num_envs, env.num_actions), generator=gen) * 2 - 1
    state = env.state_dict()

    def timed(fn: Callable[[], object], k: int) -> float:
        env.load_state_dict(state)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return time.perf_counter() - t0

    def pair(k: int) -> tuple[float, float]:
        # Alternate at every step (raw replay, back to the same state, env.step), so that both
        # sides of a pair see the same states and the same moments of machine load.
        env.load_state_dict(state)
        raw = stepped = 0.0
        for _ in range(k):
            before = env.state_dict()
            t0 = time.perf_counter()
            env.simulate()
            t1 = time.perf_counter()
            env.load_state_dict(before)
            t2 = time.perf_counter()
            env.step(actions)
            t3 = time.perf_counter()
            raw += t1 - t0
            stepped += t3 - t2
        return raw, stepped

    # Enough steps per pair for block_s of physics (a short block is all timer noise).
    per = timed(env.simulate, 3) / 3
    k = max(3, math.ceil(block_s / max(per, 1e-6)))
    pair(2)  # warm-up of the torch side
    raw, stepped = [], []
    for _ in range(pairs):
        r, st = pair(k)
        raw.append(r)
        stepped.append(st)
    breakdown = _step_breakdown(env, actions, state, k)
    n = env.num_envs
    return {
        "steps_per_block": k,
        "num_envs": n,
        "decimation": env.cfg.decimation,
        "raw_env_steps_per_s": [k * n / s for s in raw],
        "step_env_steps_per_s": [k * n / s for s in stepped],
        "ratios": [r / s for r, s in zip(raw, stepped, strict=True)],
        "step_breakdown_us": breakdown,
    }


def _step_breakdown(env: Any, actions: Any, state: dict[str, Any], k: int) -> dict[str, float]:
    """Microseconds per env.step in each of its parts (a profile of the overhead)."""
    import torch

    env.load_state_dict(state)
    done = torch.zeros(env.num_envs, dtype=torch.bool)
    parts: dict[str, Callable[[], object]] = {
        "actions_to_ctrl": lambda: env.ctrl.copy_(actions.clamp(-1.0, 1.0) * env.cfg.action_scale),
        "physics": env.simulate,
        "reward_termination": env._reward_and_termination,
        "reset_worlds": lambda: env._reset_worlds(done),
        "observations": env._observations,
        "wrap_tensordict": lambda: env._wrap(env._obs),
    }
    out = {}
    for name, fn in parts.items():
        env.load_state_dict(state)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        out[name] = (time.perf_counter() - t0) / k * 1e6
    env.load_state_dict(state)
    return out


def run_rollout(cfg: BenchConfig, env: dict[str, str]) -> dict[str, Any]:
    """Run `rollout_worker` in a fresh interpreter and return its result."""
    args = {
        "tasks": list(cfg.rollout_tasks),
        "num_envs": cfg.envs,
        "pairs": 2 if cfg.quick else max(cfg.pairs, 7),
        "block_s": 0.05 if cfg.quick else 0.3,
    }
    code = (
        "import json, sys\n"
        "from mjlab_hpc.bench import rollout_worker\n"
        "print('BENCH-RESULT ' + json.dumps(rollout_worker(sys.argv[1])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=cfg.run_timeout_s,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            return dict(json.loads(line.removeprefix("BENCH-RESULT ")))
    raise RuntimeError(f"rollout benchmark failed ({proc.returncode}): {proc.stderr[-2000:]}")


# --- the benchmark -----------------------------------------------------------------------------


@dataclass
class Bench:
    """One benchmark session: its config, where it writes, and what it has measured."""

    cfg: BenchConfig
    say: Callable[[str], None]
    runs: Path = field(init=False)
    env: dict[str, str] = field(init=False)
    traces: dict[str, list[JobTrace]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runs = self.cfg.out / "runs"
        self.env = bench_env()

    def train_args(self, log_root: Path, iterations: int) -> list[str]:
        return [
            self.cfg.task,
            "--num-envs", str(self.cfg.envs),
            "--max-iterations", str(iterations),
            "--torch-threads", "1",
            "--seed", "7",
            "--save-interval", "1000",
            "--log-root", str(log_root),
        ]  # fmt: skip

    def mjlab_args(self, log_root: Path, iterations: int, graph: bool) -> list[str]:
        """Our CLIs' arguments for the mjlab task; without `graph`, mjlab's physics path on
        CPU (mjlab never captures Warp graphs there)."""
        return [
            self.cfg.mjlab_task,
            "--num-envs", str(self.cfg.mjlab_num_envs),
            "--max-iterations", str(iterations),
            "--torch-threads", "1",
            "--log-root", str(log_root),
            *([] if graph else ["--no-use-graph"]),
            "--agent.logger", "tensorboard",
        ]  # fmt: skip

    def submit_args(self, train_args: list[str], ranks: int) -> list[str]:
        return [
            cli("mjlab-submit"),
            *train_args,
            "--executor", "local",
            "--gpus-per-node", "0",
            "--tasks-per-node", str(ranks),
            "--follow",
        ]  # fmt: skip

    def job(
        self,
        name: str,
        ranks: int,
        iterations: int,
        *,
        submit: bool,
        cache: CompileWatch | None = None,
        args: list[str] | None = None,
        **kw: Any,
    ) -> JobTrace:
        """Run `mjlab-train` (1 rank, in-process) or `mjlab-submit --executor local` (`ranks`
        tasks) under `<runs>/<name>`, watched by `watch_job`; with `cache`, on that kernel cache
        while counting its compilations. `args`: the training arguments (default: the built-in
        task's, `train_args`)."""
        root = self.runs / name
        train = args if args is not None else self.train_args(root, iterations)
        cmd = self.submit_args(train, ranks) if submit else [cli("mjlab-train"), *train]
        env = self.env
        if cache is not None:
            env = bench_env({"WARP_CACHE_PATH": str(cache.cache_dir.parent)})
        with cache if cache is not None else contextlib.nullcontext():
            trace = watch_job(
                cmd,
                label=name,
                ranks=ranks,
                log_root=root,
                env=env,
                timeout_s=self.cfg.run_timeout_s,
                **kw,
            )
        self.traces.setdefault(name.rsplit("-", 1)[0], []).append(trace)
        if cache is not None:
            self.details.setdefault("compilations", {})[name] = {
                **cache.summary(),
                "cache": "partly cold" if self.cfg.quick else "cold",
                "modules_in_cache": sum(
                    1 for p in cache.cache_dir.iterdir() if p.name.startswith("wp_")
                ),
                "launch_s": trace.launch_s,
            }
            shutil.rmtree(cache.cache_dir.parent, ignore_errors=True)
        if trace.returncode != 0:
            self.failures.append(f"{name}: exit {trace.returncode}\n{trace.output_tail[-1500:]}")
            self.say(f"  {name}: FAILED (exit {trace.returncode}), output in {root}")
        else:
            launch = f"{trace.launch_s:.1f}" if trace.launch_s is not None else "n/a"
            self.say(f"  {name}: done, first iteration after {launch} s")
        return trace

    def cold_cache(self, name: str) -> CompileWatch:
        """A fresh kernel cache for one job and a watch counting its compilations: empty, or
        with --quick a copy of the warm cache less a few modules (compiling all takes ~30 s)."""
        warm = default_kernel_cache() if self.cfg.quick else None
        cache = prepare_cache(self.runs / f"warp-cache-{name}", warm, QUICK_COLD_MODULES)
        return CompileWatch(cache)

    # -- experiments --

    def rollout(self) -> None:
        self.say(f"rollout overhead: {', '.join(self.cfg.rollout_tasks)} x {self.cfg.envs} worlds")
        try:
            self.details["rollout"] = run_rollout(self.cfg, self.env)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.failures.append(f"rollout: {exc}")
            self.details["rollout"] = {}

    def training_pairs(self) -> None:
        """Per repeat: 1 rank (mjlab-train), 2 ranks (mjlab-submit, preempted once), 1 rank
        (mjlab-submit). With --quick the first two also count compilations on a partly cold
        cache (separate cold jobs would double the smoke run's time)."""
        last = self.cfg.measured + 1  # iteration 1 is the warm-up
        piggyback = self.cfg.quick and self.cfg.cold_compile
        for r in range(1, self.cfg.pairs + 1):
            self.say(f"repeat {r}/{self.cfg.pairs}: 1 rank | 2 ranks + preemption | submit 1 rank")
            first = piggyback and r == 1
            self.job(
                f"one-{r}",
                1,
                last,
                submit=False,
                cache=self.cold_cache("one") if first else None,
                cpu_window=(1, last),
            )
            # Ends 2 iterations after the measured ones: USR2 stops the job at the next
            # boundary, the executor restarts it, and it resumes to the end.
            self.job(
                f"two-{r}",
                2,
                last + 2,
                submit=True,
                cache=self.cold_cache("two") if first else None,
                cpu_window=(1, last),
                signal_after=last,
            )
            self.job(f"submit1-{r}", 1, 1, submit=True)

    def mjlab_pairs(self) -> None:
        """Per repeat, in alternating order (A B C, then C B A, ...): mjlab's own `train`, our
        `mjlab-train` on mjlab's physics path (no graph), and ours with graph replay (our
        default). All three run alike: a plain subprocess, one torch thread, nothing polling
        them; their progress is read afterwards. (`mjlab-submit --executor local` runs the
        same rank code after a second import of mjlab in the submitting process.)"""
        task, envs = self.cfg.mjlab_task, self.cfg.mjlab_num_envs
        if importlib.util.find_spec("mjlab") is None:
            self.details["mjlab"] = {"skipped": "the [mjlab] extra is not installed"}
            self.say("mjlab comparison: skipped (the [mjlab] extra is not installed)")
            return
        last = self.cfg.measured + 1
        runs: list[dict[str, Any]] = []
        self.details["mjlab"] = {"task": task, "num_envs": envs, "pairs": runs}
        sides = ("mjlab_train", "ours", "ours_graph")
        for r in range(1, self.cfg.mjlab_pairs + 1):
            order = sides if r % 2 else sides[::-1]
            self.say(f"mjlab {r}/{self.cfg.mjlab_pairs}: {task} x {envs} envs: {' | '.join(order)}")
            got: dict[str, list[dict[str, Any]]] = {}
            for side in order:
                records = self.mjlab_run(side, r, last)
                if records is None:
                    break
                got[side] = records
            if len(got) < len(sides):
                continue
            runs.append(
                {
                    **{side: throughput(got[side]) for side in sides},
                    # The same configs and seeds: the same rewards iteration by iteration show
                    # that both sides did the same work.
                    "same_rewards": [_reward(x.get("reward")) for x in got["mjlab_train"]]
                    == [_reward(x.get("mean_reward")) for x in got["ours"]],
                }
            )

    def mjlab_run(self, side: str, repeat: int, iterations: int) -> list[dict[str, Any]] | None:
        """One side of the mjlab comparison in `<runs>/mjlab-<side>-<repeat>`: its progress
        records of iterations 2..`iterations`, None if it failed."""
        name = f"mjlab-{side.replace('_', '-')}-{repeat}"
        cwd = (self.runs / name).resolve()  # the runs start there: no relative paths
        cwd.mkdir(parents=True)
        if side == "mjlab_train":
            cmd = [
                cli("train"), self.cfg.mjlab_task,
                "--env.scene.num-envs", str(self.cfg.mjlab_num_envs),
                "--agent.max-iterations", str(iterations),
                "--agent.logger", "tensorboard",
                "--gpu-ids", "None",
            ]  # fmt: skip
        else:
            cmd = [
                cli("mjlab-train"),
                *self.mjlab_args(cwd / "logs", iterations, graph=side == "ours_graph"),
            ]
        out = cwd / f"{name}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                # mjlab's train has no thread flag: torch reads OMP_NUM_THREADS (both sides).
                env=bench_env({"OMP_NUM_THREADS": "1"}),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a timeout ends the whole job, ranks included
            )
            try:
                proc.wait(timeout=self.cfg.run_timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(proc)
        text = out.read_text(errors="replace")
        if side == "mjlab_train":
            records = parse_rsl_rl_log(text)
        else:
            run = _find_run_dir(cwd / "logs")
            records = read_jsonl(run / "progress.jsonl") if run is not None else []
        records = [r for r in records if 2 <= r["iteration"] <= iterations]
        if proc.returncode != 0 or len(records) != iterations - 1:
            self.failures.append(f"{name}: exit {proc.returncode}\n{text[-1500:]}")
            self.say(f"  {name}: FAILED (exit {proc.returncode}), output in {out}")
            return None
        self.say(f"  {name}: {throughput(records):,.0f} env-steps/s")
        return records

    def compilations(self) -> None:
        """Kernel compilations of a 1-rank and a 2-rank job, each on an empty kernel cache."""
        self.say("kernel compilations on a cold cache: 1-rank job, then 2-rank job")
        self.job("cold-1", 1, 1, submit=False, cache=self.cold_cache("cold-1"))
        self.job("cold-2", 2, 1, submit=True, cache=self.cold_cache("cold-2"))

    # -- figures --

    def figures(self) -> list[Figure]:
        n = self.cfg.measured
        last = n + 1
        ones, twos, subs = (self.traces.get(k, []) for k in ("one", "two", "submit1"))
        eff, coll, launch, launch2, resume, stop_its, lost = [], [], [], [], [], [], []
        pair_details = []
        for a, b, c in zip(ones, twos, subs, strict=False):
            ta, tb = throughput(a.window(2, last)), throughput(b.window(2, last))
            eff.append(tb / (2 * ta))
            coll.append(collective_share(b.window(2, last)))
            if a.launch_s and c.launch_s:
                launch.append(c.launch_s / a.launch_s)
            if a.launch_s and b.launch_s:
                launch2.append(b.launch_s / a.launch_s)
            rec = recovery(b)
            if rec.get("resume_ratio") is not None:
                resume.append(rec["resume_ratio"])
            if rec.get("stop_iterations") is not None:
                stop_its.append(rec["stop_iterations"])
            if rec.get("iterations_lost") is not None:
                lost.append(float(rec["iterations_lost"]))
            pair_details.append(
                {
                    "throughput_1rank": ta,
                    "throughput_2ranks": tb,
                    "iteration_s_1rank": _median_iter_s(a.window(2, last)),
                    "iteration_s_2ranks": _median_iter_s(b.window(2, last)),
                    "collect_s_share_2ranks": _share(b.window(2, last), "collect_s"),
                    "launch": {
                        k: launch_parts(t)
                        for k, t in (("train_1", a), ("submit_2", b), ("submit_1", c))
                    },
                    "cpu_1rank": a.cpu.as_dict(),
                    "cpu_2ranks": b.cpu.as_dict(),
                    "recovery": rec,
                }
            )
        self.details["pairs"] = pair_details
        figs = [
            Figure("scaling_efficiency", "scaling efficiency (2 ranks)", tuple(eff), 0.95, ">=",
                   "env-steps/s of 2 ranks / (2 x env-steps/s of 1 rank), same envs per rank, "
                   "iterations 2.. of each run", "scaling"),
            Figure("collective_share", "collective share (2 ranks)", tuple(coll), 0.02, "<=",
                   "time inside all-reduce/broadcast / iteration time, rank 0, 2 ranks",
                   "scaling"),
        ]  # fmt: skip
        for task, data in self.details.get("rollout", {}).items():
            figs.append(
                Figure(
                    f"rollout_overhead_{task}",
                    f"env.step / raw physics ({task})",
                    tuple(data["ratios"]),
                    0.9,
                    ">=",
                    "env.step throughput / raw mujoco_warp graph replay throughput, same "
                    "worlds and substeps",
                    "rollout",
                )
            )
        figs += [
            Figure("launch_cost", "launch: submit local / mjlab-train", tuple(launch), 1.5, "<=",
                   "mjlab-submit --executor local (1 rank) start to first finished iteration / "
                   "mjlab-train start to first finished iteration, warm kernel cache", "launch"),
            Figure("launch_cost_2ranks", "launch: submit local 2 ranks / mjlab-train",
                   tuple(launch2), 1.5, "<=",
                   "the same with the 2-rank job (ranks share the 2 cores; informative)",
                   "launch"),
        ]  # fmt: skip
        mj = self.details.get("mjlab", {}).get("pairs", [])
        task = self.cfg.mjlab_task
        if "skipped" not in self.details.get("mjlab", {}):
            figs += [
                Figure("mjlab_vs_train", f"{task}: ours / mjlab train",
                       tuple(p["ours"] / p["mjlab_train"] for p in mj), 0.97, ">=",
                       "env-steps/s of mjlab-train --no-use-graph (mjlab's own physics path on "
                       "CPU) / mjlab's own train, same envs, one torch thread, iterations 2..",
                       "mjlab"),
                Figure("mjlab_graph_vs_train", f"{task}: ours (graph) / mjlab train",
                       tuple(p["ours_graph"] / p["mjlab_train"] for p in mj), 0.97, ">=",
                       "the same with our default, Warp graph replay on CPU", "mjlab"),
            ]  # fmt: skip
        comp = self.details.get("compilations", {})
        one = comp.get("cold-1") or comp.get("one-1")
        two = comp.get("cold-2") or comp.get("two-1")
        if one and two and one["compilations"]:
            ratio = two["compilations"] / one["compilations"]
            figs.append(
                Figure(
                    "compile_duplication",
                    "compilations: 2-rank / 1-rank job",
                    (ratio,),
                    1.0,
                    "<=",
                    "Warp module compilations of a 2-rank local job / of a 1-rank job, "
                    "each on its own cold cache (1.0: once per node)",
                    "launch",
                )
            )
        figs += [
            Figure("recovery_stop_iterations", "recovery: signal -> checkpoint (iterations)",
                   tuple(stop_its), 1.5, "<=",
                   "USR2 to checkpoint on disk / the run's median iteration time (the stop waits "
                   "for the iteration in flight)", "recovery"),
            Figure("recovery_resume_ratio", "recovery: restart / first start", tuple(resume),
                   1.5, "<=", "restarted ranks' start to first resumed iteration / first ranks' "
                   "start to first iteration, same job", "recovery"),
            Figure("recovery_iterations_lost", "recovery: iterations lost", tuple(lost), 0.0,
                   "<=", "iterations finished before the stop that the restart did not resume "
                   "from (a count)", "recovery"),
        ]  # fmt: skip
        return figs


def _reward(value: float | None) -> str | None:
    """A mean reward as mjlab's train prints it (none before the first episode ends)."""
    if value is None or not math.isfinite(value):
        return None
    return f"{value:.2f}"


def _median_iter_s(records: Sequence[dict[str, Any]]) -> float:
    xs = [r["collect_s"] + r["learn_s"] for r in records]
    return statistics.median(xs) if xs else math.nan


def _share(records: Sequence[dict[str, Any]], key: str) -> float:
    secs = sum(r["collect_s"] + r["learn_s"] for r in records)
    return sum(r[key] for r in records) / secs if secs > 0 else math.nan


def launch_parts(trace: JobTrace) -> dict[str, float | None]:
    """Where a job's launch time went: launcher until a rank process exists, then the rank
    (imports, process group, environment, first iteration)."""
    rank_start = trace.first_rank_start
    return {
        "total_s": trace.launch_s,
        "to_rank_start_s": rank_start - trace.submitted_at if rank_start else None,
        "rank_to_first_iteration_s": (
            trace.first_iteration_at - rank_start
            if rank_start and trace.first_iteration_at
            else None
        ),
    }


def recovery(trace: JobTrace) -> dict[str, Any]:
    """Recovery figures of a job that was sent USR2 (empty when it never stopped)."""
    if not trace.stops:
        return {}
    stop = trace.stops[0]
    starts = trace.record.get("starts", [])
    resumed_from = starts[1]["resumed_from_iteration"] if len(starts) > 1 else None
    before = [
        int(r["iteration"]) for r in trace.records if int(r["iteration"]) <= stop["iteration"]
    ]
    out: dict[str, Any] = {
        "stop_iteration": stop["iteration"],
        "signal_to_checkpoint_s": stop["checkpoint_at"] - stop["signal_at"],
        "checkpoint_write_s": stop.get("checkpoint_s"),
        "resumed_from": resumed_from,
        "iterations_lost": (
            max(before) - resumed_from if before and resumed_from is not None else None
        ),
        "completed": trace.returncode == 0
        and sorted({int(r["iteration"]) for r in trace.records})
        == list(range(1, max(int(r["iteration"]) for r in trace.records) + 1)),
    }
    iter_s = _median_iter_s(trace.records)
    out["stop_iterations"] = out["signal_to_checkpoint_s"] / iter_s if iter_s > 0 else None
    first = (
        trace.first_iteration_at - trace.first_rank_start
        if trace.first_iteration_at and trace.first_rank_start
        else None
    )
    again = (
        trace.first_resumed_at - trace.restart_rank_start
        if trace.first_resumed_at and trace.restart_rank_start
        else None
    )
    out["first_start_to_iteration_s"] = first
    out["restart_to_resumed_iteration_s"] = again
    out["checkpoint_to_ranks_exited_s"] = (
        trace.old_ranks_gone_at - stop["checkpoint_at"] if trace.old_ranks_gone_at else None
    )
    out["ranks_exited_to_restart_s"] = (
        trace.restart_rank_start - trace.old_ranks_gone_at
        if trace.restart_rank_start and trace.old_ranks_gone_at
        else None
    )
    out["signal_to_resumed_iteration_s"] = (
        trace.first_resumed_at - stop["signal_at"] if trace.first_resumed_at else None
    )
    out["resume_ratio"] = again / first if first and again else None
    return out


# --- machine, outputs --------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the figures came from."""
    versions = {}
    for pkg in ("torch", "warp-lang", "mujoco", "mujoco-warp", "rsl-rl-lib", "submitit", "mjlab"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "gpu": None,
    }


def write_png(path: Path, figures: Sequence[dict[str, Any]]) -> None:
    """One panel per figure: median bar, min-max whiskers, quartile box, target line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    shown = [f for f in figures if f["median"] is not None]
    cols = 3
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, f in zip(axes.flat, shown, strict=False):
        colour = "tab:green" if f["met"] else "tab:red"
        med = f["median"]
        ax.bar([0], [med], width=0.5, color=colour, alpha=0.6)
        ax.errorbar(
            [0],
            [med],
            yerr=[[med - f["min"]], [f["max"] - med]],
            fmt="o",
            color="black",
            capsize=8,
            label="median, min-max",
        )
        ax.vlines([0], f["q1"], f["q3"], color="black", linewidth=5, alpha=0.5, label="IQR")
        ax.axhline(
            f["target"],
            color="tab:blue",
            linestyle="--",
            label=f"target {f['direction']} {f['target']:g}",
        )
        top = max(f["max"], f["target"]) * 1.25 or 1.0
        ax.set_ylim(0, top)
        ax.set_xlim(-1, 1)
        ax.set_xticks([])
        ax.set_title(f"{f['label']}\n{med:.3g} (n={f['n']})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle("mjlab_hpc bench: ratios measured alternately (median, IQR, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(figures: Sequence[dict[str, Any]], out: Path) -> None:
    """The figures as a rich table (last thing printed)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mjlab_hpc bench ({out / 'bench.json'})")
    for col in ("figure", "median", "IQR", "min-max", "n", "target", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for f in figures:
        if f["median"] is None:
            table.add_row(f["label"], "n/a", "", "", "0", f"{f['direction']} {f['target']:g}", "?")
            continue
        met = "[green]yes[/]" if f["met"] else "[red]no[/]"
        table.add_row(
            f["label"],
            f"{f['median']:.3f}",
            f"{f['q1']:.3f}-{f['q3']:.3f}",
            f"{f['min']:.3f}-{f['max']:.3f}",
            str(f["n"]),
            f"{f['direction']} {f['target']:g}",
            met,
        )
    Console(width=120).print(table)


def run_bench(cfg: BenchConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Run every benchmark and return the JSON document (also written to <out>)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(cfg, say)
    shutil.rmtree(bench.runs, ignore_errors=True)
    bench.runs.mkdir(parents=True)
    t0 = time.time()
    load0 = os.getloadavg()
    # First: it also loads (on a cold cache: compiles) every task's kernels for what follows.
    bench.rollout()
    bench.training_pairs()
    bench.mjlab_pairs()
    if cfg.cold_compile and not cfg.quick:
        bench.compilations()
    figures = {f.key: f.summary() for f in bench.figures()}
    doc = {
        "schema": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": "python -m mjlab_hpc.bench " + " ".join(_argv_of(cfg)),
        "quick": cfg.quick,
        "config": {
            **asdict(cfg),
            "out": str(cfg.out),
            "repeats": cfg.pairs,
            "num_envs": cfg.envs,
            "iterations": cfg.measured,
        },
        "machine": machine_info(),
        "duration_s": round(time.time() - t0, 1),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "figures": figures,
        "details": bench.details,
        "failures": bench.failures,
        "gpu": {
            "measured": False,
            "note": "no GPU on this machine; docs/performance.md says how to measure on one",
        },
    }
    (cfg.out / "bench.json").write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    write_png(cfg.out / "bench.png", list(figures.values()))
    return doc


def _json_default(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _argv_of(cfg: BenchConfig) -> list[str]:
    argv = ["--quick"] if cfg.quick else []
    if cfg.out != Path("bench-results"):
        argv += ["--out", str(cfg.out)]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m mjlab_hpc.bench` (and `mjlab-hpc bench`); 0 unless a
    benchmark could not run (a missed target is a finding, not an error)."""
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)
    return run(cfg)


def run(cfg: BenchConfig) -> int:
    """Run the benchmarks of `cfg`, print the table; the exit code."""

    def say(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    doc = run_bench(cfg, say)
    for failure in doc["failures"]:
        say(f"FAILED: {failure}")
    say(f"wrote {cfg.out / 'bench.json'} and {cfg.out / 'bench.png'} in {doc['duration_s']} s")
    print_table(list(doc["figures"].values()), cfg.out)
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

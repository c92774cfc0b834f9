"""`make bench-fs` / `python -m benchmarks.fsops`: what a run costs a shared filesystem.

On Lustre, GPFS or NFS every open, create, rename, unlink, stat and directory read is a request
to a metadata server that every user of the cluster shares. This counts them exactly, with
strace: every system call on a path inside the run directory (an `*at` call by its folder's
descriptor, a directory read with the entries it returned), by process, per second of
training. Two sources:

- real jobs (`--real`): cartpole on 2-32 CPU ranks, on one node (`--executor local`) and
  spread over the Slurm test cluster's nodes (`make bench-fs` starts one of 8). strace attaches
  to every process of the job once it trains (iteration 2), for `--window-s`, then the job is
  cancelled. What starts and ends a job (imports of the code snapshot, records) is not counted:
  the figures are the steady cost of a running job.
- a simulation (`--sim`, `benchmarks.simranks`): the liveness, lock and record machinery of up
  to 256 ranks (or more) on this machine, without training: each rank a light process (forked
  after the imports) whose iterations only sleep, in lockstep, with checkpoints; 8 ranks per
  node, and again one per node (nodes apart from ranks). strace follows the simulation from
  its start (`--seccomp-bpf`: only the counted calls stop).

Then it fits total operations per second = a + b*nodes + c*ranks + d*ranks^2 (non-negative
terms, the smallest model within 10% of the best) and carries it to 1,024 ranks on 128 nodes.
It writes `<out>/fsops.json` (by `--label`, with each measurement's trace under
`<out>/fsops/<label>/`; `--recount` counts them again) and prints a table per source. strace
must be installed (`make install` installs it as root).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "Counts",
    "Op",
    "count",
    "file_class",
    "fit",
    "main",
    "parse_trace",
    "strace_command",
]

#: The system calls counted, by kind (`open` with O_CREAT counts as a create).
KINDS: dict[str, tuple[str, ...]] = {
    "open": ("open", "openat", "openat2", "creat"),
    "create": ("mkdir", "mkdirat", "link", "linkat", "symlink", "symlinkat", "mknodat"),
    "rename": ("rename", "renameat", "renameat2"),
    "unlink": ("unlink", "unlinkat", "rmdir"),
    "stat": (
        "stat",
        "lstat",
        "newfstatat",
        "statx",
        "access",
        "faccessat",
        "faccessat2",
        "readlink",
        "readlinkat",
        "statfs",
        "getxattr",
        "lgetxattr",
        "listxattr",
        "llistxattr",
    ),
    "readdir": ("getdents64", "getdents"),
    "fsync": ("fsync", "fdatasync"),
    "setattr": ("chmod", "fchmodat", "chown", "fchownat", "utimensat", "truncate"),
}
_KIND_OF = {call: kind for kind, calls in KINDS.items() for call in calls}
_CLONES = ("clone", "clone3", "fork", "vfork")
# strace -ttt -y -f: `TID SECONDS call(args) = result`, or `<unfinished ...>` and a later
# `TID SECONDS <... call resumed> rest`.
_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(<\.\.\. )?(\w+)(?: resumed>|\()(.*)$")
_FD = re.compile(r"(?:-?\d+|AT_FDCWD)<((?:[^>\\]|\\.)*)>")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ENTRIES = re.compile(r"/\* (\d+) entries \*/")
_RESULT = re.compile(r"= (-?\d+)")


@dataclass(frozen=True)
class Op:
    """One counted system call on the run directory."""

    tid: int
    t: float
    kind: str
    """A key of KINDS, or `fstat` (a stat of an open file: newfstatat with an empty name)."""
    path: str
    """Relative to the run directory ('.': the folder itself)."""
    entries: int = 0
    """What a directory read returned."""


def strace_command(out: Path, follow_start: bool) -> list[str]:
    """The strace command line (then `-p PID...` or the command): `follow_start` for a
    command strace starts itself (--seccomp-bpf: only the counted calls stop)."""
    calls = sorted({*_KIND_OF, *_CLONES})
    return [
        "strace",
        "-f",
        "-qq",
        "-ttt",
        "-y",
        "-s",
        "4096",
        *(["--seccomp-bpf"] if follow_start else []),
        "-e",
        f"trace={','.join(calls)}",
        "-o",
        str(out),
    ]


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text) if "\\" in text else text


def _target(call: str, args: str) -> tuple[str | None, bool]:
    """The path a call acts on and whether it creates it (O_CREAT)."""
    fds = [_unescape(f) for f in _FD.findall(args)]
    names = [_unescape(s) for s in _STR.findall(args)]
    if call in ("getdents64", "getdents", "fsync", "fdatasync"):
        return (fds[0] if fds else None), False
    if call in ("rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat"):
        # The name that appears (the new one); its folder is the last descriptor given.
        name = names[-1] if names else None
        base = fds[-1] if fds else ""
    else:
        name = names[0] if names else None
        base = fds[0] if fds else ""
    if name is None:
        return None, False
    path = name if name.startswith("/") else (f"{base}/{name}" if name else base)
    return path, (call in ("open", "openat", "openat2") and "O_CREAT" in args) or call == "creat"


def parse_trace(lines: Iterable[str], run_dir: str) -> Iterator[Op | tuple[int, int, bool]]:
    """The counted calls on `run_dir` (real path) in strace's output, and each clone as
    (parent tid, child tid, whether the child is a thread of the parent)."""
    root = run_dir.rstrip("/")
    pending: dict[tuple[int, str], str] = {}
    reads: dict[int, Op] = {}
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        tid, t, resumed, call, rest = int(m.group(1)), float(m.group(2)), m.group(3), m[4], m[5]
        if call in _CLONES:
            if rest.endswith("<unfinished ...>"):
                pending[(tid, call)] = rest
                continue
            head = pending.pop((tid, call), "") if resumed else ""
            got = _RESULT.search(rest)
            if got and int(got.group(1)) > 0:
                yield (tid, int(got.group(1)), "CLONE_THREAD" in head + rest)
            continue
        if call not in _KIND_OF:
            continue
        if resumed:  # counted on its first line; a directory read's entries come now
            op = reads.pop(tid, None)
            if op is not None:
                got = _ENTRIES.search(rest)
                yield Op(op.tid, op.t, op.kind, op.path, int(got.group(1)) if got else 0)
            continue
        path, creates = _target(call, rest)
        if path is None or not (path == root or path.startswith(root + "/")):
            continue
        rel = path[len(root) + 1 :] or "."
        kind = "create" if creates else _KIND_OF[call]
        if call in ("newfstatat", "statx") and '""' in rest and "AT_EMPTY_PATH" in rest:
            kind = "fstat"
        if kind == "readdir" and rest.endswith("<unfinished ...>"):
            reads[tid] = Op(tid, t, kind, rel)
            continue
        got = _ENTRIES.search(rest)
        yield Op(tid, t, kind, rel, int(got.group(1)) if got else 0)


# Files of a run, by class: the first pattern that matches names the class.
_CLASSES = (
    (r"logs/heartbeat(/.*)?", "logs/heartbeat/*"),
    (r"logs/ranks(/.*)?", "logs/ranks/*"),
    (r"logs/rank\d+\.log", "logs/rank<k>.log"),
    (r"logs(/[^/]*)?", "logs/*"),
    (r"rank_states(/.*)?", "rank_states/*"),
    (r"\.?model_\d+\.pt.*", "model_<n>.pt*"),
    (r"\.?events\.out\.tfevents.*", "tensorboard events"),
    (r"\.?progress\.jsonl.*", "progress.jsonl"),
    (r"\.?run\.json.*", "run.json"),
    (r"\.writer\.(lock|reserve).*", ".writer.lock"),
    (r"code(/.*)?", "code/*"),
    (r"submitit(/.*)?", "submitit/*"),
    (r"params(/.*)?", "params/*"),
)


def file_class(rel: str) -> str:
    """The class of a file of the run (its relative path), for the tables."""
    return next((name for pattern, name in _CLASSES if re.fullmatch(pattern, rel)), rel)


@dataclass
class Counts:
    """Operations counted in one window, per second."""

    seconds: float
    by_kind: dict[str, float] = field(default_factory=dict)
    by_role: dict[str, float] = field(default_factory=dict)
    by_file: dict[str, float] = field(default_factory=dict)
    readdir_entries: float = 0.0
    total: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Rounded, for fsops.json."""

        def r(d: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

        return {
            "seconds": round(self.seconds, 1),
            "total_per_s": round(self.total, 2),
            "readdir_entries_per_s": round(self.readdir_entries, 1),
            "by_kind": r(self.by_kind),
            "by_role": r(self.by_role),
            "by_file": r(self.by_file),
        }


def count(
    items: Iterable[Op | tuple[int, int, bool]],
    roles: dict[int, str],
    threads: dict[int, int],
    window: tuple[float, float] | None = None,
    default_role: str = "other",
) -> Counts:
    """Count the ops of `items` inside `window` (None: all), per second of the window.

    `roles` names each process (by pid); `threads` maps thread ids to their process. A process
    started by a counted one takes its role, a thread its process's.
    """
    threads = dict(threads)
    ops: list[Op] = []
    for item in items:
        if isinstance(item, tuple):
            parent, child, is_thread = item
            owner = threads.get(parent, parent)
            if is_thread:
                threads[child] = owner
            elif child not in roles:
                roles[child] = roles.get(owner, default_role)
            continue
        ops.append(item)
    if window is None:
        window = (min((o.t for o in ops), default=0.0), max((o.t for o in ops), default=1.0))
    seconds = max(window[1] - window[0], 1e-9)
    kinds: Counter[str] = Counter()
    by_role: Counter[str] = Counter()
    files: Counter[str] = Counter()
    entries = 0
    for op in ops:
        if not window[0] <= op.t <= window[1]:
            continue
        kinds[op.kind] += 1
        by_role[roles.get(threads.get(op.tid, op.tid), default_role)] += 1
        files[file_class(op.path)] += 1
        entries += op.entries
    total = sum(kinds.values())
    return Counts(
        seconds=seconds,
        by_kind={k: v / seconds for k, v in kinds.items()},
        by_role={k: v / seconds for k, v in by_role.items()},
        by_file={k: v / seconds for k, v in files.items()},
        readdir_entries=entries / seconds,
        total=total / seconds,
    )


# The terms a growth is fitted with: per job, per node, per rank, per rank squared.
TERMS = ("constant", "per node", "per rank", "per rank^2")


def _basis(ranks: float, nodes: float) -> list[float]:
    return [1.0, float(nodes), float(ranks), float(ranks) ** 2]


def fit(points: Sequence[tuple[int, int, float]]) -> dict[str, Any]:
    """Fit y = a + b*nodes + c*ranks + d*ranks^2 (non-negative terms) to (ranks, nodes, y).

    Every subset of the terms is fitted by least squares; of those with non-negative
    coefficients, the smallest whose residual is within 10% (plus 1% of the mean) of the
    best's wins: the growth is named by its highest term.
    """
    import numpy as np

    x = np.array([_basis(r, n) for r, n, _ in points])
    y = np.array([v for _, _, v in points])
    tolerance = 0.01 * float(np.mean(np.abs(y))) if len(y) else 0.0
    fits = []
    for size in range(1, len(TERMS) + 1):
        for terms in itertools.combinations(range(len(TERMS)), size):
            coef, *_ = np.linalg.lstsq(x[:, terms], y, rcond=None)
            if (coef < -1e-9).any():
                continue
            residual = float(np.sqrt(np.mean((x[:, terms] @ coef - y) ** 2)))
            fits.append((residual, size, terms, coef))
    best = min(f[0] for f in fits)
    residual, _, terms, coef = min(
        (f for f in fits if f[0] <= 1.1 * best + tolerance), key=lambda f: (f[1], f[0])
    )
    coefficients = dict.fromkeys(TERMS, 0.0)
    for term, value in zip(terms, coef, strict=True):
        coefficients[TERMS[term]] = float(value)
    return {
        "growth": TERMS[max(terms)],
        "coefficients": {k: round(v, 6) for k, v in coefficients.items()},
        "rms_residual": round(residual, 3),
    }


def predict(model: dict[str, Any], ranks: int, nodes: int) -> float:
    """A fitted model's value at `ranks` on `nodes`."""
    c = model["coefficients"]
    return sum(c[t] * b for t, b in zip(TERMS, _basis(ranks, nodes), strict=True))


# --- real jobs ---------------------------------------------------------------------------


def _threads_of(pids: Iterable[int]) -> dict[int, int]:
    """Thread id -> process id of live processes."""
    found: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                found[int(tid)] = pid
    return found


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def job_processes(run_dir: Path, world: int) -> dict[int, str]:
    """The live processes of a job working for `run_dir`, by role: rank 0 (the writer), the
    first rank of each other node, the other ranks (from their start records), and the batch
    script, srun or local controller (`launcher`): every process whose command line names the
    run's submitit folder."""
    from mjlab_hpc.rundir.ends import rank_starts

    folder = str((run_dir / "submitit").resolve())
    roles: dict[int, str] = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        if any(folder in arg for arg in _argv(pid)):
            roles[pid] = "launcher"
    seen: set[str] = set()
    for rank in range(world):
        starts = rank_starts(run_dir, rank)
        if starts and starts[-1].pid in roles:
            first = starts[-1].node not in seen
            seen.add(starts[-1].node)
            role = "rank 0" if rank == 0 else "first of a node" if first else "ranks"
            roles[starts[-1].pid] = role
    return roles


def _progress(run_dir: Path) -> int:
    from mjlab_hpc.rundir.layout import RunDir
    from mjlab_hpc.rundir.progress import progress_tail

    tail = progress_tail(RunDir(run_dir), 1)
    return tail[-1].iteration if tail else 0


def _wait_for(what: str, check: Any, timeout_s: float, proc: subprocess.Popen[Any] | None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := check()) is not None and got is not False:
            return got
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def measure_job(
    world: int, nodes: int, slurm: bool, out: Path, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """Run one job, count its operations for `args.window_s` once it trains, cancel it."""
    from benchmarks.watch import cli, find_run_dir

    where = f"{'slurm' if slurm else 'local'}-{world}r{nodes}n"
    root = out / where
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shape = ["--nodes", str(nodes), "--tasks-per-node", str(world // nodes)]
    cmd = [
        cli("mjlab-submit"),
        "cartpole",
        "--executor",
        "slurm" if slurm else "local",
        *shape,
        "--gpus-per-node",
        "0",
        "--num-envs",
        str(args.num_envs),
        "--max-iterations",
        "100000",
        "--save-interval",
        str(args.save_interval),
        "--torch-threads",
        "1",
        "--dist-timeout-s",
        "900",
        "--time",
        "60",
        "--log-root",
        str(root),
        *(["--oversubscribe"] if not slurm and world > (os.cpu_count() or 1) else []),
    ]
    result: dict[str, Any] = {"ranks": world, "nodes": nodes, "launch": where.split("-")[0]}
    with open(root / "submit.out", "w") as output:
        subprocess.run(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, check=True)
    run = _wait_for("run directory", lambda: find_run_dir(root), 120, None).resolve()
    try:
        _wait_for("iteration 2", lambda: _progress(run) >= 2, args.timeout_s, None)
        roles = job_processes(run, world)
        trace = root / "strace.txt"
        tracer = subprocess.Popen(
            [*strace_command(trace, follow_start=False), *(f"-p{p}" for p in roles)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        threads: dict[int, int] = {}
        began = time.time()
        first = _progress(run)
        while time.time() - began < args.window_s and tracer.poll() is None:
            threads.update(_threads_of(roles))
            time.sleep(1.0)
        ended, last = time.time(), _progress(run)
        tracer.send_signal(signal.SIGINT)  # detaches; the job trains on
        with contextlib.suppress(subprocess.TimeoutExpired):
            tracer.wait(timeout=60)
    finally:
        subprocess.run(
            [cli("mjlab-hpc"), "cancel", str(run)],
            env=env,
            capture_output=True,
            timeout=180,
            check=False,
        )
    meta = {"run": str(run), "roles": roles, "threads": threads, "window": [began + 2, ended]}
    (root / _META).write_text(json.dumps(meta))
    result.update(_counted(root))
    result["iterations_per_s"] = round((last - first) / max(ended - began, 1e-9), 3)
    return result


# Beside each job's trace: its run, processes, threads and window (`--recount` reads them).
_META = "trace-meta.json"


def _counted(root: Path) -> dict[str, Any]:
    """The counts of the trace in `root` (a job's folder), per its `_META`."""
    meta = json.loads((root / _META).read_text())
    roles = {int(k): v for k, v in meta["roles"].items()}
    threads = {int(k): v for k, v in meta["threads"].items()}
    with open(root / "strace.txt", errors="replace") as lines:
        items = parse_trace(lines, meta["run"])
        return count(items, roles, threads, tuple(meta["window"])).as_dict()


def recount(entry: dict[str, Any], work: Path) -> None:
    """Count the kept traces in `work` again (a better parser). A job's trace kept without
    its processes keeps the roles counted when it was made."""
    from benchmarks.simranks import counted
    from benchmarks.watch import find_run_dir

    for r in entry.get("real", {}).get("results", []):
        root = work / "real" / f"{r['launch']}-{r['ranks']}r{r['nodes']}n"
        if "error" in r or not (root / "strace.txt").exists():
            continue
        if not (root / _META).exists():
            run = find_run_dir(root)
            with open(root / "strace.txt", errors="replace") as lines:
                times = [op.t for op in parse_trace(lines, str(run)) if isinstance(op, Op)]
            window = [min(times) + 2, max(times)]
            meta = {"run": str(run), "roles": {}, "threads": {}, "window": window}
            (root / _META).write_text(json.dumps(meta))
            r.update({k: v for k, v in _counted(root).items() if k != "by_role"})
        else:
            r.update(_counted(root))
    if "real" in entry:
        entry["real"]["fit"] = summarize(entry["real"]["results"])
    sims = entry.get("sim", {}).get("results", [])
    for i, r in enumerate(sims):
        folder = work / "sim" / f"world{r['ranks']}-per{r['per_node']}"
        if (folder / "strace.txt").exists():
            sims[i] = counted(folder, r["ranks"], r["per_node"])
    if sims:
        entry["sim"]["fit"] = summarize(sims)


def _real(args: argparse.Namespace, out: Path) -> Iterator[dict[str, Any]]:
    from benchmarks.scale import layout
    from benchmarks.watch import bench_env

    env = bench_env({k: v for k, v in os.environ.items() if k == "SLURM_CONF"})
    for world in args.sizes:
        shapes = [(1, False)]
        if args.max_nodes > 1 and shutil.which("sbatch"):
            shapes.append((layout(world, args.max_nodes)[0], True))
        for nodes, slurm in shapes:
            print(f"[fsops] {world} rank(s) on {nodes} node(s) ...", flush=True)
            try:
                yield measure_job(world, nodes, slurm, out, args, env)
            except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
                yield {"ranks": world, "nodes": nodes, "error": str(exc)}


# --- tables and the entry point -----------------------------------------------------------


def print_row(r: dict[str, Any]) -> None:
    """One line of a table: a measurement."""
    if "error" in r:
        print(f"{r['ranks']:>6} {r['nodes']:>5}  failed: {r['error']}")
        return
    kinds = r["by_kind"]
    heartbeat = r["by_file"].get("logs/heartbeat/*", 0.0)
    print(
        f"{r['ranks']:>6} {r['nodes']:>5} {r['total_per_s']:>9.1f} "
        + " ".join(f"{kinds.get(k, 0.0):>7.1f}" for k in ("open", "create", "rename", "stat"))
        + f" {kinds.get('readdir', 0.0):>7.1f} {r['readdir_entries_per_s']:>9.0f}"
        f" {heartbeat:>9.1f}"
    )


def print_header(title: str) -> None:
    """The head of a table."""
    print(title)
    print(
        f"{'ranks':>6} {'nodes':>5} {'ops/s':>9} {'open':>7} {'create':>7} {'rename':>7} "
        f"{'stat':>7} {'readdir':>7} {'entries/s':>9} {'heartbt':>9}"
    )


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fits of total ops/s, of those on the heartbeat folder and of the directory
    entries read over the measurements, and their values at 1,024 ranks on 128 nodes."""
    done = [r for r in results if "error" not in r and "failed" not in r]  # (failed: saturated)
    if len(done) < 3:
        return None
    fits = {}
    for name, value in (
        ("total", lambda r: r["total_per_s"]),
        ("heartbeat folder", lambda r: r["by_file"].get("logs/heartbeat/*", 0.0)),
        ("directory entries read", lambda r: r["readdir_entries_per_s"]),
    ):
        model = fit([(r["ranks"], r["nodes"], value(r)) for r in done])
        model["at_1024_ranks_128_nodes_per_s"] = round(predict(model, 1024, 128), 1)
        fits[name] = model
    return fits


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsops", description=__doc__)
    p.add_argument("--real", action="store_true", help="count real jobs")
    p.add_argument("--sim", action="store_true", help="count the simulation")
    p.add_argument("--sizes", default="2,4,8,16,32", help="real ranks (default %(default)s)")
    p.add_argument(
        "--sim-sizes", default="2,4,8,16,32,64,128,256", help="simulated ranks (%(default)s)"
    )
    p.add_argument("--sim-per-node", type=int, default=8, help="simulated ranks per node (8)")
    p.add_argument(
        "--sim-spread",
        default="2,4,8,16,32",
        help="simulated ranks again, one per node: nodes apart from ranks (%(default)s)",
    )
    p.add_argument("--max-nodes", type=int, default=8, help="Slurm nodes at most (default 8)")
    p.add_argument("--num-envs", type=int, default=16, help="envs per real rank (default 16)")
    p.add_argument("--save-interval", type=int, default=5, help="checkpoint every N (5)")
    p.add_argument("--window-s", type=float, default=40.0, help="counted seconds (40)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per job start (900)")
    p.add_argument("--label", default="", help="a name for these figures (e.g. the commit)")
    p.add_argument("--recount", action="store_true", help="count the kept traces of --label")
    p.add_argument("--out", default="bench-results", help="folder of fsops.json")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        args.sim_sizes = [int(s) for s in args.sim_sizes.split(",") if s.strip()]
        args.sim_spread = [int(s) for s in args.sim_spread.split(",") if s.strip()]
    except ValueError:
        p.error("--sizes, --sim-sizes: comma-separated integers, e.g. 2,4,8")
    if not (args.real or args.sim):
        args.real = args.sim = True
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: 0 when every measurement was made."""
    args = _parse(argv)
    if shutil.which("strace") is None:
        print("strace is not installed (as root: apt-get install strace)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fsops.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    label = args.label or "latest"
    entry: dict[str, Any] = doc.setdefault(label, {})
    work = out / "fsops" / label  # the traces, by label and measurement
    if args.recount:
        recount(entry, work)
        path.write_text(json.dumps(doc, indent=1))
        for r in entry.get("real", {}).get("results", []):
            print_row(r)
        return 0
    entry["settings"] = {k: v for k, v in vars(args).items() if k not in ("out",)}
    if args.sim:
        from benchmarks.simranks import simulate

        sims: list[dict[str, Any]] = []
        entry["sim"] = {"results": sims}
        shapes = [(w, args.sim_per_node) for w in args.sim_sizes]
        shapes += [(w, 1) for w in args.sim_spread]
        print_header("simulated ranks, operations per second")
        for world, per_node in shapes:
            sims.append(simulate(world, per_node, work / "sim"))
            print_row(sims[-1])
            entry["sim"]["fit"] = summarize(sims)
            path.write_text(json.dumps(doc, indent=1))  # (a long run keeps what it measured)
        print(f"fit: {entry['sim']['fit']}")
    if args.real:
        print_header("real jobs, operations per second")
        real: list[dict[str, Any]] = []
        entry["real"] = {"results": real}
        for result in _real(args, work / "real"):
            real.append(result)
            print_row(result)
            entry["real"]["fit"] = summarize(real)
            path.write_text(json.dumps(doc, indent=1))
        print(f"fit: {entry['real']['fit']}")
    path.write_text(json.dumps(doc, indent=1))
    print(f"[fsops] {path}")
    failed = [r for part in ("sim", "real") for r in entry.get(part, {}).get("results", [])]
    return 1 if any("error" in r for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Helpers shared by the tests.

The CLIs' environment, finding a test's run, waiting for progress, finding rank processes,
fault injection, and two real ranks in a gloo group.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from mjlab_hpc.launch.local import free_port
from mjlab_hpc.procs import processes
from mjlab_hpc.rundir.layout import RunDir

#: The venv's scripts (mjlab-train, mjlab-submit, mjlab-hpc, torchrun).
BIN = Path(sys.executable).parent

# Variables of an enclosing launcher: a CLI started by a test must start as a plain process
# (SLURM_JOB_ID: a suite run inside a Slurm job would make mjlab-submit use that allocation).
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_JOB_ID",
)


def cli_env(
    extra: Mapping[str, str] | None = None,
    *,
    base: Mapping[str, str] | None = None,
    path: str | None = None,
) -> dict[str, str]:
    """The environment of a CLI a test starts.

    That is `base` (default: ours) without launcher variables, the venv's scripts first on
    PATH (or exactly `path`), plus `extra`.
    """
    env = {
        k: v
        for k, v in (base if base is not None else os.environ).items()
        if k not in _LAUNCHER_VARS and not k.startswith("SUBMITIT_")
    }
    env["PATH"] = path if path is not None else f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def clock_ahead(offset: str = "+1h") -> list[str]:
    """The command prefix that runs a command with its clock `offset` ahead.

    It uses Debian's faketime, which `make install` installs as root. Where faketime is
    missing the test is skipped, or fails under CI=true.
    """
    if shutil.which("faketime") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("faketime is not installed (make install installs it as root)")
        pytest.skip("faketime is not installed (apt-get install faketime)")
    return ["faketime", "-f", offset]


def runs_under(root: Path) -> list[Path]:
    """Run directories `<root>/<experiment>/<run>`, oldest name first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/*") if p.is_dir() and not p.name.startswith("."))


def only_run(root: Path) -> RunDir:
    """The one run a test made under the log root `root`."""
    runs = runs_under(root)
    assert len(runs) == 1, runs
    return RunDir(runs[0])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.25) -> Any:
    """Poll until `predicate()` returns something true; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def wait_for_iteration(root: Path, n: int, timeout: float = 150) -> RunDir:
    """The run under `root` once it has finished `n` iterations (progress.jsonl lines)."""

    def reached() -> RunDir | None:
        for run in runs_under(root):
            if len(progress_records(RunDir(run))) >= n:
                return RunDir(run)
        return None

    return wait_for(reached, timeout, f"iteration {n} under {root}", poll=0.05)


def rank_pids(run: RunDir) -> list[int]:
    """The rank processes of a local-executor job (submitit's task runner with its folder)."""
    folder = str(run.submitit.resolve())

    def is_rank(argv: tuple[str, ...]) -> bool:
        return "submitit.core._submit" in argv and folder in argv

    return sorted(p.pid for p in processes(is_rank))


def time_limit_stop(run: RunDir, timeout_s: float = 120) -> None:
    """Send every rank of a local-executor job Slurm's time-limit signal (SIGUSR2) and wait
    until the stop is recorded (`restarts.jsonl`)."""
    for pid in rank_pids(run):
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout_s
    while not run.restarts.exists():
        assert time.monotonic() < deadline, "the time-limit stop was not recorded"
        time.sleep(0.1)


def patch_on_import(module: str, patch: str, when: str = "True") -> str:
    """The text of a sitecustomize.py (Python loads it from PYTHONPATH, in every process) that
    calls `_patch(module)` once `module` is loaded, where the expression `when` holds.

    `patch` defines `_patch` (and what `when` reads). It reaches the real commands, as a fault
    or a race would, with nothing of theirs mocked.
    """
    return textwrap.dedent(patch) + textwrap.dedent(
        f"""
        import importlib.abc as _abc, importlib.util as _util, sys as _sys

        class _OnImport(_abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != {module!r}:
                    return None
                _sys.meta_path.remove(self)
                spec = _util.find_spec(name)
                load = spec.loader.exec_module

                def exec_module(loaded):
                    load(loaded)
                    _patch(loaded)

                spec.loader.exec_module = exec_module
                return spec

        if {when}:
            _sys.meta_path.insert(0, _OnImport())
        """
    )


# Fault injection for the tests: on the rank named by MJLAB_FAULT_RANK (SLURM_PROCID or the
# local executor's global id), training raises inside the loop at MJLAB_FAULT_ITERATION,
# exactly where a bug in a hook would.
FAULT_INJECTION = patch_on_import(
    "mjlab_hpc.rundir.progress",
    """
    import os

    _rank = os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID")

    def _patch(module):
        update, at = module.ProgressDisplay.update, int(os.environ["MJLAB_FAULT_ITERATION"])

        def failing(self, s):
            if s.iteration >= at:
                raise RuntimeError(f"injected fault on rank {_rank} at iteration {s.iteration}")
            update(self, s)

        module.ProgressDisplay.update = failing
    """,
    when='_rank is not None and _rank == os.environ.get("MJLAB_FAULT_RANK")',
)


def fault_env(tmp: Path, rank: int, iteration: int) -> dict[str, str]:
    """Variables that make `rank` raise at `iteration` (see FAULT_INJECTION)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sitecustomize.py").write_text(FAULT_INJECTION)
    path = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "MJLAB_FAULT_RANK": str(rank),
        "MJLAB_FAULT_ITERATION": str(iteration),
    }


def rank_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """torchrun-style variables of one rank on this machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _rank_main(body: Callable[[int], Any], rank: int, port: int, out: mp.Queue) -> None:
    import torch

    from mjlab_hpc.rank.context import DistContext, process_group

    torch.set_num_threads(1)
    with process_group(DistContext.from_env(rank_env(rank, port)), "cpu", timeout_s=60):
        result = body(rank)
    out.put((rank, result))


def run_two_ranks(body: Callable[[int], Any], timeout_s: float = 110.0) -> dict[int, Any]:
    """Run `body(rank)` in two spawned processes joined in one gloo process group (a module
    -level function, so that the children can import it). Returns {rank: result} after both
    exited cleanly."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    # Results first: a worker blocks on exit until its queued data has been read.
    got = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(60)  # a loaded machine takes a while to tear a process group down
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return got


def reference_digests(shared: Path, args: list[str], ranks: int = 1) -> list[str]:
    """Per-rank parameter digests of an uninterrupted `mjlab-train ARGS` run on `ranks` ranks.

    They are computed once per test session and shared between tests and xdist workers:
    `shared` is a folder all of them see (`tmp_path_factory.getbasetemp().parent`).
    """
    import fcntl
    import json
    import subprocess

    command = [*args, "--num-procs", str(ranks)] if ranks > 1 else list(args)
    key = _reference_key(command)
    folder = shared / "reference-runs"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker computes, the others wait and read
        done = folder / f"{key}.json"
        if done.exists():
            return list(json.loads(done.read_text()))
        root = folder / key
        proc = subprocess.run(
            [BIN / "mjlab-train", *command, "--log-root", str(root)],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        digests = json.loads(only_run(root).summary.read_text())["param_digest_per_rank"]
        done.write_text(json.dumps(digests))
        return list(digests)


def episode_metrics(run: RunDir) -> list[tuple[int, float | None, float | None]]:
    """(iteration, mean reward, mean episode length) of each line of a run's progress.jsonl."""
    return [
        (r["iteration"], r["mean_reward"], r["mean_episode_length"]) for r in progress_records(run)
    ]


def reference_metrics(
    shared: Path, args: list[str], ranks: int = 1
) -> list[tuple[int, float | None, float | None]]:
    """`episode_metrics` of the uninterrupted run `reference_digests` made (and makes)."""
    reference_digests(shared, args, ranks)
    command = [*args, "--num-procs", str(ranks)] if ranks > 1 else list(args)
    return episode_metrics(only_run(shared / "reference-runs" / _reference_key(command)))


def _reference_key(command: list[str]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]


def recording_tools(
    bin_dir: Path,
    record: Path,
    tools: tuple[str, ...] = ("srun", "mjlab-train", "mjlab-hpc", "module"),
) -> None:
    """Stand-ins for the commands a job script calls, recording their arguments in `record`.

    One argument per line, so a script's quoting is checked by running it with bash. The
    mjlab-hpc stand-in prints a run directory, as `mjlab-hpc run-dir` does.
    """
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        script = bin_dir / tool
        script.write_text(
            "#!/bin/bash\n"
            f'{{ echo "== {tool}"; for a in "$@"; do printf "%s\\n" "$a"; done; }} >> {record}\n'
            + ('echo "$PWD/rundir"\n' if tool == "mjlab-hpc" else "")
        )
        script.chmod(0o755)


# Objects of these packages are walked into when looking for Warp arrays; everything else
# (torch modules and tensors, numpy, mujoco's MjModel, functions, classes) is a leaf.
_WALKED_PACKAGES = frozenset({"mujoco_warp", "mjlab", "mjlab_hpc", "rsl_rl"})


def warp_devices(root: object, name: str = "env", limit: int = 500_000) -> dict[str, str]:
    """The device (Warp's alias: `cpu`, `cuda:0`) of every Warp array and captured Warp graph
    reachable from `root`, by the first path that reaches it (`env.data.qpos`).

    Walks attributes (`__dict__` and `__slots__`), lists, tuples, sets and dicts, into the
    objects of mujoco_warp, mjlab, mjlab_hpc and rsl-rl and into Warp structs, each object
    once (BFS: the shortest path names it). Warp's own runtime objects are not walked."""
    import collections

    import warp as wp

    found: dict[str, str] = {}
    seen: set[int] = set()
    queue: collections.deque[tuple[str, object]] = collections.deque([(name, root)])
    while queue:
        path, obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        assert len(seen) <= limit, f"more than {limit} objects under {name}: a runaway walk"
        if isinstance(obj, wp.array | wp.Graph):
            found[path] = str(obj.device)
            continue
        children: list[tuple[str, object]] = []
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, list | tuple | set | frozenset):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif _walked(obj):
            attrs = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(obj, slot):
                        attrs.setdefault(slot, getattr(obj, slot))
            children = [(f"{path}.{k}", v) for k, v in attrs.items()]
        queue.extend(children)
    return found


def _walked(obj: object) -> bool:
    cls = type(obj)  # classes and functions: builtins' types, never walked
    package = cls.__module__.split(".")[0]
    # Warp structs hold arrays; the rest of Warp (devices, modules, the runtime) does not.
    return package in _WALKED_PACKAGES or (package == "warp" and cls.__name__ == "StructInstance")


def make_motion(path: Path, frames: int = 40, bodies: int = 40) -> Path:
    """A small motion file of the kind mjlab's tracking tasks read (a robot swaying in place)."""
    import numpy as np

    t = np.linspace(0, 1, frames, dtype=np.float32)[:, None]
    quat = np.zeros((frames, bodies, 4), np.float32)
    quat[..., 0] = 1.0
    pos = np.zeros((frames, bodies, 3), np.float32)
    pos[..., 2] = 0.76
    pos[..., 0] = 0.05 * np.sin(6 * t)
    np.savez(
        path,
        joint_pos=0.2 * np.sin(6 * t) * np.ones((frames, 29), np.float32),
        joint_vel=1.2 * np.cos(6 * t) * np.ones((frames, 29), np.float32),
        body_pos_w=pos,
        body_quat_w=quat,
        body_lin_vel_w=np.zeros_like(pos),
        body_ang_vel_w=np.zeros_like(pos),
    )
    return path


@contextlib.contextmanager
def memory_cgroup(name: str, limit_bytes: int) -> Iterator[Path]:
    """A memory cgroup (v1) of its own below this process's, limited to `limit_bytes`.

    The kernel's OOM killer acts in it, as in a container or a Slurm job with --mem. Processes
    moved in (`echo PID > <cgroup>/cgroup.procs`; children follow) go back to this process's
    cgroup at the end. Fails under CI=true where it cannot be made, else skips.
    """
    with cgroup_v1("memory", name, {"memory.limit_in_bytes": str(limit_bytes)}) as group:
        yield group


@contextlib.contextmanager
def cpu_cgroup(
    name: str, quota: float | None = None, shares: int | None = None, parent: Path | None = None
) -> Iterator[Path]:
    """A cpu cgroup (v1) of its own below this process's (or below `parent`, another such
    group): a CFS quota of `quota` of one CPU per 100 ms period (a throttled node, as a
    container's or a job's CPU limit), and `shares` (its weight against other groups: a
    high one lets a test's processes have their CPUs on a machine busy with other work).
    Moved in and restored as `memory_cgroup`'s."""
    settings = {} if shares is None else {"cpu.shares": str(shares)}
    if quota is not None:
        settings |= {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(int(quota * 1e5))}
    with cgroup_v1("cpu", name, settings, parent) as group:
        yield group


@contextlib.contextmanager
def cgroup_v1(
    controller: str, name: str, settings: dict[str, str], parent: Path | None = None
) -> Iterator[Path]:
    """A cgroup (v1) of `controller` of its own below this process's (or `parent`), with
    `settings` (file: value) written in order; what was moved in goes back to the parent at
    the end. Fails under CI=true where it cannot be made (cgroup v1, root), else skips."""
    import pytest

    if parent is None:
        here = next(
            (
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if controller in line.split(":")[1].split(",")
            ),
            None,
        )
        parent = Path(f"/sys/fs/cgroup/{controller}" + (here or "/").rstrip("/"))
    group = parent / f"{name}-{os.getpid()}"
    try:
        group.mkdir()
        for file, value in settings.items():
            (group / file).write_text(value)
    except OSError as exc:
        reason = f"no {controller} cgroup of our own at {group} (cgroup v1, root): {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield group
    finally:
        for _ in range(50):  # a process may be forking while we move the others
            pids = (group / "cgroup.procs").read_text().split()
            for pid in pids:
                with contextlib.suppress(OSError):
                    (parent / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)


def linked_copy(src: Path, dst: Path, owner: str | None = None, group: str | None = None) -> None:
    """Copy the Warp modules of `src` (one Warp version's cache folder) into `dst` as hard
    links (no bytes copied; a file is replaced, never written, by Warp and by the tests), its
    folders `owner`'s."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:  # another filesystem
            shutil.copy2(a, b)

    dst.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        shutil.chown(dst, user=owner, group=group)
    for module in src.glob("wp_*") if src.is_dir() else ():
        if not module.is_dir() or re.search(r"_p\d+_t\d+$", module.name):  # half-built
            continue
        if (dst / module.name).exists():  # one there already: Warp's own, or copied before
            continue
        # Put in place whole, as Warp does (a run of the owner's may be loading from `dst`).
        building = dst / f"{module.name}_p{os.getpid()}_t0"
        shutil.copytree(module, building, copy_function=link)
        if owner is not None:
            for folder in [building, *(p for p in building.rglob("*") if p.is_dir())]:
                shutil.chown(folder, user=owner, group=group)
        try:
            building.rename(dst / module.name)
        except OSError:  # one came in the meantime
            shutil.rmtree(building, ignore_errors=True)


class Team:
    """Two unprivileged users of one group, as on a shared login node (mjlab-alice and
    mjlab-bob in mjlab-team), and `shared`: a group-shared (setgid) folder for their runs."""

    GROUP = "mjlab-team"
    USERS = ("mjlab-alice", "mjlab-bob")

    def __init__(self, base: Path) -> None:
        self.base = base
        self.shared = base / "shared"

    def env(self, user: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a command `user` runs: their own home and Warp kernel cache
        (warm with the suite's, in `run`), our venv's scripts on PATH."""
        home = self.base / "home" / user
        env = cli_env(
            {
                "HOME": str(home),
                "USER": user,
                "LOGNAME": user,
                "TMPDIR": str(home),
                "WARP_CACHE_PATH": str(self.base / "warp-cache" / user),
            }
        )
        env.pop("XDG_CACHE_HOME", None)
        env.update(extra or {})
        return env

    def run(
        self,
        user: str,
        argv: list[Any],
        umask: int = 0o022,
        timeout: float = 300,
        extra: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` as `user` (setpriv: their uid, the team's group), in `shared`. Its
        output goes through files: a job it leaves running keeps no pipe of ours open."""
        suite = Path(os.environ["WARP_CACHE_PATH"])
        for version in suite.glob("*") if suite.is_dir() else ():  # what the suite compiled
            linked_copy(version, self.base / "warp-cache" / user / version.name, user, self.GROUP)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.run(
                self.argv(user, argv, umask),
                env=self.env(user, extra),
                cwd=self.shared,
                stdout=out,
                stderr=err,
                timeout=timeout,
            )
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())

    def argv(self, user: str, argv: list[Any], umask: int = 0o022) -> list[str]:
        """`argv` as `user` would start it (with their umask)."""
        inner = f'umask {umask:03o} && exec "$@"'
        setpriv = ["setpriv", f"--reuid={user}", f"--regid={self.GROUP}", "--init-groups"]
        return [*setpriv, "bash", "-c", inner, "bash", *map(str, argv)]


def progress_records(run: RunDir) -> list[dict[str, Any]]:
    """The complete lines of a run's progress.jsonl as written, plain JSON (a torn last line
    is skipped): what a test checks the package's readers against."""
    try:
        text = run.progress.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return [r for r in out if isinstance(r, dict)]

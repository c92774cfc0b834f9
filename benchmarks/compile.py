"""Counting Warp kernel compilations into one kernel cache, per process; cold caches made.

A cache is made empty, or partly cold: a copy of the warm one less some modules.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inotify_simple import INotify, flags

__all__ = [
    "QUICK_COLD_MODULES",
    "CompileWatch",
    "default_kernel_cache",
    "prepare_cache",
    "warp_version",
]

# Warp compiles each module in `<cache>/<module>_p<pid>_t<thread>` and renames it when done.
_BUILD_DIR = re.compile(r"^(?P<module>wp_.+)_p(?P<pid>\d+)_t\d+$")
# Left out of the copied cache by --quick: a mujoco_warp module every model's step loads (one
# short compile instead of every module's).
QUICK_COLD_MODULES = ("wp_mujoco_warp._src.passive_",)


class CompileWatch:
    """Count Warp module compilations into one kernel-cache directory, per process.

    Warp compiles every module in a fresh `<module>_p<pid>_t<thread>` folder of the cache and
    renames it into place; a module loaded from the cache makes none. Watching those folders
    appear (inotify, through inotify_simple; a fast listing poll where inotify is missing)
    counts real compilations by each process, which the finished cache alone cannot show: two
    ranks compiling the same module leave one folder.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.compiles: list[tuple[str, int]] = []
        self.method = "inotify"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inotify: INotify | None = None
        self._seen: set[str] = set()

    def __enter__(self) -> CompileWatch:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._inotify = INotify()
            self._inotify.add_watch(self.cache_dir, flags.CREATE | flags.MOVED_TO)
        except OSError:  # no inotify here (a container without it, too many watches)
            self._inotify = None
            self.method = "poll"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._inotify is not None:
            self._inotify.close()

    def _record(self, name: str) -> None:
        m = _BUILD_DIR.match(name)
        if m and name not in self._seen:
            self._seen.add(name)
            self.compiles.append((m["module"], int(m["pid"])))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._inotify is None:
                with contextlib.suppress(OSError):
                    for entry in os.scandir(self.cache_dir):
                        self._record(entry.name)
                time.sleep(0.005)
                continue
            for event in self._inotify.read(timeout=100):  # milliseconds
                if event.mask & flags.ISDIR:
                    self._record(event.name)

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
    """Make a kernel cache under `base` (WARP_CACHE_PATH) and return the folder Warp fills.

    The cache is empty, or a copy of `warm_from` without the modules whose names start with
    one of `drop` (a partly cold cache).
    """
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

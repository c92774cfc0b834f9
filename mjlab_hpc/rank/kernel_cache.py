"""Where Warp keeps compiled kernels: on the run's filesystem, so every node starts warm.

Warp compiles each kernel module (ours, mujoco_warp's, mjlab's) on first use and caches the
binary, by default in the user's home of each node: a job on nodes that never ran one compiles
again (docs/performance.md, "Kernel cache"). `--kernel-cache auto` keeps the cache under the
log root instead, in a folder of the user's own, one folder per key of what makes a compiled
module wrong elsewhere: the Warp build (its version and the hashes of its native libraries,
since one version may be built with another compiler: NVIDIA/warp#1759), the mujoco_warp and
torch versions, and the device's architecture.

Many ranks on many nodes may compile the same module at once. Warp builds each module in a
folder private to its process and publishes it with one rename, and it loads a module only
when both its binary and its metadata are in place, so a rank never loads a partial module;
the key keeps a stale one out.

A cache holds native code that the ranks load: the default folder is refused (Warp's own
default is used, and said) unless it is this user's and nobody else may write it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from mjlab_hpc.rundir.layout import KERNEL_CACHE_DIR, shared_mkdir

__all__ = [
    "AUTO",
    "NODE",
    "KernelCache",
    "cache_key",
    "choose_kernel_cache",
    "device_arch",
    "use_kernel_cache",
]

#: `--kernel-cache` values that are not folders.
AUTO = "auto"
NODE = "node"


@dataclass(frozen=True)
class KernelCache:
    """Where this rank's Warp keeps its kernels, and why there."""

    path: Path | None
    """The folder (None: Warp's own default, per node)."""
    why: str
    """One line for the rank log."""


def _warp_build() -> str:
    """Warp's version and a digest of its native libraries (as its wheel records them)."""
    version = importlib.metadata.version("warp-lang")
    digest = hashlib.sha256()
    files = importlib.metadata.distribution("warp-lang").files or []
    for f in sorted(files, key=str):
        if f.parts[:2] == ("warp", "bin") and f.hash is not None:
            digest.update(f"{f}={f.hash.value}\n".encode())
    return f"{version}-{digest.hexdigest()[:10]}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key(arch: str) -> str:
    """The folder name of one cache: what a compiled module is valid for."""
    parts = (
        f"warp-{_warp_build()}",
        f"mujoco-warp-{_version('mujoco-warp')}",
        f"torch-{_version('torch')}",
        arch,
    )
    return "_".join(p.replace("/", "-").replace(" ", "-") for p in parts)


def device_arch(device: str) -> str:
    """`sm90` for a CUDA device (Warp's view of it), the machine's architecture for the CPU."""
    if device.startswith("cuda"):
        import warp as wp

        return f"sm{wp.get_device(device).arch}"
    return f"cpu-{platform.machine()}"


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid{os.getuid()}"


def _own_private_folder(path: Path) -> str | None:
    """Make `path` (mode 0700) and say why it may not hold our code, or None when it may."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        return f"cannot make {path}: {exc.strerror or exc}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write {path} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def choose_kernel_cache(choice: str, log_root: str, device: str) -> KernelCache:
    """Decide where Warp keeps this rank's kernels, and make the folder.

    `choice` is --kernel-cache: `auto` (under the log root; Warp's own WARP_CACHE_PATH where
    it is set), `node` (Warp's default) or a folder.
    """
    if choice == NODE:
        return KernelCache(None, "Warp's own per node (--kernel-cache node)")
    if choice == AUTO and os.environ.get("WARP_CACHE_PATH"):
        return KernelCache(None, f"WARP_CACHE_PATH ({os.environ['WARP_CACHE_PATH']})")
    key = cache_key(device_arch(device))
    if choice != AUTO:
        path = Path(choice).absolute() / key
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return KernelCache(None, f"Warp's own per node: cannot make {path}: {exc}")
        return KernelCache(path, f"{path} (--kernel-cache)")
    mine = Path(log_root).absolute() / KERNEL_CACHE_DIR / _user()
    try:
        shared_mkdir(mine.parent)
    except OSError as exc:
        return KernelCache(None, f"Warp's own per node: cannot make {mine.parent}: {exc}")
    problem = _own_private_folder(mine)
    if problem is None:
        (mine / key).mkdir(exist_ok=True)
        return KernelCache(mine / key, f"{mine / key} (under --log-root)")
    return KernelCache(None, f"Warp's own per node, not {mine}: {problem}")


def use_kernel_cache(cache: KernelCache) -> None:
    """Make Warp compile into and load from `cache` (after `wp.init()`, before any kernel)."""
    if cache.path is not None:
        import warp as wp

        wp.config.kernel_cache_dir = str(cache.path)

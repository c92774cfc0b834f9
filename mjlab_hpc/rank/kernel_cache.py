"""Where Warp keeps compiled kernels: a folder of the user's own, held open while Warp uses it.

Warp compiles each kernel module (ours, mujoco_warp's, mjlab's) on first use and caches the
binary; a cached module is native code that the ranks load and run. `--kernel-cache auto`
keeps it in the user's home (`$XDG_CACHE_HOME` or `~/.cache`, then `mjlab-hpc/kernels`), so
every log root and working folder shares it, and every node does where homes are shared; a site
whose homes are not shared names a shared folder (`kernel-cache = "/shared/..."` in its config
file's [defaults]). Where WARP_CACHE_PATH is set `auto` leaves it to Warp, and `node` is Warp's
own default; where that folder is another user's, or others may write it, the rank warns and
uses the user's own folder in their home instead.

Under the folder (the home's, or a --kernel-cache folder that others may own: a team's, a
site's) the cache is `<user>/<key>/`. `<user>` is this user's alone (mode 0700), `<key>` names
what makes a compiled module wrong elsewhere: the Warp build (its version and the hashes of its
native libraries, since one version may be built with another compiler: NVIDIA/warp#1759), the
mujoco_warp and torch versions, and the device's architecture. Each level is opened without
following a link and checked on the open descriptor (ours; `<user>` 0700, `<key>` not writable
by others), and Warp is handed `/proc/self/fd/N`: what was checked is what Warp reads, whatever
happens to the names later (whoever owns the shared folder may rename ours and put a link in its
place). A folder that fails is not used: Warp's own default is, and the rank warns.

Many ranks on many nodes may compile the same module at once. Warp builds each module in a
folder private to its process and publishes it with one rename, and loads a module only when
both its binary and its metadata are in place. A cached module Warp fails to load (a binary cut
short) is moved aside and compiled again, once, wherever the cache is.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib
import importlib.metadata
import logging
import os
import platform
import pwd
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.procs import user_name

__all__ = [
    "AUTO",
    "NODE",
    "KernelCache",
    "cache_key",
    "choose_kernel_cache",
    "device_arch",
    "folder_problem",
    "home_cache",
    "use_kernel_cache",
]

#: `--kernel-cache` values that are not folders.
AUTO = "auto"
NODE = "node"

log = logging.getLogger("mjlab_hpc")

_BELOW = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
# What others may not do: enter `<user>` (nothing below it is theirs to reach), write `<key>`.
_USER_BITS, _KEY_BITS = 0o077, 0o022


@dataclass(frozen=True)
class KernelCache:
    """Where this rank's Warp keeps its kernels, and why there."""

    path: Path | None
    """The folder (None: Warp's own default)."""
    why: str
    """One line for the rank log."""
    fd: int | None = None
    """`path` held open for the process's life: Warp reads and writes through it."""
    warning: bool = False
    """`why` is a warning: the folder asked for is not used."""


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


def home_cache() -> Path:
    """The folder `auto` keeps kernels under: the user's cache folder in their home."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).absolute() / "mjlab-hpc" / "kernels"


def _mode_problem(shown: Path, info: os.stat_result, forbidden: int) -> str | None:
    """Why a folder (lstat/fstat `info`) may not hold code this user runs, None when it may."""
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{shown} is a link or a file, not a folder"
    if info.st_uid != os.getuid():
        return f"{shown} belongs to {user_name(info.st_uid)}, not to you"
    mode = stat.S_IMODE(info.st_mode)
    if mode & forbidden:
        reach = "enter" if forbidden == _USER_BITS else "write"
        return f"others may {reach} {shown} (mode {mode:o}; chmod {0o777 & ~forbidden:o} it)"
    return None


def folder_problem(root: str | Path) -> str | None:
    """Why `root/<user>` may not hold this user's kernels (creating nothing), None when it may.

    The check before anything is submitted or started; the rank checks again as it opens it.
    """
    mine = Path(root).absolute() / _user()
    try:
        info = mine.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at {mine}: {exc.strerror or exc}"
    return _mode_problem(mine, info, _USER_BITS)


class _Refused(Exception):
    """A level of the cache that may not hold this user's code."""


def _open_below(parent: int, name: str, shown: Path, forbidden: int) -> int:
    """Open folder `name` of the open folder `parent` (made 0700 when missing), never a link,
    and return its descriptor once it is checked."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    try:
        fd = os.open(name, _BELOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Refused(f"{shown} is a link or a file, not a folder") from exc
        raise
    problem = _mode_problem(shown, os.fstat(fd), forbidden)
    if problem is not None:
        os.close(fd)
        raise _Refused(problem)
    return fd


def _hold(root: Path, key: str) -> int:
    """Open `root/<user>/<key>`, checking each level below `root`, and return its descriptor."""
    root.mkdir(parents=True, exist_ok=True)  # the shared folder: anyone's, reached as named
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = root
    try:
        for name, forbidden in ((_user(), _USER_BITS), (key, _KEY_BITS)):
            shown = shown / name
            child = _open_below(fd, name, shown, forbidden)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _warp_own(how: str, warning: bool = False) -> KernelCache:
    """Warp's own folder (WARP_CACHE_PATH, else its default), said with a warning when others
    own it or may write it."""
    import warp as wp

    folder = Path(wp.config.kernel_cache_dir)
    try:
        problem = _mode_problem(folder, folder.lstat(), _KEY_BITS)
    except OSError as exc:
        problem = f"cannot look at {folder}: {exc.strerror or exc}"
    if problem is not None:
        return KernelCache(None, f"{folder} ({how}); {problem}", warning=True)
    return KernelCache(None, f"{folder} ({how})", warning=warning)


def _held(choice: str, device: str) -> KernelCache:
    """`<root>/<user>/<key>` opened and checked (`root`: the home's for `auto`, else `choice`),
    or Warp's own folder with a warning why not."""
    flag = f"--kernel-cache {choice}" if choice == AUTO else "--kernel-cache"
    try:
        root = home_cache() if choice == AUTO else Path(choice).absolute()
        path = root / _user() / cache_key(device_arch(device))
        if not Path("/proc/self/fd").is_dir():  # no way to hand Warp the folder checked
            raise _Refused("this system has no /proc/self/fd to hold it by")
        fd = _hold(root, path.name)
    except _Refused as exc:
        return _warp_own(f"Warp's own default, not {path} ({flag}): {exc}", warning=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home to find
        said = getattr(exc, "strerror", None) or exc
        return _warp_own(f"Warp's own default, not the {flag} folder: {said}", warning=True)
    return KernelCache(path, f"{path} ({flag})", fd=fd)


def choose_kernel_cache(choice: str, device: str) -> KernelCache:
    """Decide where Warp keeps this rank's kernels, and open (or make) the folder.

    `choice` is --kernel-cache: `auto` (a folder of the user's in their home; WARP_CACHE_PATH
    where it is set), `node` (Warp's own default) or a folder (maybe shared: the cache is
    `<folder>/<user>/<key>`). Call after `wp.init()`.
    """
    if choice == NODE or (choice == AUTO and os.environ.get("WARP_CACHE_PATH")):
        how = "Warp's own default: --kernel-cache node" if choice == NODE else "WARP_CACHE_PATH"
        warp = _warp_own(how)
        if not warp.warning:
            return warp
        # Warp's folder is another user's, or others may write it: what it holds is native
        # code this rank would run (and Warp could not write there). The user's own instead.
        own = _held(AUTO, device)
        if own.fd is None:
            return warp
        return KernelCache(own.path, f"{own.why}, not {warp.why}", fd=own.fd, warning=True)
    return _held(choice, device)


def use_kernel_cache(cache: KernelCache) -> None:
    """Make Warp compile into and load from `cache` (after `wp.init()`, before any kernel), and
    compile again a cached module it fails to load."""
    import warp as wp

    if cache.fd is not None:
        wp.config.kernel_cache_dir = f"/proc/self/fd/{cache.fd}"
    if cache.warning:
        print(f"warning: kernel cache: {cache.why}", file=sys.stderr, flush=True)
    module = importlib.import_module("warp._src.context").Module
    if not getattr(module.load, "_rebuilds_damaged", False):
        # Warp loads a cached module as long as its files exist, and offers no check of their
        # content: a cut-short binary fails every start. Global, as Warp's own config is.
        module.load = _rebuilding(module.load)


def _shown(path: str) -> str:
    """`path` as people know it (the folder behind a /proc/self/fd/N prefix)."""
    parts = path.split(os.sep)
    if parts[1:4] == ["proc", "self", "fd"] and len(parts) > 4:
        with contextlib.suppress(OSError):
            return os.path.join(os.readlink(os.sep.join(parts[:5])), *parts[5:])
    return path


def _rebuilding(load: Callable[..., Any]) -> Callable[..., Any]:
    """Warp's `Module.load`, which moves aside a cached module it fails to load (a binary cut
    short, metadata that does not parse) and compiles it again, once."""

    @functools.wraps(load)
    def load_or_rebuild(module: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load(module, device, *args, **kwargs)
        except Exception as exc:
            if args[1:] or kwargs.get("binary_path"):  # a binary named by the caller
                raise
            import warp as wp

            block_dim = args[0] if args else kwargs.get("block_dim")
            if block_dim is None:
                block_dim = module.options.get("block_dim")
            name = module.get_module_identifier(block_dim)
            folder = os.path.join(wp.config.kernel_cache_dir, name)
            aside = f"{folder}.damaged-{os.getpid()}"
            try:
                os.rename(folder, aside)
            except FileNotFoundError:
                pass  # nothing cached (a compile error, said again below), or a rank moved it
            except OSError:
                raise exc from None  # not ours to replace: Warp's error as it is
            else:
                said = f"could not load {_shown(folder)} ({exc}): compiling it again"
                log.warning("kernel cache: %s", said)
                print(f"warning: kernel cache: {said}", file=sys.stderr, flush=True)
                shutil.rmtree(aside, ignore_errors=True)
            return load(module, device, *args, **kwargs)

    load_or_rebuild._rebuilds_damaged = True  # type: ignore[attr-defined]
    return load_or_rebuild

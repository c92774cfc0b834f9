"""Shared test set-up.

`make test` runs the suite on three pytest-xdist workers (`--dist loadgroup`): each test file
stays on one worker (module fixtures start their jobs once), and every test that needs the
two-node Slurm test cluster runs on the same worker, which starts the cluster once and stops
it; the tests of the three-node cluster (a cluster of its own) run together beside them.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import BIN, Team

# Session fixture `slurm_cluster`: the real two-node Slurm test cluster (tests/cluster/).
from slurm_cluster import slurm_cluster, slurm_cluster3  # noqa: F401

_ROOT = Path(__file__).resolve().parent

# Every command the tests start shares Warp's compiled kernels through Warp's own variable (a
# run's default is a cache under its log root, and each test has a log root of its own: each
# would compile from nothing). tests/rank/test_kernel_cache.py tests the default.
os.environ.setdefault(
    "WARP_CACHE_PATH",
    str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "warp"),
)

# A suite started in the background of a script inherits SIGINT ignored (POSIX), and so would
# every command the tests start: Ctrl-C tests would wait forever. Python's own handler instead
# (a process starts with SIGINT at its default again).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)  # around xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = str(item.path.relative_to(_ROOT))
        if "slurm_cluster3" in getattr(item, "fixturenames", ()):
            group = "slurm3"
        elif item.get_closest_marker("slurm"):
            group = "slurm"
        item.add_marker(pytest.mark.xdist_group(group))
    return (yield)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every test of this session sees, on every xdist worker (for work done once
    per session, such as reference runs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mount small tmpfs filesystems under tmp_path; unmounted at teardown."""
    mounted: list[Path] = []

    def _mount(name: str, options: str) -> Path:
        target = tmp_path / name
        target.mkdir()
        try:
            res = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            problem = " ".join(res.stderr.split()) if res.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
        if problem:
            reason = f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {problem}"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        mounted.append(target)
        return target

    yield _mount
    for target in reversed(mounted):
        if subprocess.run(["umount", str(target)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture(scope="session")
def team() -> Iterator[Team]:
    """Two unprivileged users of one group and a group-shared folder (helpers.Team).

    The users are made with useradd where missing, as root only (it fails under CI=true
    otherwise). While the session runs, the folders of our interpreter and venv that they
    could not enter (root's home, 0700) may be entered (o+x, nothing listed or read); they
    are restored after.
    """
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        reason = "a second user needs root, useradd and setpriv"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    # Another xdist worker may make them at the same moment: what counts is that they exist.
    subprocess.run(["groupadd", "-f", Team.GROUP], capture_output=True)
    for user in Team.USERS:
        subprocess.run(
            ["useradd", "-M", "-N", "-g", Team.GROUP, "-s", "/bin/bash", user], capture_output=True
        )
        subprocess.run(["id", user], capture_output=True, check=True)
    opened = []
    for target in (Path(os.path.realpath(sys.executable)), BIN):
        for folder in target.parents:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(folder, mode | stat.S_IXOTH)
                opened.append((folder, mode))
    base = Path(tempfile.mkdtemp(prefix="team-", dir=os.environ.get("TMPDIR")))
    os.chmod(base, 0o755)
    team = Team(base)
    team.shared.mkdir()
    shutil.chown(team.shared, group=Team.GROUP)
    os.chmod(team.shared, 0o2775)
    for user in Team.USERS:
        home = base / "home" / user
        home.mkdir(parents=True)
        shutil.chown(home, user=user, group=Team.GROUP)
        # Each user's own Warp cache (a shared one is refused: others' native code), warmed
        # before each command with what the suite compiled (Team.run).
        (base / "warp-cache" / user).mkdir(parents=True)
        shutil.chown(base / "warp-cache" / user, user=user, group=Team.GROUP)
    try:
        yield team
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for folder, mode in reversed(opened):
            os.chmod(folder, mode)

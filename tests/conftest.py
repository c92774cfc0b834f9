"""Shared test set-up.

`make test` runs the suite on three pytest-xdist workers (`--dist loadgroup`): each test file
stays on one worker (module fixtures start their jobs once), and every test that needs the
Slurm test cluster runs on the same worker, which starts the cluster once and stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Session fixture `slurm_cluster`: the real two-node Slurm test cluster (tests/cluster/).
from slurm_cluster import slurm_cluster, slurm_cluster3  # noqa: F401

_ROOT = Path(__file__).resolve().parent

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
        group = "slurm" if item.get_closest_marker("slurm") else str(item.path.relative_to(_ROOT))
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

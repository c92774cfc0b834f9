"""mjlab_hpc: multi-node, preemption-safe RL training of MuJoCo Warp robots on Slurm clusters.

The supported API is `TrainSpec`, `SubmitSpec`, `ResolvedSpec` and `resolve`; `train_rank`
and `RankResult`; `submit`, `submit_sweep` and `Submitted`; `LeaseLock`, `OwnerInfo` and
`write_fenced`; `SpecError`, `LaunchError` and `SubmitError`. Each name loads on first use, so
torch, warp and submitit load only when a name that needs them is used. How the packages
depend on each other: docs/architecture.md.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mjlab_hpc.errors import LaunchError, SpecError, SubmitError
    from mjlab_hpc.launch.submit import Submitted, submit, submit_sweep
    from mjlab_hpc.rank.train import RankResult, train_rank
    from mjlab_hpc.rundir.lock import LeaseLock, OwnerInfo, write_fenced
    from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
    from mjlab_hpc.validate import resolve

# rsl-rl imports GitPython, which refuses to import where no `git` executable is (a node or
# image without git: every rank would die at import). rsl-rl only uses git to store a diff,
# and skips that on any error; the run's code is recorded by rundir/snapshot anyway.
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

try:
    __version__ = version("mjlab-hpc")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LaunchError": "mjlab_hpc.errors",
    "SpecError": "mjlab_hpc.errors",
    "SubmitError": "mjlab_hpc.errors",
    "Submitted": "mjlab_hpc.launch.submit",
    "submit": "mjlab_hpc.launch.submit",
    "submit_sweep": "mjlab_hpc.launch.submit",
    "RankResult": "mjlab_hpc.rank.train",
    "train_rank": "mjlab_hpc.rank.train",
    "LeaseLock": "mjlab_hpc.rundir.lock",
    "OwnerInfo": "mjlab_hpc.rundir.lock",
    "write_fenced": "mjlab_hpc.rundir.lock",
    "ResolvedSpec": "mjlab_hpc.spec",
    "SubmitSpec": "mjlab_hpc.spec",
    "TrainSpec": "mjlab_hpc.spec",
    "resolve": "mjlab_hpc.validate",
}

__all__ = [
    "LaunchError",
    "LeaseLock",
    "OwnerInfo",
    "RankResult",
    "ResolvedSpec",
    "SpecError",
    "SubmitError",
    "SubmitSpec",
    "Submitted",
    "TrainSpec",
    "__version__",
    "resolve",
    "submit",
    "submit_sweep",
    "train_rank",
    "write_fenced",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mjlab_hpc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

"""Helpers shared by the operations tests (local executor and Slurm)."""

import time
from collections.abc import Callable
from typing import Any

# Fault injection for the tests: on the rank named by MJLAB_FAULT_RANK (SLURM_PROCID or the
# local executor's global id), training raises inside the loop at MJLAB_FAULT_ITERATION,
# exactly where a bug in a hook would. Loaded by Python itself (sitecustomize on PYTHONPATH).
FAULT_INJECTION = """
import importlib.abc, importlib.util, os, sys

_rank = os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID")

class _Inject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "mjlab_hpc.progress":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            update, at = module.ProgressDisplay.update, int(os.environ["MJLAB_FAULT_ITERATION"])

            def failing(self, s):
                if s.iteration >= at:
                    raise RuntimeError(f"injected fault on rank {_rank} at iteration {s.iteration}")
                update(self, s)

            module.ProgressDisplay.update = failing

        spec.loader.exec_module = exec_module
        return spec

if _rank is not None and _rank == os.environ.get("MJLAB_FAULT_RANK"):
    sys.meta_path.insert(0, _Inject())
"""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.25) -> Any:
    """Poll until `predicate()` returns something true; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")

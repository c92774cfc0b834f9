"""`python -m benchmarks.path`: the package modules one `mjlab-submit` passes through.

The path runs from the command line to a rank's first iteration. Two processes are traced with
`sys.setprofile`: `mjlab-submit cartpole --executor local` (in-process, to its submission) and
one rank (`RankJob` in-process, to the end of its first iteration). It prints the modules the
request passes through (functions called with the spec, the resolved spec or the job that
carries it; `spec.py`, where these classes live, is not counted) and every package module whose
code ran, each list with its count; nothing is written. docs/architecture.md describes the path.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from types import FrameType
from typing import Any

REQUEST = ("TrainSpec", "SubmitSpec", "ResolvedSpec", "RankJob")


class Trace:
    """Record what one traced stretch of code ran: the modules handed the request, and all."""

    def __init__(self) -> None:
        self.request: set[str] = set()
        self.ran: set[str] = set()
        self.stopped = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.stopped:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("mjlab_hpc"):
            return
        code = frame.f_code
        if module == "mjlab_hpc.rank.stop" and code.co_qualname == "IterationBoundary.__call__":
            self.stopped = True  # the first iteration is done
            return
        self.ran.add(module)
        if module == "mjlab_hpc.spec":  # the request's own methods
            return
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            if type(frame.f_locals.get(name)).__name__ in REQUEST:
                self.request.add(module)
                break

    def run(self, fn: Any) -> None:
        sys.setprofile(self)
        threading.setprofile(self)
        try:
            fn()
        except SystemExit:
            pass
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def trace(root: str) -> tuple[Trace, Trace]:
    """Trace the submitting process and one rank."""
    from mjlab_hpc.cli import submit

    args = [
        "cartpole",
        "--executor",
        "local",
        "--gpus-per-node",
        "0",
        "--num-envs",
        "16",
        "--max-iterations",
        "1",
        "--log-root",
        root,
        "--torch-threads",
        "1",
    ]
    launcher = Trace()
    launcher.run(lambda: submit.main(args))

    from mjlab_hpc import TrainSpec, resolve
    from mjlab_hpc.rank import RankJob

    spec = resolve(TrainSpec(num_envs=16, max_iterations=2, log_root=root, torch_threads=1))
    rank = Trace()
    rank.run(RankJob(spec))
    return launcher, rank


def main(argv: list[str] | None = None) -> int:
    """Print both traces and the counts."""
    argparse.ArgumentParser(prog="python -m benchmarks.path", description=__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        os.environ.pop("SLURM_JOB_ID", None)
        launcher, rank = trace(root)
    request = sorted(launcher.request | rank.request)
    ran = sorted(launcher.ran | rank.ran)
    print(f"request passes through {len(request)} modules: {', '.join(request)}")
    print(f"code of {len(ran)} package modules ran: {', '.join(ran)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ended a rank's start, decided where the exception is caught: from its type.

The rank writes the kind into its end record (`rundir.ends.FailureKind`); healing, the
crash-loop check, `status`, `logs` and the batch script's watcher read that kind and never an
error's text. Two kinds of error come without a type of their own, and are told by where they
were raised instead (the innermost frame of their traceback), never by their message:

- gloo raises a plain RuntimeError for a peer that closed its connection or a collective
  that timed out (NCCL raises DistBackendError): a RuntimeError raised inside a
  torch.distributed collective is a lost peer.
- Warp's allocators raise a plain RuntimeError when an allocation fails.

torch's own CPU allocator raises a plain RuntimeError from C++ too, at whatever torch call
asked for memory: there is no place to tell it by, so it counts as an exception (a crash,
healed as one; the crash-loop check stops its repeat). MemoryError (Python's, numpy's),
torch.OutOfMemoryError (CUDA) and the kernel's ENOMEM are out of memory by their type.
"""

from __future__ import annotations

import errno
import sys
from types import TracebackType

from mjlab_hpc.errors import Diverged, environment_problem
from mjlab_hpc.rundir.ends import FailureKind

__all__ = ["failure_kind"]

# Where an error without a type of its own comes from: (module, function or None for any).
_COLLECTIVES = ("torch.distributed.distributed_c10d", None)
_WARP_ALLOCATORS = ("warp._src.context", "allocate")


def _raised_in(exc: BaseException, where: tuple[str, str | None]) -> bool:
    """Whether `exc` was raised by Python code of module `where[0]` (in function `where[1]`)."""
    tb: TracebackType | None = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module, function = where
    frame = tb.tb_frame
    return frame.f_globals.get("__name__") == module and function in (None, frame.f_code.co_name)


def _types(module: str, *names: str) -> tuple[type, ...]:
    """The exception classes of a library, where it is loaded (unloaded: none of its errors
    can have been raised)."""
    loaded = sys.modules.get(module)
    return tuple(t for n in names if isinstance(t := getattr(loaded, n, None), type))


def failure_kind(exc: BaseException, where: object = "the run directory") -> FailureKind:
    """Classify the exception that ended a rank's start, from its type (see the module).

    `where` is the run directory, for a filesystem error that names no file. A failed
    preflight check is the rank's own to say (`rank.train`): its node's, or another's.
    """
    if isinstance(exc, Diverged):
        return "diverged"
    if environment_problem(exc, where) is not None:
        return "environment"
    memory = (MemoryError, *_types("torch", "OutOfMemoryError"))
    if isinstance(exc, memory) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return "out-of-memory"
    if type(exc) is RuntimeError and _raised_in(exc, _WARP_ALLOCATORS):
        return "out-of-memory"
    # A connection another rank closed or reset, a store or collective that timed out.
    peer = (ConnectionError, TimeoutError, *_types("torch.distributed", "DistError"))
    if isinstance(exc, peer):
        return "peer-lost"
    if type(exc) is RuntimeError and _raised_in(exc, _COLLECTIVES):
        return "peer-lost"
    return "exception"

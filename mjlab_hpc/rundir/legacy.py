"""Rank states written before they were plain data (mjlab_hpc up to d42f375), read as data.

Those states pickled numpy's RNG state and scalars and the enums of an environment's settings
(`mjlab.actuator.actuator.TransmissionType`, `mujoco_warp._src.types.BroadphaseType`, and a
class holding one, `ViewerConfig.OriginType`), which torch's plain weights-only load refuses.
They are read here, only where a file names nothing else:

- numpy's array, scalar and dtype rebuilders, by a fixed list of names (numpy 2's and 1's);
- an enum class of the simulator's packages (mjlab, mujoco_warp, mujoco, warp), whatever
  its name, as one stand-in that is never imported: calling it with a member's value gives
  that value, and an attribute of it (a nested enum class) is itself. Restoring turns the
  value back into the live environment's enum (`tasks.envstate`).

torch's own list of what a weights-only load may build is extended for the one load only
(`torch.serialization.safe_globals`); a name that is none of these is refused by torch, as in
any other file.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["read", "reads", "unread"]

# numpy's rebuilders by the names pickles give them (numpy 2's module, and numpy 1's).
_NUMPY = {
    "numpy._core.multiarray._reconstruct": "_reconstruct",
    "numpy.core.multiarray._reconstruct": "_reconstruct",
    "numpy._core.multiarray.scalar": "scalar",
    "numpy.core.multiarray.scalar": "scalar",
}
# The packages whose enum classes an environment's saved settings named.
_ENUM_PACKAGES = frozenset({"mjlab", "mujoco_warp", "mujoco", "warp"})
_GETATTR = "builtins.getattr"
_PLAIN = (int, float, bool, str, bytes, type(None))


class _EnumAsValue:
    """An old state's enum class, any of them: from a member's value to that value."""

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, _PLAIN) and not (
            isinstance(value, tuple) and all(isinstance(x, _PLAIN) for x in value)
        ):
            raise pickle.UnpicklingError(f"an enum member of value {type(value).__name__}")
        return value


_ENUM = _EnumAsValue()


def _getattr(obj: Any, name: str) -> Any:
    """`getattr` as a pickle of a nested enum class calls it (`Outer.Inner`): the stand-in."""
    if obj is not _ENUM:
        raise pickle.UnpicklingError(f"getattr({type(obj).__name__}, {name!r}) is no enum class")
    return _ENUM


def _is_enum_name(name: str) -> bool:
    return name.split(".")[0] in _ENUM_PACKAGES


def _numpy_dtype(name: str) -> bool:
    return name == "numpy.dtype" or name.startswith("numpy.dtypes.")


def unread(names: Iterable[str]) -> list[str]:
    """Of the globals a rank state names, those no reader here builds (empty: it loads)."""
    return [
        n
        for n in names
        if n not in _NUMPY
        and n not in ("numpy.ndarray", _GETATTR)
        and not _numpy_dtype(n)
        and not _is_enum_name(n)
    ]


def reads(names: Iterable[str]) -> bool:
    """Whether a file that names these globals (beyond torch's own) is read here."""
    return not unread(names)


def _allowed(names: Iterable[str]) -> list[tuple[Any, str]]:
    import numpy as np
    import numpy.dtypes

    core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    allowed: list[tuple[Any, str]] = [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    allowed += [(getattr(core.multiarray, attr), n) for n, attr in _NUMPY.items()]
    # A dtype is rebuilt as an instance of its class (numpy.dtypes.Float64DType, ...).
    allowed += [
        (cls, f"numpy.dtypes.{cls.__name__}")
        for cls in vars(numpy.dtypes).values()
        if isinstance(cls, type) and issubclass(cls, np.dtype)
    ]
    allowed.append((_getattr, _GETATTR))
    allowed += [(_ENUM, n) for n in names if _is_enum_name(n)]
    return allowed


def read(f: IO[bytes], map_location: str | None) -> Any:
    """Load an old rank state (`reads` its names) weights-only, its enums as their values."""
    import torch

    names = list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    f.seek(0)
    with torch.serialization.safe_globals(_allowed(names)):
        return torch.load(f, map_location=map_location, weights_only=True)

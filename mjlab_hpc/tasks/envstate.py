"""An environment's whole state, found by walking its object graph and put back in place.

Every torch tensor, Warp array, numpy array, random generator and plain value reachable from
the environment object is saved by its attribute path, so a term that gains a buffer is saved
without this code changing. Restoring writes into the fresh environment's own tensors and
arrays, so captured Warp graphs and views keep pointing at valid memory. A value the fresh
environment lacks is set where its parent is; aliases stay one object. What a task's adapter
says is not state (`Rules`) is left out.

What is captured is plain data that `torch.load(..., weights_only=True)` reads: tensors, and
values of Python's own types. An enum is kept as its value and a numpy scalar as Python's number;
restoring turns each back into the live environment's own type at that path. A large per-world
array whose columns are mostly the same in every world keeps those columns once (`_compact`).

No library walks an arbitrary object graph this way: `torch.save` pickles objects instead of
filling existing ones, and mjlab's own checkpoint keeps only a step counter.
"""

from __future__ import annotations

import collections
import enum
import random
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import warp as wp

__all__ = ["Rules", "capture", "differences", "restore"]

# A per-world array at least this large keeps the columns equal in every world once.
_COMPACT_BYTES = 1 << 16

_SCALARS = (int, float, bool, str, bytes, complex, type(None), np.generic, enum.Enum)
# Objects of these packages are not walked into (their state is not the environment's:
# devices, modules, kernels, compiled MuJoCo models, dtypes).
_NOT_WALKED = frozenset(
    {
        "builtins",
        "torch",
        "numpy",
        "warp",
        "mujoco",
        "typing",
        "types",
        "functools",
        "collections",
        "enum",
        "abc",
        "threading",
        "logging",
    }
)


@dataclass(frozen=True)
class Rules:
    """What of an environment's object graph is not its state (a task's adapter says)."""

    skip_names: frozenset[str] = frozenset()
    """Attribute and key names never walked (a renderer, per-step log output)."""
    only_fields: Callable[[object], Iterable[str] | None] = lambda obj: None
    """The attributes that are an object's state, where they are a subset (None: all of them).

    A simulator's data is one such object: its state is the integration state.
    """
    derived: Callable[[object], Iterable[object]] = lambda root: ()
    """What is recomputed from the state: Warp arrays, and objects left out whole.

    Examples are a simulator's derived quantities and a renderer's acceleration structures.
    Tensors and arrays whose memory lies in them are not saved, whatever they are called.
    """


@dataclass
class _Leaf:
    parent: str
    key: Any
    attr: bool
    value: Any


@dataclass
class _Graph:
    leaves: dict[str, _Leaf] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    left_out: set[str] = field(default_factory=set)
    """Paths the rules leave out: derived objects, attributes an object's only_fields omit."""

    def leaves_out(self, path: str) -> bool:
        """Whether `path`, or an object it lies in, is left out."""
        return path in self.left_out or any(
            c in ".[" and path[:i] in self.left_out for i, c in enumerate(path)
        )


def _walked(obj: object) -> bool:
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "__dict__")):
        return False
    cls = type(obj)
    package = cls.__module__.split(".")[0]
    if package == "warp":
        return cls.__name__ == "StructInstance"  # Warp structs hold arrays
    return package not in _NOT_WALKED and (hasattr(obj, "__dict__") or hasattr(cls, "__slots__"))


def _attributes(obj: object) -> dict[str, Any]:
    attrs = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in attrs and hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
    return attrs


def _is_value(obj: object) -> bool:
    """A plain value, or a tuple, set or list of them (restored as a whole)."""
    if isinstance(obj, _SCALARS):
        return True
    if isinstance(obj, tuple | list | set | frozenset):
        return all(isinstance(x, _SCALARS) for x in obj)
    return False


def _is_array(obj: object) -> bool:
    return isinstance(obj, torch.Tensor | wp.array | np.ndarray)


def _is_rng(obj: object) -> bool:
    return isinstance(obj, torch.Generator | np.random.Generator | random.Random)


def _walk(root: object, name: str, rules: Rules, skipped: Iterable[object] = ()) -> _Graph:
    """Find every leaf by every path that reaches it; `skipped` objects are not entered.

    Objects are entered once, breadth first, so the shortest path names them.
    """
    graph = _Graph()
    derived = {id(obj) for obj in skipped}
    seen = set(derived)
    queue: collections.deque[tuple[str, str, Any, bool, object]] = collections.deque(
        [(name, "", None, True, root)]
    )
    while queue:
        path, parent, key, attr, obj = queue.popleft()
        if _is_value(obj) or _is_array(obj) or _is_rng(obj):
            graph.leaves[path] = _Leaf(parent, key, attr, obj)
            continue
        if id(obj) in seen:
            if id(obj) in derived:
                graph.left_out.add(path)
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            graph.objects[path] = obj
            items = [(k, v) for k, v in obj.items() if isinstance(k, str | int | tuple)]
            queue.extend(
                (f"{path}[{k!r}]", path, k, False, v) for k, v in items if k not in rules.skip_names
            )
        elif isinstance(obj, list | tuple):
            graph.objects[path] = obj
            queue.extend((f"{path}[{i}]", path, i, False, v) for i, v in enumerate(obj))
        elif _walked(obj):
            graph.objects[path] = obj
            attrs = _attributes(obj)
            only = rules.only_fields(obj)
            names = [n for n in attrs if n not in rules.skip_names]
            if only is not None:
                kept = set(only)
                graph.left_out.update(f"{path}.{n}" for n in names if n not in kept)
                names = [n for n in names if n in kept]
            queue.extend((f"{path}.{n}", path, n, True, attrs[n]) for n in names)
    return graph


def _collapsed(t: torch.Tensor) -> torch.Tensor:
    """`t` without its broadcast dimensions (stride 0): the memory it really has."""
    if all(s != 0 or n <= 1 for n, s in zip(t.shape, t.stride(), strict=True)):
        return t
    shape = [1 if s == 0 else n for n, s in zip(t.shape, t.stride(), strict=True)]
    return t.as_strided(shape, t.stride(), t.storage_offset())


def _as_torch(obj: object) -> torch.Tensor | None:
    """Return a tensor viewing the memory of a tensor, Warp array or numpy array.

    None for a Warp array of handles, such as textures, that is no state.
    """
    if isinstance(obj, torch.Tensor):
        return _collapsed(obj.detach())
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj) if obj.dtype != object else None
    assert isinstance(obj, wp.array)
    if obj.size == 0:
        return torch.empty(0)
    try:
        return _collapsed(wp.to_torch(obj, requires_grad=False))
    except (TypeError, RuntimeError):
        return None


class _Memory:
    """Address ranges of arrays, to tell whether a tensor's memory lies in one of them."""

    def __init__(self, arrays: Iterable[object]) -> None:
        spans = []
        for a in arrays:
            t = _as_torch(a)
            if t is not None and t.numel():
                start = t.data_ptr()
                spans.append((start, start + t.untyped_storage().nbytes()))
        spans.sort()
        self.starts = [s for s, _ in spans]
        self.ends = [e for _, e in spans]

    def holds(self, t: torch.Tensor) -> bool:
        i = bisect_right(self.starts, t.data_ptr()) - 1
        return i >= 0 and t.data_ptr() < self.ends[i]


def _arrays_in(objects: Iterable[object]) -> Iterator[object]:
    """The arrays among `objects` and inside the others (a walk of each)."""
    for obj in objects:
        if _is_array(obj):
            yield obj
        else:
            yield from (
                leaf.value
                for leaf in _walk(obj, "", Rules()).leaves.values()
                if _is_array(leaf.value)
            )


def _rng_state(obj: object) -> tuple[str, Any]:
    if isinstance(obj, torch.Generator):
        return "torch", obj.get_state()
    if isinstance(obj, np.random.Generator):
        return "numpy", _plain(obj.bit_generator.state)
    assert isinstance(obj, random.Random)
    return "python", obj.getstate()


def capture(root: object, rules: Rules, name: str = "env") -> dict[str, Any]:
    """Capture the state of everything reachable from `root`.

    The result maps each path to (parent path, key, is attribute, kind, value). Tensors and
    arrays are copied to the CPU, one copy per object whatever the number of paths to it.
    """
    derived = list(rules.derived(root))
    graph = _walk(root, name, rules, derived)
    memory = _Memory(_arrays_in(derived))
    copies: dict[tuple[Any, ...], torch.Tensor] = {}  # one copy per piece of memory
    out: dict[str, Any] = {}
    for path, leaf in graph.leaves.items():
        obj = leaf.value
        if _is_array(obj):
            view = _as_torch(obj)
            if view is None or (view.numel() and memory.holds(view)):
                continue
            where = (view.data_ptr(), view.device, view.shape, view.stride(), view.dtype)
            if where not in copies:
                copies[where] = _compact(view.to("cpu", copy=True))
            kind = "warp" if isinstance(obj, wp.array) else type(obj).__module__.split(".")[0]
            value: Any = copies[where]
        elif _is_rng(obj):
            kind, value = "rng", _rng_state(obj)
        else:
            kind, value = "value", _plain(obj)
        out[path] = (leaf.parent, _plain(leaf.key), leaf.attr, kind, value)
    return out


def _plain(obj: Any) -> Any:
    """`obj` as plain data: an enum as its value, a numpy scalar as Python's number, a
    frozenset as a set, numpy's arrays as lists; inside tuples, lists, sets and dicts too."""
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        kind = set if isinstance(obj, frozenset) else type(obj)
        return kind(_plain(x) for x in obj)  # type: ignore[call-arg]
    return obj


def _revive(value: Any, like: Any) -> Any:
    """A plain `value` (from `_plain`) as the type of `like`, the live environment's value.

    An enum's value becomes that enum's member, a number a numpy scalar, a set a frozenset,
    element by element in tuples and lists. Anything else stays as it is.
    """
    if isinstance(like, enum.Enum) and not isinstance(value, enum.Enum):
        try:
            return type(like)(value)
        except ValueError:  # no such member (another version): said by the caller
            return value
    if isinstance(like, np.generic) and not isinstance(value, np.generic):
        return type(like)(value)
    sequences = isinstance(like, list | tuple) and isinstance(value, list | tuple)
    if sequences and len(like) == len(value):
        return type(value)(_revive(v, w) for v, w in zip(value, like, strict=True))
    if isinstance(like, set | frozenset) and isinstance(value, set | frozenset):
        members = {type(x) for x in like}
        if len(members) == 1 and issubclass(cls := members.pop(), enum.Enum):
            value = {cls(v) if _is_member(cls, v) else v for v in value}
        return type(like)(value)
    return value


def _is_member(cls: type[enum.Enum], value: Any) -> bool:
    try:
        cls(value)
    except ValueError:
        return False
    return True


def _compact(t: torch.Tensor) -> Any:
    """A per-world array, with the columns equal (bit for bit) in every world kept once.

    Domain randomisation gives every world its own copy of a model field but varies few of
    its entries (a friction of the feet among every geom's), and buffers hold per-world copies
    of constants. Returns `t` itself when that saves little, else a dict of plain tensors:
    `shape`, `shared` (the first world's row), `varying` (which entries differ somewhere)
    and `values` (those entries, world by world).
    """
    bits = _SAME_SIZE_INT.get(t.element_size())
    if bits is None or t.dim() < 2 or t.shape[0] < 2 or t.nbytes < _COMPACT_BYTES:
        return t
    flat = t.reshape(t.shape[0], -1)
    as_int = flat.view(bits)  # compared bit for bit: -0.0 is not 0.0, NaN is itself
    varying = (as_int != as_int[:1]).any(dim=0)
    if int(varying.sum()) * 2 > varying.numel():
        return t
    return {
        "shape": list(t.shape),
        "shared": flat[0].clone(),
        "varying": varying,
        "values": flat[:, varying].clone(),
    }


# Integer types of each element size: what a compacted array is put back through (torch
# indexes no unsigned integer but uint8).
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _expanded(value: Any) -> torch.Tensor:
    """The array a `_compact` value stands for (`value` itself when it is a tensor)."""
    if isinstance(value, torch.Tensor):
        return value
    shape, shared, values = value["shape"], value["shared"], value["values"]
    flat = shared.expand(shape[0], -1).clone()
    bits = _SAME_SIZE_INT[shared.element_size()]
    flat.view(bits)[:, value["varying"]] = values.view(bits)
    return flat.reshape(shape)


def _same(a: object, b: object) -> bool:
    """Equal, bit for bit (NaN equals NaN), recursively through tuples, lists and dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same(torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b)))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    return type(a) is type(b) and bool(a == b)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().reshape(-1)
    return torch.empty(flat.shape, dtype=flat.dtype).copy_(flat).view(torch.uint8)


def _set(parent: object, key: Any, attr: bool, value: Any) -> None:
    if attr:
        setattr(parent, key, value)
    else:
        parent[key] = value  # type: ignore[index]


def _put_rng(obj: object, state: tuple[str, Any]) -> None:
    kind, value = state
    if kind == "torch":
        obj.set_state(value)  # type: ignore[attr-defined]
    elif kind == "numpy":
        obj.bit_generator.state = value  # type: ignore[attr-defined]
    else:
        obj.setstate(value)  # type: ignore[attr-defined]


def restore(
    root: object, state: dict[str, Any], rules: Rules, device: str, name: str = "env"
) -> list[str]:
    """Put `state` (from `capture`) back into `root`, in place.

    What `rules` leave out is not put back, also where `state` has it (saved under rules that
    kept more). Returns what could not be put back, one line each (empty: everything was).
    """
    derived = list(rules.derived(root))
    graph = _walk(root, name, rules, derived)
    memory = _Memory(_arrays_in(derived))
    problems: list[str] = []
    placed: dict[int, Any] = {}  # saved copy -> the object now holding it (aliases stay one)
    arrays: dict[int, torch.Tensor] = {}  # saved copy -> it expanded (`_compact`), once
    with torch.inference_mode():
        for path, (parent_path, key, attr, kind, value) in state.items():
            if graph.leaves_out(path):
                continue  # recomputed (a state saved under other rules has it)
            here = graph.leaves.get(path)
            target = here.value if here is not None else None
            if kind in ("torch", "warp", "numpy"):
                if id(value) not in arrays:
                    arrays[id(value)] = _expanded(value)
                value = arrays[id(value)]
            if kind in ("torch", "warp", "numpy") and _is_array(target):
                view = _as_torch(target)
                if view is not None and view.numel() and memory.holds(view):
                    continue  # recomputed, as above
                if view is None or view.shape != value.shape or view.dtype != value.dtype:
                    got = "nothing" if view is None else f"{tuple(view.shape)} {view.dtype}"
                    problems.append(f"{path}: saved {tuple(value.shape)} {value.dtype}, here {got}")
                    continue
                view.copy_(value.to(view.device))
                placed.setdefault(id(value), target)
                continue
            if kind == "rng" and _is_rng(target):
                _put_rng(target, value)
                continue
            parent = graph.objects.get(parent_path)
            if parent is None:
                problems.append(f"{path}: {parent_path} does not exist here")
                continue
            if kind == "value":
                value = _revive(value, target)
                if isinstance(target, enum.Enum) and not isinstance(value, enum.Enum):
                    problems.append(f"{path}: {value!r} is no {type(target).__name__} here")
                    continue
                if (here is not None and _same(target, value)) or isinstance(value, str | bytes):
                    continue  # names, paths and devices are the fresh environment's own
                if isinstance(target, list) and isinstance(value, list):
                    target[:] = value
                    continue
                new: Any = value
            elif kind == "torch":
                new = placed.get(id(value))
                if new is None:
                    new = placed[id(value)] = value.to(device, copy=True)
            else:
                problems.append(f"{path}: a {kind} object here is {type(target).__name__}")
                continue
            try:
                _set(parent, key, attr, new)
            except (TypeError, AttributeError) as exc:
                problems.append(f"{path}: cannot be set ({exc})")
    return problems


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 10) -> list[str]:
    """List the first `limit` paths whose saved values differ between two captures.

    A path that exists in one capture only differs too.
    """
    out = []
    for path in sorted(set(a) | set(b)):
        if path not in a or path not in b:
            out.append(f"{path}: only in the {'first' if path in a else 'second'}")
        elif a[path][3] != b[path][3] or not _same(_value(a[path]), _value(b[path])):
            out.append(f"{path}: differs")
        if len(out) >= limit:
            break
    return out


def _value(entry: tuple[Any, ...]) -> Any:
    """A captured entry's value, a compacted array expanded."""
    kind, value = entry[3], entry[4]
    return _expanded(value) if kind in ("torch", "warp", "numpy") else value

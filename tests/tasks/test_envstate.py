"""An environment's captured state is plain data, and restoring it gives back the live types.

What `envstate.capture` returns goes through torch.save and a plain weights-only load (no
allow-list), then `restore` puts it into a freshly made object: enums, numpy scalars and
frozensets come back as the fresh object's own types, per-world arrays whose columns are
mostly shared (kept once) come back bit for bit, -0.0 and NaN included.
"""

from __future__ import annotations

import enum
import io

import numpy as np
import torch

from mjlab_hpc.tasks import envstate


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Settings:
    class Origin(enum.Enum):  # nested, as mjlab's ViewerConfig.OriginType
        WORLD = 0
        ASSET = 4


class Toy:
    """An environment's kinds of state: settings, counters, per-world arrays, a generator."""

    def __init__(self, worlds: int = 64) -> None:
        self.mode = Mode.FAST
        self.origin = Settings.Origin.WORLD
        self.levels = frozenset({Level.LOW})
        self.by_level = {Level.LOW: 0.5, Level.HIGH: 1.5}
        self.count = np.int64(0)
        self.scale = np.float32(1.0)
        self.friction = torch.ones(worlds, 600, 3)  # one entry per world varies, as DR does
        self.ids = torch.zeros(worlds, 256, dtype=torch.int32).view(torch.uint32)
        self.rng = np.random.default_rng(0)


def _changed(toy: Toy) -> Toy:
    toy.mode, toy.origin = Mode.SLOW, Settings.Origin.ASSET
    toy.levels = frozenset({Level.LOW, Level.HIGH})
    toy.by_level[Level.HIGH] = 2.5
    toy.count, toy.scale = np.int64(7), np.float32(0.25)
    toy.friction[:, 10, 0] = torch.linspace(0.5, 1.5, toy.friction.shape[0])
    toy.friction[3, 20, 1] = -0.0
    toy.friction[5, 20, 2] = float("nan")
    toy.ids[:, 7] = torch.arange(toy.ids.shape[0], dtype=torch.int32).view(torch.uint32)
    toy.rng.random(5)
    return toy


def test_a_captured_state_is_plain_data_and_restores_the_live_types() -> None:
    rules = envstate.Rules()
    original = _changed(Toy())
    saved = envstate.capture(original, rules)
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(buf) == []
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # plain: no allow-list
    assert loaded["env.mode"][4] == "slow" and loaded["env.origin"][4] == 4
    friction = loaded["env.friction"][4]
    assert isinstance(friction, dict) and friction["values"].shape == (64, 3)  # kept once
    assert len(buf.getvalue()) < Toy().friction.nbytes / 4

    fresh = Toy()
    assert envstate.restore(fresh, loaded, rules, "cpu") == []
    assert fresh.mode is Mode.SLOW and fresh.origin is Settings.Origin.ASSET
    assert fresh.levels == frozenset({Level.LOW, Level.HIGH})
    assert all(type(x) is Level for x in fresh.levels) and type(fresh.levels) is frozenset
    assert fresh.by_level == {Level.LOW: 0.5, Level.HIGH: 2.5}
    assert type(fresh.count) is np.int64 and fresh.count == 7
    assert type(fresh.scale) is np.float32 and fresh.scale == np.float32(0.25)
    for name in ("friction", "ids"):
        assert torch.equal(
            getattr(fresh, name).view(torch.uint8), getattr(original, name).view(torch.uint8)
        ), name
    assert envstate.differences(saved, envstate.capture(fresh, rules)) == []
    assert fresh.rng.random() == original.rng.random()


def test_a_value_the_live_enum_lacks_is_said_not_set() -> None:
    saved = envstate.capture(Toy(), envstate.Rules())
    parent, key, attr, kind, _ = saved["env.mode"]
    saved["env.mode"] = (parent, key, attr, kind, "turbo")
    fresh = Toy()
    assert envstate.restore(fresh, saved, envstate.Rules(), "cpu") == [
        "env.mode: 'turbo' is no Mode here"
    ]
    assert fresh.mode is Mode.FAST


def test_what_the_rules_now_recompute_is_not_put_back_from_an_older_state() -> None:
    """A state saved under rules that kept more (an older mjlab_hpc's): what the current
    rules leave out (a derived object, a field only_fields omits, an array in derived
    memory) is neither put back nor said; the rest is restored."""
    toy = _changed(Toy())
    toy.cache = Toy()  # an object the rules below call derived
    saved = envstate.capture(toy, envstate.Rules())
    assert "env.cache.mode" in saved and "env.friction" in saved and "env.scale" in saved
    rules = envstate.Rules(
        only_fields=lambda obj: [n for n in vars(obj) if n != "scale"] if obj is fresh else None,
        derived=lambda root: [root.cache, root.ids],
    )
    fresh = Toy()
    fresh.cache = Toy()
    fresh.ids[:, 0] = 5
    assert envstate.restore(fresh, saved, rules, "cpu") == []
    assert fresh.mode is Mode.SLOW  # the rest restored, NaN and -0.0 too:
    assert torch.equal(fresh.friction.view(torch.uint8), toy.friction.view(torch.uint8))
    assert fresh.cache.mode is Mode.FAST and fresh.scale == np.float32(1.0)  # left out
    assert int(fresh.ids[0, 0]) == 5  # derived memory: not overwritten

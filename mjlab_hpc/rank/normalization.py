"""Observation normalizers whose statistics are the same on every rank.

rsl-rl 5.4.2 (the version mjlab 1.6 pins) updates each rank's EmpiricalNormalization from that
rank's observations only, so the ranks' normalizers, and with them their policies, drift
apart even though gradients are averaged. `sync_normalizers` swaps in a normalizer that
all-reduces each batch's moments first: every rank then applies the same update and the
models stay bit-identical. How often the ranks agree is `NormalizerSync`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from rsl_rl.modules import EmpiricalNormalization
from torch import nn

__all__ = [
    "NormalizerSync",
    "SyncedEmpiricalNormalization",
    "agree_normalizers",
    "sync_normalizers",
]


# "step": the ranks agree at every env step, on exactly the statistics one process would learn
# from all ranks' environments. "iteration" (the default): during the rollout each rank adds
# its own observations to the statistics agreed at the start of the iteration; before the
# returns and the update, every rank's whole rollout is merged into those agreed statistics
# (the same result as "step", up to rounding). Gradient steps see every rank's data either
# way, the ranks are bit-identical at every iteration boundary, and a rollout costs one
# collective instead of one per env step (brax updates its running statistics once per
# training step in the same way).
NormalizerSync = Literal["iteration", "step"]


class SyncedEmpiricalNormalization(EmpiricalNormalization):
    """EmpiricalNormalization updated with the moments of the batch of all ranks together."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.every: NormalizerSync = "step"
        # "iteration": the agreed statistics (count, mean, var) and this rank's batch sums
        # since then.
        self._agreed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pending: torch.Tensor | None = None

    @torch.jit.unused
    def update(self, x: torch.Tensor) -> None:
        """Learn from the union of every rank's batch `x` (same result on every rank)."""
        if not self.training:
            return
        if self.every == "iteration":
            self._accumulate(x)
            return
        if self.until is not None and self.count >= self.until:
            return
        # One sum over ranks of [n, sum, sum of squares] gives the global batch's moments.
        packed = _moments(x)
        dist.all_reduce(packed)
        self._merge(packed)

    def _accumulate(self, x: torch.Tensor) -> None:
        agreed = self._agreed
        if agreed is None:
            # Decided from agreed numbers only, so every rank accumulates the same normalizers.
            if self.until is not None and self.count >= self.until:
                return
            agreed = (self.count.clone(), self._mean.clone(), self._var.clone())
            self._agreed = agreed
        packed = _moments(x)
        self._pending = packed if self._pending is None else self._pending + packed
        # This rank's rollout goes on with its own observations added, as one process would.
        super().update(x)

    def agree(self, reduced: torch.Tensor) -> None:
        """Go back to the agreed statistics, then add every rank's rollout (`reduced`).

        `reduced` is the sum over ranks of their rollout's batch moments (`agree_normalizers`).
        """
        assert self._agreed is not None
        count, mean, var = self._agreed
        self.count.copy_(count)
        self._mean.copy_(mean)
        self._var.copy_(var)
        self._agreed = self._pending = None
        self._merge(reduced)

    def _merge(self, packed: torch.Tensor) -> None:
        """Add the batch whose [n, sum, sum of squares] over all ranks is `packed`."""
        d = (packed.numel() - 1) // 2
        total = packed[0]
        mean_x = (packed[1 : 1 + d] / total).reshape(self._mean.shape)
        var_x = (packed[1 + d :] / total).reshape(self._mean.shape) - mean_x.square()
        mean_x = mean_x.to(self._mean.dtype)
        var_x = var_x.clamp_min(0.0).to(self._var.dtype)

        self.count += int(total.item())
        rate = float(total.item()) / float(self.count.item())
        delta_mean = mean_x - self._mean
        self._mean += rate * delta_mean
        self._var += rate * (var_x - self._var + delta_mean * (mean_x - self._mean))
        self._std = torch.sqrt(self._var)


def _moments(x: torch.Tensor) -> torch.Tensor:
    """[n, sum, sum of squares] of a batch, in float64."""
    flat = x.reshape(x.shape[0], -1).to(torch.float64)
    n = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=x.device)
    return torch.cat([n, flat.sum(dim=0), flat.square().sum(dim=0)])


def sync_normalizers(*models: nn.Module, every: NormalizerSync = "step") -> int:
    """Replace every EmpiricalNormalization inside `models` by the synced kind; how many.

    Each keeps its statistics. With every="iteration", call `agree_normalizers` after each
    rollout.
    """
    replaced = 0
    for model in models:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is EmpiricalNormalization:
                    synced = SyncedEmpiricalNormalization(
                        tuple(child._mean.shape[1:]), eps=child.eps, until=child.until
                    ).to(child._mean.device)
                    synced.load_state_dict(child.state_dict())
                    synced.train(child.training)
                    synced.every = every
                    setattr(parent, name, synced)
                    replaced += 1
    return replaced


def agree_normalizers(*models: nn.Module) -> int:
    """Merge every rank's rollout into the per-iteration normalizers inside `models`; how many.

    The rollout is what each rank has seen since the last call. One collective serves all the
    normalizers, and every rank gets the same result; call it at the same point on every
    rank.
    """
    pending = [
        m
        for model in models
        for m in model.modules()
        if isinstance(m, SyncedEmpiricalNormalization) and m._pending is not None
    ]
    if not pending:
        return 0
    sizes = [m._pending.numel() for m in pending]  # type: ignore[union-attr]
    reduced = torch.cat([m._pending for m in pending])  # type: ignore[misc]
    dist.all_reduce(reduced)
    for m, part in zip(pending, torch.split(reduced, sizes), strict=True):
        m.agree(part)
    return len(pending)

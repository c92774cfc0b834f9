"""Observation normalizers whose statistics are the same on every rank.

rsl-rl 5.4.2 (the version mjlab 1.6 pins) updates each rank's EmpiricalNormalization from that
rank's observations only, so the ranks' normalizers, and with them their policies, drift
apart even though gradients are averaged. `sync_normalizers` swaps in a normalizer that
all-reduces each batch's moments first: every rank then applies the same update and the
models stay bit-identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rsl_rl.modules import EmpiricalNormalization
from torch import nn


class SyncedEmpiricalNormalization(EmpiricalNormalization):
    """EmpiricalNormalization updated with the moments of the batch of all ranks together."""

    @torch.jit.unused
    def update(self, x: torch.Tensor) -> None:
        """Learn from the union of every rank's batch `x` (same result on every rank)."""
        if not self.training:
            return
        if self.until is not None and self.count >= self.until:
            return
        # One all-reduce of [n, sum, sum of squares] gives the global batch's moments.
        flat = x.reshape(x.shape[0], -1).to(torch.float64)
        n = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=x.device)
        packed = torch.cat([n, flat.sum(dim=0), flat.square().sum(dim=0)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        d = flat.shape[1]
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


def sync_normalizers(*models: nn.Module) -> int:
    """Replace every EmpiricalNormalization inside `models` by the synced kind, keeping its
    statistics. Returns how many were replaced."""
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
                    setattr(parent, name, synced)
                    replaced += 1
    return replaced

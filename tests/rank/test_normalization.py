"""Synced observation normalizers on two real processes (gloo).

Per-step and per-iteration agreement give the statistics one process learns from every rank's
observations: the same bits on every rank, with one collective per step or one per rollout.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import run_two_ranks

from mjlab_hpc.rank.normalization import agree_normalizers, sync_normalizers
from mjlab_hpc.rank.runner import CollectiveClock

STEPS, ENVS, DIM = 12, 64, 5


def _batches(rank: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    # Ranks see different distributions, as different worlds do.
    return [torch.randn(ENVS, DIM, generator=g) * (1 + rank) + 3 * rank for _ in range(STEPS)]


def _stats(norm: Any) -> dict[str, Any]:
    # Plain lists: tensors would cross the queue as shared memory that ends with the worker.
    return {
        "count": int(norm.count),
        "mean": norm._mean.tolist(),
        "var": norm._var.tolist(),
        "std": norm._std.tolist(),
    }


def _agreements(rank: int) -> dict[str, Any]:
    import torch
    from rsl_rl.modules import EmpiricalNormalization
    from torch import nn

    result: dict[str, Any] = {}
    for every in ("step", "iteration"):
        model = nn.Sequential(EmpiricalNormalization(DIM))
        assert sync_normalizers(model, every=every) == 1
        norm = model[0]
        clock = CollectiveClock()
        with clock.timing(), torch.inference_mode():
            for x in _batches(rank):
                norm.update(x)
            result[f"{every}_rollout"] = _stats(norm)
            result[f"{every}_merged"] = agree_normalizers(model)
        result[every] = _stats(norm)
        result[f"{every}_collectives"] = clock.calls
    return result


@pytest.mark.timeout(120)
def test_step_and_iteration_agreement_match_one_process() -> None:
    import torch
    from rsl_rl.modules import EmpiricalNormalization

    got = run_two_ranks(_agreements)

    # One process stepping both ranks' environments at once.
    one = EmpiricalNormalization(DIM).double()
    for a, b in zip(_batches(0), _batches(1), strict=True):
        one.update(torch.cat([a, b]).double())
    for every in ("step", "iteration"):
        r0, r1 = got[0][every], got[1][every]
        for key in ("mean", "var", "std"):
            assert r0[key] == r1[key], (every, key)  # the same bits on every rank
            torch.testing.assert_close(
                torch.tensor(r0[key], dtype=torch.float64),
                getattr(one, f"_{key}"),
                rtol=1e-5,
                atol=1e-5,
            )
        assert r0["count"] == r1["count"] == 2 * STEPS * ENVS
    assert (got[0]["step_collectives"], got[0]["step_merged"]) == (STEPS, 0)
    assert (got[0]["iteration_collectives"], got[0]["iteration_merged"]) == (1, 1)
    # During the rollout each rank had added only its own observations.
    assert got[0]["iteration_rollout"]["count"] == STEPS * ENVS
    assert got[0]["iteration_rollout"]["mean"] != got[1]["iteration_rollout"]["mean"]


def test_agree_without_a_rollout_is_a_no_op() -> None:
    from rsl_rl.modules import EmpiricalNormalization
    from torch import nn

    model = nn.Sequential(EmpiricalNormalization(DIM))
    sync_normalizers(model, every="iteration")
    assert agree_normalizers(model) == 0
    assert int(model[0].count) == 0

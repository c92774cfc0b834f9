"""Kept for configs written before the package was reorganised: rsl-rl agent configs (and
`params/agent.yaml` of existing runs) name the algorithm `mjlab_hpc.ppo:FoldedPPO`, which
rsl-rl resolves by module path. The class lives in `mjlab_hpc.rank.ppo`."""

from mjlab_hpc.rank.ppo import FoldedPPO

__all__ = ["FoldedPPO"]

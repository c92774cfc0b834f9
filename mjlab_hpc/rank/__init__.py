"""What runs inside one rank: where it stands in the job (`context`), the job callable
(`job`) and the training entry point (`entry`), its workload (`workload`: environments and
runner), the runner (`runner`), what the ranks exchange (`ppo`, `normalization`; how they
reduce: `mjlab_hpc.collective`), resume (`resume`), the iteration boundary (`boundary`),
stops (`stop`) and the hang watchdog (`watchdog`).

Only `context` and `job` are light; the others import torch, warp and rsl-rl.
"""

from mjlab_hpc.rank.context import DistContext, detect_mode
from mjlab_hpc.rank.job import RankJob

__all__ = ["DistContext", "RankJob", "detect_mode"]

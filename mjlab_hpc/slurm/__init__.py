"""Everything that speaks to Slurm: one client for its commands, its hostlist syntax, and its
notations for time and memory."""

from mjlab_hpc.slurm.client import DEFAULT_TIMEOUT_S, FINAL_STATES, SlurmClient, SlurmRow
from mjlab_hpc.slurm.hostlist import HostlistError, expand_hostlist, first_host
from mjlab_hpc.slurm.units import check_mem, slurm_time_minutes

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FINAL_STATES",
    "HostlistError",
    "SlurmClient",
    "SlurmRow",
    "check_mem",
    "expand_hostlist",
    "first_host",
    "slurm_time_minutes",
]

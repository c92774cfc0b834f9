"""Shared test set-up."""

# Session fixture `slurm_cluster`: the real two-node Slurm test cluster (tests/slurm/cluster.sh).
from slurm_cluster import slurm_cluster  # noqa: F401

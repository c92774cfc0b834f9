"""Everything that speaks to Slurm.

`client` runs its commands; `units` reads its notations for time and memory.
"""

"""Everything that speaks to Slurm: one client for its commands (`client`) and its notations
for time and memory (`units`)."""

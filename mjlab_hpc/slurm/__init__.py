"""Everything that speaks to Slurm: one client for its commands (`client`), its hostlist syntax
(`hostlist`), and its notations for time and memory (`units`)."""

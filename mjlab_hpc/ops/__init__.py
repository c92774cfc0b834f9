"""Operations on submitted runs, one module per `mjlab-hpc` subcommand.

`status`, `logs`, `cancel`, `plot` and `doctor` (with Slurm's own limits in `limits`) sit on
top of `runs`, which finds runs and their jobs.
"""

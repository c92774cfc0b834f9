"""Starting jobs and keeping them going.

`submit` turns a SubmitSpec into a Slurm job, a job array, a local job or ranks inside an
allocation. `slurm` holds the Slurm job script in every form (submitit's, the plain-sbatch
templates, srun inside an allocation); `executors` our submitit executors (every use of
submitit beyond its public API); `local` the local executor's foreground runs. `heal` decides
whether a failed start starts again and where, `heal_slurm` acts on that in a Slurm job, and
`follow` follows a run in the foreground. What every entry point checks first is in
`mjlab_hpc.validate`.
"""

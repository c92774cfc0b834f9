"""Starting jobs: the submitter (`submit`: a SubmitSpec becomes a Slurm job, a job array or a
local job, or ranks inside an allocation), the Slurm job script (`slurm`: submitit's, the
plain-sbatch templates, srun inside an allocation), our submitit executors (`executors`: every use
of submitit beyond its public API), the local executor's foreground runs (`local`), self-healing
(`heal`) and following a run (`follow`). What every entry point checks first is in
`mjlab_hpc.validate`."""

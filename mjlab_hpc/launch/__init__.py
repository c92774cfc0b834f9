"""Starting jobs: on this machine (`local`: submitit's local executor), on Slurm (`slurm`:
submitit's SlurmExecutor), their dispatch (`submit`), sweeps (`sweep`), sbatch templates
(`templates`, shipped in `templates/`), and the checks every entry point runs first
(`validate`)."""

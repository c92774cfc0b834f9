"""Starting jobs: on this machine (`local`: submitit's local executor), on Slurm (`slurm`:
submitit's SlurmExecutor), their dispatch (`submit`), sweeps (`sweep`), sbatch templates
(`templates`, shipped in `templates/`), and the checks every entry point runs first
(`validate`)."""

# Jobs submitted by mjlab_hpc 0.1.0 pickled `mjlab_hpc.launch.RankJob` into
# <run>/submitit/<job>_submitted.pkl; a requeue of such a job unpickles it through this name.
from mjlab_hpc.rank.job import RankJob

__all__ = ["RankJob"]

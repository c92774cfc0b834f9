"""mjlab_hpc: multi-node, preemption-safe RL training of MuJoCo Warp robots on SLURM."""

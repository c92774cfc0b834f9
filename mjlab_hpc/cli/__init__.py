"""Command-line entry points: mjlab-train, mjlab-submit, mjlab-hpc."""

"""The benchmark's flags (`make bench`, `python -m benchmarks`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchConfig"]


@dataclass(frozen=True)
class BenchConfig:
    """Benchmark this machine and write <out>/bench.json and <out>/bench.png.

    The figures are scaling, collectives, rollout overhead, launch and recovery of CPU ranks,
    and GPU figures where CUDA is available.
    """

    quick: bool = False
    """Short smoke run (small envs, one pair, a partly cold cache): checks the machinery only."""
    out: Path = Path("bench-results")
    """Folder for bench.json, bench.png and runs/ (the runs' directories, replaced)."""
    repeats: int | None = None
    """Repeats of the training runs, one A/B pair each (default: 5; 1 with --quick).

    A 3% target needs more than 3 on a shared machine; the rollout benchmark takes at least 7
    pairs (they are cheap).
    """
    num_envs: int | None = None
    """Envs per rank, and worlds of the rollout benchmark (default: 1024; 64 with --quick)."""
    iterations: int | None = None
    """Measured PPO iterations per run after one warm-up iteration (default: 20; 1 with
    --quick)."""
    task: str = "cartpole"
    """Task of the training runs (scaling, collectives, launch, recovery, compilations)."""
    rollout_tasks: tuple[str, ...] = ("cartpole", "ant")
    """Tasks of the rollout-overhead benchmark."""
    cold_compile: bool = True
    """Measure kernel compilations on a cold cache (a partly cold one with --quick)."""
    mjlab_task: str = "Mjlab-Cartpole-Balance"
    """mjlab task of the comparison with mjlab's own `train` (needs the [mjlab] extra)."""
    mjlab_envs: int | None = None
    """Envs of the mjlab comparison (default: 256; 16 with --quick)."""
    mjlab_repeats: int | None = None
    """Repeats of the mjlab comparison (default: 5; 1 with --quick).

    Separate processes of the same program differ on a shared machine, so it takes more than
    3.
    """
    gpu: bool = True
    """Measure the GPU figures where CUDA is available (without a GPU they are skipped, and
    bench.json and the output say why)."""
    gpu_task: str = "Mjlab-Velocity-Flat-Unitree-G1"
    """mjlab task of the GPU comparison with mjlab's own `train`."""
    gpu_envs: int | None = None
    """Envs of the GPU comparison and worlds of the GPU rollout benchmark (default: 4096;
    256 with --quick)."""
    gpu_repeats: int | None = None
    """Repeats of the GPU comparison (default: 3; 1 with --quick)."""
    healing: bool = True
    """Measure self-healing: a 2-rank local job with a crash and one with a hang."""
    target: bool = True
    """Measure the time to a target reward of every task in `target_tasks`, 1 rank against 2.

    With --quick, cartpole to a low target.
    """
    target_tasks: tuple[str, ...] = ("cartpole", "ant", "Mjlab-Cartpole-Balance")
    """Tasks of the time-to-target section (benchmarks/target.py has their targets)."""
    target_seeds: int | None = None
    """Seeds per task and configuration of the time-to-target section (default: 3; 1 with
    --quick)."""
    run_timeout_s: float = 300.0
    """Give up on one subprocess after this long (GPU runs: twice this, for CUDA kernels
    compiled on a cold cache)."""

    @property
    def pairs(self) -> int:
        return self.repeats or (1 if self.quick else 5)

    @property
    def envs(self) -> int:
        return self.num_envs or (64 if self.quick else 1024)

    @property
    def measured(self) -> int:
        return self.iterations or (1 if self.quick else 20)

    @property
    def mjlab_pairs(self) -> int:
        return self.mjlab_repeats or (1 if self.quick else 5)

    @property
    def mjlab_num_envs(self) -> int:
        return self.mjlab_envs or (16 if self.quick else 256)

    @property
    def gpu_num_envs(self) -> int:
        return self.gpu_envs or (256 if self.quick else 4096)

    @property
    def gpu_pairs(self) -> int:
        return self.gpu_repeats or (1 if self.quick else 3)

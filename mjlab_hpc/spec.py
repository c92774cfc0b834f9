"""The training spec: everything a rank needs to run one training job, as one frozen dataclass.

The same spec flows one way: CLI -> (submitter) -> every rank. It is pickled to ranks by the
launchers and dumped as YAML into the run directory, so it holds only plain values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from mjlab_hpc.errors import SpecError

DeviceChoice = Literal["auto", "cpu", "cuda"]
GpuIds = tuple[int, ...] | Literal["all", "auto"] | None
# Signals Slurm can send ahead of the time limit that no library we load relies on.
_SIGNALS = ("USR2", "USR1", "INT", "HUP", "TERM", "URG")


@dataclass(frozen=True)
class TrainSpec:
    """What to train and where to write it (the flags of `mjlab-train`)."""

    task: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TASK")] = "cartpole"
    """Task name: a built-in task (`mjlab-hpc list-tasks`) or a registered mjlab task."""
    num_envs: int | None = None
    """Parallel environments per rank (None: the task's default)."""
    max_iterations: int | None = None
    """PPO iterations in total (None: the task's default)."""
    seed: int = 42
    """Base seed; rank k uses seed + k."""
    log_root: str = "logs"
    """Root folder of all experiments."""
    experiment_name: str | None = None
    """Experiment folder under log-root (None: the task's name)."""
    run_name: str = ""
    """Suffix of the run directory name."""
    run_dir: str | None = None
    """Use this run directory instead of making a new one (launchers set it)."""
    save_interval: int = 50
    """Save a checkpoint every N iterations (and always at the end)."""
    device: DeviceChoice = "auto"
    """auto: CUDA when available, else CPU."""
    gpu_ids: GpuIds = "auto"
    """GPUs to train on, relative to CUDA_VISIBLE_DEVICES: `0 1`, `all`, or `None` (CPU).
    `auto` follows --device. Several ids start one rank per GPU."""
    num_procs: int = 1
    """Start N CPU ranks on this machine (gloo)."""
    torch_threads: int = 0
    """Torch threads per rank (0: SLURM_CPUS_PER_TASK, else the machine's cores / local ranks)."""
    dist_timeout_s: float = 300.0
    """Timeout of collective operations: a dead rank ends the job after at most this long."""
    use_graph: bool = True
    """Replay physics through a captured Warp graph (faster; bit-identical to plain stepping)."""
    normalizer_sync: Literal["iteration", "step"] = "iteration"
    """How often the ranks' observation normalizers agree (several ranks only): once per
    iteration, merging every rank's rollout before the update (one collective), or at every
    env step (exactly one process's statistics over all ranks; one collective per step)."""
    resume: bool = False
    """Continue the latest run of this experiment (or --run-dir) from its newest valid
    checkpoint. A run directory that already holds checkpoints is always continued."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    preempt_signal: str = "USR2"
    """Signal that announces the time limit (Slurm's --signal); SIGTERM means preemption."""
    max_restarts: int = 10
    """Requeue at most this many times; then stop with the checkpoint saved."""
    overrides: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """mjlab tasks: `--env.*` / `--agent.*` arguments, as mjlab's own train takes them."""

    def validate(self) -> None:
        """Raise SpecError naming the flag for values no launcher could run."""
        if self.num_envs is not None and self.num_envs < 1:
            raise SpecError("--num-envs", f"must be >= 1, got {self.num_envs}")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise SpecError("--max-iterations", f"must be >= 1, got {self.max_iterations}")
        if self.save_interval < 1:
            raise SpecError("--save-interval", f"must be >= 1, got {self.save_interval}")
        if self.num_procs < 1:
            raise SpecError("--num-procs", f"must be >= 1, got {self.num_procs}")
        if self.torch_threads < 0:
            raise SpecError("--torch-threads", f"must be >= 0, got {self.torch_threads}")
        if self.dist_timeout_s <= 0:
            raise SpecError("--dist-timeout-s", f"must be > 0, got {self.dist_timeout_s}")
        if isinstance(self.gpu_ids, tuple) and any(i < 0 for i in self.gpu_ids):
            raise SpecError("--gpu-ids", f"ids must be >= 0, got {list(self.gpu_ids)}")
        if isinstance(self.gpu_ids, tuple) and len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise SpecError("--gpu-ids", f"ids must be distinct, got {list(self.gpu_ids)}")
        if self.num_procs > 1 and self.gpu_ids not in ("auto", None):
            raise SpecError(
                "--num-procs",
                "starts CPU ranks; it cannot be combined with --gpu-ids "
                "(use --gpu-ids 0 1 ... for one rank per GPU)",
            )
        if self.keep_checkpoints < 0:
            raise SpecError("--keep-checkpoints", f"must be >= 0, got {self.keep_checkpoints}")
        if self.max_restarts < 0:
            raise SpecError("--max-restarts", f"must be >= 0, got {self.max_restarts}")
        name = self.preempt_signal.upper().removeprefix("SIG")
        if name not in _SIGNALS:
            raise SpecError(
                "--preempt-signal", f"{self.preempt_signal!r}: use one of {', '.join(_SIGNALS)}"
            )
        if "/" in self.run_name or self.run_name in (".", ".."):
            raise SpecError(
                "--run-name", f"must be a plain name without '/', got {self.run_name!r}"
            )

    def replace(self, **changes: object) -> TrainSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """Plain-value dict (for YAML and JSON)."""
        out = dataclasses.asdict(self)
        if isinstance(self.gpu_ids, tuple):
            out["gpu_ids"] = list(self.gpu_ids)
        out["overrides"] = list(self.overrides)
        return out


def split_overrides(unknown: list[str]) -> tuple[str, ...]:
    """The `--env.*`/`--agent.*` arguments (with their values) among arguments the CLI did not
    know; SpecError naming the first argument that is neither."""
    if unknown and not unknown[0].startswith(("--env.", "--agent.")):
        raise SpecError(unknown[0], "unknown argument (see --help)")
    return tuple(unknown)

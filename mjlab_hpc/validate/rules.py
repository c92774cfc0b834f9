"""Each flag's own rules: its bounds, its choices, and the flags it cannot go with.

`check_train` and `check_submit` hold them; `resolve` checks a training spec and resolves its
task. What a value may hold where it is written is `places`' concern; --sbatch-arg is
`sbatch_args`'.
"""

from __future__ import annotations

import math
import re

from mjlab_hpc.errors import SpecError
from mjlab_hpc.slurm.units import check_mem, slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks import registry
from mjlab_hpc.validate.places import (
    job_name,
    no_control,
    path_component,
    run_name,
    shell_line,
    slurm_name,
)
from mjlab_hpc.validate.sbatch_args import sbatch_options

__all__ = [
    "MAX_ENVS_PER_RANK",
    "check_submit",
    "check_train",
    "positive_seconds",
    "resolve",
]

#: More environments than this on one rank is a typo (Warp indexes worlds with 32 bits).
MAX_ENVS_PER_RANK = 2**24
#: The longest duration a flag may give: 30 days, in seconds.
_MAX_S = 30 * 86400
_NOT_FINITE = frozenset({"nan", "inf", "infinity"})
# Signals Slurm can send ahead of the time limit that no library we load relies on, and
# that mean nothing else to a rank (INT, HUP and TERM are stops by a user or a scheduler).
_SIGNALS = ("USR2", "USR1", "URG")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def positive_seconds(flag: str, value: float, minimum: float = 0.0) -> float:
    """Check a finite duration of at least `minimum` seconds (nan and inf are refused)."""
    if not math.isfinite(value) or value < minimum:
        raise SpecError(flag, f"must be a number of seconds >= {minimum:g}, got {value}")
    return value


def _within(flag: str, value: int | None, low: int, high: int) -> None:
    if value is not None and value < low:
        raise SpecError(flag, f"must be >= {low}, got {value}")
    if value is not None and value > high:
        raise SpecError(flag, f"must be at most {high}, got {value}")


def check_train(spec: TrainSpec) -> TrainSpec:
    """Return the training spec, or raise SpecError naming the flag no launcher could run."""
    # Upper bounds: far above any real run, below what torch, Warp and the OS overflow on.
    for flag, value, low, high in (
        ("--num-envs", spec.num_envs, 1, MAX_ENVS_PER_RANK),
        ("--max-iterations", spec.max_iterations, 1, 10**9),
        ("--save-interval", spec.save_interval, 1, 10**9),
        ("--num-procs", spec.num_procs, 1, 4096),
        ("--torch-threads", spec.torch_threads, 0, 4096),
        ("--seed", spec.seed, -(2**62), 2**62),
    ):
        _within(flag, value, low, high)
    _check_durations(spec)
    if isinstance(spec.gpu_ids, tuple) and any(i < 0 for i in spec.gpu_ids):
        raise SpecError("--gpu-ids", f"ids must be >= 0, got {list(spec.gpu_ids)}")
    if isinstance(spec.gpu_ids, tuple) and len(set(spec.gpu_ids)) != len(spec.gpu_ids):
        raise SpecError("--gpu-ids", f"ids must be distinct, got {list(spec.gpu_ids)}")
    if spec.num_procs > 1 and spec.gpu_ids not in ("auto", None):
        raise SpecError(
            "--num-procs",
            "starts CPU ranks; it cannot be combined with --gpu-ids "
            "(use --gpu-ids 0 1 ... for one rank per GPU)",
        )
    if spec.keep_checkpoints < 0:
        raise SpecError("--keep-checkpoints", f"must be >= 0, got {spec.keep_checkpoints}")
    if spec.keep_env_states < 0:
        raise SpecError("--keep-env-states", f"must be >= 0, got {spec.keep_env_states}")
    if spec.max_restarts < 0:
        raise SpecError("--max-restarts", f"must be >= 0, got {spec.max_restarts}")
    name = spec.preempt_signal.upper().removeprefix("SIG")
    if name not in _SIGNALS:
        raise SpecError(
            "--preempt-signal", f"{spec.preempt_signal!r}: use one of {', '.join(_SIGNALS)}"
        )
    _check_folders(spec)
    for flag, low, value in (
        ("--video-length", 1, spec.video_length),
        ("--video-interval", 1, spec.video_interval),
    ):
        if not low <= value <= 10**9:
            raise SpecError(flag, f"must be between {low} and 10^9, got {value}")
    for flag, text in (
        ("--registry-name", spec.registry_name),
        ("--wandb-run-path", spec.wandb_run_path),
        ("--torchrunx-log-dir", spec.torchrunx_log_dir),
    ):
        if text is not None:
            no_control(flag, text)
    if spec.wandb_run_path is not None and not spec.wandb_run_path.strip("/ "):
        raise SpecError("--wandb-run-path", "must name a W&B run: entity/project/run-id")
    if spec.wandb_checkpoint_name is not None:
        path_component("--wandb-checkpoint-name", spec.wandb_checkpoint_name)
    _check_overrides(spec.overrides)
    return spec


def _check_durations(spec: TrainSpec) -> None:
    """Refuse a timeout or interval that no run could live with."""
    # Durations: at least a second (a process group forms, a checkpoint is written, in no
    # less), at most 30 days (past what torch's timedelta and the OS timers hold).
    for flag, value, unit, scale, off in (
        ("--dist-timeout-s", spec.dist_timeout_s, "seconds", 1.0, ""),
        (
            "--hang-timeout-s",
            spec.hang_timeout_s,
            "seconds",
            1.0,
            " (`none` disables the hang watchdog)",
        ),
        ("--save-every-min", spec.save_every_min, "minutes", 60.0, " (`none`: iterations only)"),
    ):
        if value is not None and not (math.isfinite(value) and 1 <= value * scale <= _MAX_S):
            low, high = 1 / scale, _MAX_S / scale
            raise SpecError(
                flag, f"must be between {low:g} and {high:g} {unit}, got {value:g}{off}"
            )


def _check_folders(spec: TrainSpec) -> None:
    """Refuse a folder flag (--log-root, --run-dir, --kernel-cache, names) no run could use."""
    no_control("--log-root", spec.log_root)
    if not spec.log_root.strip():
        raise SpecError("--log-root", "must not be empty (default: logs)")
    no_control("--kernel-cache", spec.kernel_cache)
    if not spec.kernel_cache.strip():
        raise SpecError("--kernel-cache", "must not be empty: auto, node or a folder")
    for flag, path in (
        ("--log-root", spec.log_root),
        ("--run-dir", spec.run_dir),
        ("--kernel-cache", spec.kernel_cache),
    ):
        if path is not None and path.startswith("~"):
            # No shell expanded it (it was quoted), and the job script would not either.
            raise SpecError(
                flag, f"{path!r}: '~' is not expanded here; write $HOME/... or the full path"
            )
    if spec.experiment_name is not None:
        path_component("--experiment-name", spec.experiment_name)
    if spec.run_name:
        run_name("--run-name", spec.run_name)
    if spec.run_dir is not None:
        no_control("--run-dir", spec.run_dir)
        if not spec.run_dir.strip():
            raise SpecError("--run-dir", "must not be empty: name a run directory")


def _check_overrides(overrides: tuple[str, ...]) -> None:
    """Refuse `--env.*`/`--agent.*` values no run could train with (nan, a learning rate > 1)."""
    flag = "--env/--agent"
    for arg in overrides:
        no_control(flag, arg)
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
        else:
            value = arg
        if value.strip().lower().lstrip("+-") in _NOT_FINITE:
            raise SpecError(flag, f"{value!r} is no setting (nan and inf are refused)")
        if (
            flag.replace("_", "-").endswith(".learning-rate")
            and value
            and not _learning_rate(value)
        ):
            # Far above any rate PPO trains at: the weights blow up, or train on at ~1e6.
            raise SpecError(
                flag, f"must be > 0 and at most 1 (PPO trains at ~1e-4 to 1e-2), got {value}"
            )


def _learning_rate(value: str) -> bool:
    try:
        return 0 < float(value) <= 1
    except ValueError:
        return True  # not a number: the task's own parser names it


def resolve(spec: TrainSpec) -> ResolvedSpec:
    """Check the spec (`check_train`) and resolve its task (`mjlab_hpc.tasks.registry`).

    Every entry point starts with it. mjlab's --agent.save-interval and --agent.run-name
    change the spec as they resolve; the changed spec is checked too.
    """
    resolved = registry.resolve_task(check_train(spec))
    if resolved.train != spec:
        check_train(resolved.train)
    return resolved


def check_submit(spec: SubmitSpec) -> SubmitSpec:
    """Return the submission, or raise SpecError naming the flag no cluster could run.

    Its training spec is checked too.
    """
    check_train(spec.train)
    for flag, value, low, high in (
        # Far above any cluster, below what sbatch or the ranks overflow on: a typo.
        ("--nodes", spec.nodes, 1, 100_000),
        ("--spare-nodes", spec.spare_nodes, 0, 100_000),
        ("--gpus-per-node", spec.gpus_per_node, 0, 1024),
        ("--tasks-per-node", spec.tasks_per_node, 1, 4096),
        ("--cpus-per-task", spec.cpus_per_task, 1, 4096),
        ("--array-parallelism", spec.array_parallelism, 1, 10**6),
        ("--signal-delay-s", spec.signal_delay_s, 1, 10**7),
    ):
        _within(flag, value, low, high)
    if spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nodes:
        raise SpecError(
            "--min-nodes",
            f"must be between 1 and --nodes ({spec.nodes}), got {spec.min_nodes}: the fewest "
            "nodes the run may go on with after a node fails",
        )
    if not 1 <= spec.chain <= 1000:
        raise SpecError("--chain", f"must be between 1 and 1000 jobs, got {spec.chain}")
    if spec.gpus_per_node > 0 and spec.ranks_per_node != spec.gpus_per_node:
        raise SpecError(
            "--tasks-per-node",
            f"{spec.ranks_per_node} ranks for {spec.gpus_per_node} GPUs per node: the job "
            "runs one rank per GPU; drop --tasks-per-node or make it equal --gpus-per-node",
        )
    if spec.mem is not None:
        check_mem(spec.mem)
    minutes = slurm_time_minutes(spec.time)
    if spec.signal_delay_s >= minutes * 60:
        raise SpecError(
            "--signal-delay-s",
            f"{spec.signal_delay_s} s is not shorter than --time {spec.time}; "
            "the warning must come before the limit",
        )
    for flag, value in (
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--qos", spec.qos),
    ):
        if value is not None:
            slurm_name(flag, value)
    if spec.constraint is not None:
        slurm_name("--constraint", spec.constraint, constraint=True)
    if spec.job_name is not None:
        job_name("--job-name", spec.job_name)
    for line in spec.setup:
        shell_line("--setup", line)
    if spec.container is not None:
        no_control("--container", spec.container)
    if spec.container_image is not None:
        no_control("--container-image", spec.container_image)
        if spec.container is not None:
            raise SpecError(
                "--container-image",
                "one image: drop --container (Apptainer) or --container-image (pyxis)",
            )
    if spec.train.num_procs != 1:
        raise SpecError("--num-procs", "mjlab-submit starts ranks itself: use --tasks-per-node")
    if spec.train.gpu_ids != "auto":
        raise SpecError("--gpu-ids", "mjlab-submit gives each rank its GPU: use --gpus-per-node")
    sbatch_options(spec)
    for job in spec.after:
        if not _JOB_ID.fullmatch(job):
            raise SpecError("--after", f"{job!r} is not a Slurm job id (4711, or 4711_2)")
    if not spec.sweep and spec.array_parallelism is not None:
        raise SpecError("--array-parallelism", "throttles a sweep: use it with --sweep")
    if spec.sweep and spec.train.run_dir:
        raise SpecError("--run-dir", "a sweep makes one run directory per element")
    if spec.sweep and spec.train.resume:
        raise SpecError("--resume", "a sweep starts new runs; resume each run by itself")
    return spec

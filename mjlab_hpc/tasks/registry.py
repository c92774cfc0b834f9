"""The task registry: every task, built-in or registered in mjlab.

It is the one place a training spec's task is resolved into the values every later stage uses.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import ResolvedSpec, TrainSpec
from mjlab_hpc.tasks import mjlab
from mjlab_hpc.tasks.agent import agent_config, apply_agent_overrides
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS, TaskInfo
from mjlab_hpc.tasks.warmstart import (
    fetch_wandb_checkpoint,
    fetch_wandb_motion,
    find_run_checkpoint,
    run_checkpoints,
    wandb_login_problem,
)

__all__ = ["experiment_of", "list_tasks", "resolve_task"]


def list_tasks() -> list[TaskInfo]:
    """List every task: the built-in ones, then mjlab's with their registered defaults.

    mjlab's tasks are listed when the [mjlab] extra is installed.
    """
    tasks = list(BUILTIN_TASKS.values())
    for name in mjlab.list_mjlab_tasks():
        defaults = mjlab.task_defaults(name, num_envs=None, max_iterations=None, overrides=())
        tasks.append(
            TaskInfo(
                name=name,
                description=defaults.description,
                make_env=None,
                num_envs=defaults.num_envs,
                max_iterations=defaults.max_iterations,
                experiment=defaults.experiment_name,
                source="mjlab",
            )
        )
    return tasks


def resolve_task(spec: TrainSpec) -> ResolvedSpec:
    """Look the spec's task up once and apply its flags and overrides.

    The result holds the effective values every later stage uses. The task is built-in or
    registered in mjlab; the overrides are `--env.*`/`--agent.*`. SpecError names TASK for an
    unknown task (with the known ones), or the override flag that cannot apply. A run that
    starts from another run's checkpoint (`--agent.resume True`) gets it here, and a tracking
    task its motion (`--registry-name`): W&B downloads happen here, once, before anything of
    the run exists.
    """
    overrides = tuple(spec.overrides)
    if spec.task in BUILTIN_TASKS:
        task = BUILTIN_TASKS[spec.task]
        cfg = apply_agent_overrides(agent_config(task, 1, task.name), overrides)  # validates
        for flag, given in (("--video", spec.video), ("--enable-nan-guard", spec.enable_nan_guard)):
            if given:
                raise SpecError(
                    flag,
                    f"is for mjlab tasks; the built-in task {spec.task!r} has no renderer and "
                    "no NaN guard (it checks for NaN itself): drop it",
                )
        experiment = spec.experiment_name or task.experiment_name
        return ResolvedSpec(
            train=spec,
            source="built-in",
            num_envs=spec.num_envs or task.num_envs,
            max_iterations=spec.max_iterations or task.max_iterations,
            experiment_name=experiment,
            start_checkpoint=_start_checkpoint(
                spec,
                experiment,
                resume=bool(cfg["resume"]),
                load_run=cfg["load_run"],
                load_checkpoint=cfg["load_checkpoint"],
            ),
        )
    if not mjlab.is_mjlab_task(spec.task):
        raise _unknown_task(spec.task)
    try:
        defaults = mjlab.task_defaults(spec.task, spec.num_envs, spec.max_iterations, overrides)
    except ValueError as exc:
        raise SpecError("--env/--agent", str(exc)) from None
    experiment = spec.experiment_name or defaults.experiment_name
    # mjlab's --agent.save-interval and --agent.run-name mean what our flags of those names do.
    given = {o.partition("=")[0].replace("_", "-") for o in overrides if o.startswith("--agent.")}
    if "--agent.save-interval" in given:
        spec = spec.replace(save_interval=defaults.save_interval)
    if "--agent.run-name" in given and not spec.run_name:
        spec = spec.replace(run_name=defaults.run_name)
    motion = None
    if defaults.tracking and not Path(defaults.motion_file or ".").is_file():
        if spec.registry_name is None:
            raise SpecError(
                "--env.commands.motion.motion-file",
                f"{spec.task} imitates a motion: give --env.commands.motion.motion-file "
                "/path/to/motion.npz (on the shared filesystem), or --registry-name "
                "entity/project/name to fetch it from the W&B registry once"
                + (f" ({defaults.motion_file!r} is no file)" if defaults.motion_file else ""),
            )
        motion = str(fetch_wandb_motion(Path(spec.log_root) / experiment, spec.registry_name))
    start = _start_checkpoint(
        spec,
        experiment,
        resume=defaults.resume,
        load_run=defaults.load_run,
        load_checkpoint=defaults.load_checkpoint,
    )
    # Last: what is wrong with the command itself is named first.
    if defaults.logger == "wandb" and (problem := wandb_login_problem()):
        raise SpecError("--agent.logger", problem)  # else a traceback once the run exists
    return ResolvedSpec(
        train=spec,
        source="mjlab",
        num_envs=defaults.num_envs,
        max_iterations=defaults.max_iterations,
        experiment_name=experiment,
        start_checkpoint=start,
        motion_file=motion,
    )


def _start_checkpoint(
    spec: TrainSpec, experiment: str, resume: bool, load_run: str, load_checkpoint: str
) -> str | None:
    """Return the checkpoint of another run that a new run starts from, or None.

    With mjlab's --agent.resume True it is --wandb-run-path's, else the latest run matching
    --agent.load-run. A run directory that holds checkpoints continues from its own: none is
    looked up.
    """
    if not resume:
        return None
    if spec.run_dir and run_checkpoints(Path(spec.run_dir)):
        return None
    folder = Path(spec.log_root) / experiment
    if spec.wandb_run_path:
        path = fetch_wandb_checkpoint(folder, spec.wandb_run_path, spec.wandb_checkpoint_name)
    else:
        exclude = Path(spec.run_dir) if spec.run_dir else None
        path = find_run_checkpoint(folder, load_run, load_checkpoint, exclude)
    return str(path.resolve())


def _unknown_task(task: str) -> SpecError:
    """The error for a task neither built in nor registered in mjlab, with the known ones."""
    known = mjlab.list_mjlab_tasks()
    close = difflib.get_close_matches(task, [*BUILTIN_TASKS, *known], n=1, cutoff=0.6)
    if not close:  # case and dashes: "mjlab-cartpole-balance", "Cartpole"
        folded = {t.lower().replace("_", "-"): t for t in [*BUILTIN_TASKS, *known]}
        close = [folded[k] for k in folded if k == task.lower().replace("_", "-")]
    guess = f"did you mean {close[0]!r}? " if close else ""
    hint = (
        f"; mjlab tasks: {', '.join(known)}"
        if known
        else "; mjlab tasks need the [mjlab] extra (pip install 'mjlab-hpc[mjlab]')"
    )
    return SpecError(
        "TASK",
        f"unknown task {task!r}; {guess}built-in tasks: {', '.join(sorted(BUILTIN_TASKS))}" + hint,
    )


def experiment_of(spec: TrainSpec) -> str:
    """Return the experiment folder of the spec's runs: --experiment-name, else the task's.

    Only the name (no download, no check of the overrides): how `--resume` finds the run it
    continues before the task is resolved with that run's settings.
    """
    if spec.experiment_name:
        return spec.experiment_name
    if spec.task in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec.task].experiment_name
    if not mjlab.is_mjlab_task(spec.task):
        raise _unknown_task(spec.task)
    try:
        defaults = mjlab.task_defaults(
            spec.task, spec.num_envs, spec.max_iterations, spec.overrides
        )
    except ValueError as exc:
        raise SpecError("--env/--agent", str(exc)) from None
    return defaults.experiment_name

"""The task registry: every task, built-in or registered in mjlab, and the one place a
training spec's task is resolved into the values every later stage uses."""

from __future__ import annotations

import difflib

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import ResolvedSpec, TrainSpec
from mjlab_hpc.tasks import mjlab
from mjlab_hpc.tasks.agent import agent_config, apply_agent_overrides
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS, TaskInfo

__all__ = ["list_tasks", "resolve"]


def list_tasks() -> list[TaskInfo]:
    """Every task: the built-in ones, then mjlab's (when the [mjlab] extra is installed) with
    their registered defaults."""
    tasks = list(BUILTIN_TASKS.values())
    for name in mjlab.list_mjlab_tasks():
        defaults = mjlab.task_defaults(name, None, None, ())
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


def resolve(spec: TrainSpec) -> ResolvedSpec:
    """Look the spec's task up once, built-in or registered in mjlab, and apply the spec's flags
    and `--env.*`/`--agent.*` overrides: the effective values every later stage uses.

    SpecError naming TASK for an unknown task (with the known ones), or the override flag that
    cannot apply.
    """
    overrides = tuple(spec.overrides)
    if spec.task in BUILTIN_TASKS:
        task = BUILTIN_TASKS[spec.task]
        apply_agent_overrides(agent_config(task, 1, task.name), overrides)  # validates them
        return ResolvedSpec(
            train=spec,
            source="built-in",
            num_envs=spec.num_envs or task.num_envs,
            max_iterations=spec.max_iterations or task.max_iterations,
            experiment_name=spec.experiment_name or task.experiment_name,
        )
    if not mjlab.is_mjlab_task(spec.task):
        known = mjlab.list_mjlab_tasks()
        close = difflib.get_close_matches(spec.task, [*BUILTIN_TASKS, *known], n=1, cutoff=0.6)
        if not close:  # case and dashes: "mjlab-cartpole-balance", "Cartpole"
            folded = {t.lower().replace("_", "-"): t for t in [*BUILTIN_TASKS, *known]}
            close = [folded[k] for k in folded if k == spec.task.lower().replace("_", "-")]
        guess = f"did you mean {close[0]!r}? " if close else ""
        hint = (
            f"; mjlab tasks: {', '.join(known)}"
            if known
            else "; mjlab tasks need the [mjlab] extra (pip install 'mjlab-hpc[mjlab]')"
        )
        raise SpecError(
            "TASK",
            f"unknown task {spec.task!r}; {guess}built-in tasks: "
            f"{', '.join(sorted(BUILTIN_TASKS))}" + hint,
        )
    try:
        defaults = mjlab.task_defaults(spec.task, spec.num_envs, spec.max_iterations, overrides)
    except ValueError as exc:
        raise SpecError("--env/--agent", str(exc)) from None
    return ResolvedSpec(
        train=spec,
        source="mjlab",
        num_envs=defaults.num_envs,
        max_iterations=defaults.max_iterations,
        experiment_name=spec.experiment_name or defaults.experiment_name,
    )

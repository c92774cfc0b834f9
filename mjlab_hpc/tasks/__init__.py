"""Tasks: the built-in ones written on mujoco_warp (`builtin`, `base`, `cartpole`, `ant`), their
rsl-rl agent configs (`agent`), the adapter for mjlab's registered tasks (`mjlab`), and the
registry that resolves a spec's task once (`registry`).

Importing this package is light: environments (torch, warp) and mjlab load when one is made.
"""

from mjlab_hpc.tasks.agent import agent_config, apply_agent_overrides
from mjlab_hpc.tasks.builtin import BUILTIN_TASKS, TaskInfo, get_task
from mjlab_hpc.tasks.registry import list_tasks, resolve

__all__ = [
    "BUILTIN_TASKS",
    "TaskInfo",
    "agent_config",
    "apply_agent_overrides",
    "get_task",
    "list_tasks",
    "resolve",
]

"""Tasks: the built-in ones written on mujoco_warp (`builtin`, `base`, `cartpole`, `ant`), their
rsl-rl agent configs (`agent`), the adapter for mjlab's registered tasks (`mjlab`), and the
registry that resolves a spec's task once (`registry`). Light to import: environments (torch,
warp) and mjlab load when one is made."""

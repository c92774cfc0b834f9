"""Tasks: the built-in ones on mujoco_warp, mjlab's registered ones, and the registry of both.

`registry` resolves a spec's task once. The package is light to import: environments (torch,
warp) and mjlab load when one is made.
"""

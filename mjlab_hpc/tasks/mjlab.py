"""mjlab's registered tasks as environments, PPO configs and runner classes our trainer drives.

They are built the way mjlab's own `train` builds them (docs/mjlab.md). mjlab is optional: it
is imported only inside functions, so this module loads without it (`mjlab_available()`). It
knows nothing of the rest of the toolkit: the registry asks it for a task's defaults, each
rank's workload for a ready environment.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import io
import os
import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError
from mjlab_hpc.tasks.video import (
    Recording,
    egl_device_id,
    gl_backend,
    gl_unloadable,
    prepare_gl,
    record_videos,
)

__all__ = [
    "MjlabDefaults",
    "MjlabRuntime",
    "apply_overrides",
    "capture_env",
    "configured_cfgs",
    "dump_params",
    "enable_cpu_graph",
    "is_mjlab_task",
    "list_mjlab_tasks",
    "load_mjlab_cfgs",
    "make_mjlab_runtime",
    "mjlab_available",
    "restore_env",
    "state_rules",
    "task_defaults",
    "world_model",
]

# Our per-rank seed must reach every rank distinctly; an override would give all ranks one seed.
_SEED_FLAGS = ("--agent.seed", "--env.seed")
_OVERRIDE_PREFIXES = ("--env.", "--agent.")
_MOTION_FLAG = "--env.commands.motion.motion-file"
# mjlab's NanGuardCfg.output_dir default (node-local /tmp): replaced by the run's folder.
_DEFAULT_NAN_DUMPS = "/tmp/mjlab/nan_dumps"


def mjlab_available() -> bool:
    """Whether mjlab is installed (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("mjlab") is not None


def _registry() -> Any:
    """Return mjlab's task registry, filled (importing mjlab.tasks registers mjlab's tasks).

    MuJoCo loads its offscreen GL library when it is imported: none without MUJOCO_GL and EGL
    (`prepare_gl`). A MUJOCO_GL whose library is missing is one SpecError naming it, not an
    import traceback.
    """
    prepare_gl()
    try:
        import mjlab.tasks  # noqa: F401
    except Exception as exc:
        gl = gl_backend()
        if "OpenGL" not in "".join(traceback.format_tb(exc.__traceback__)):
            raise
        raise SpecError(
            "MUJOCO_GL",
            f"importing mjlab failed loading MUJOCO_GL={gl}'s library ({type(exc).__name__}: "
            f"{exc}): install it (egl: libegl1 libegl-mesa0 libgl1-mesa-dri; osmesa: "
            "libosmesa6 on Debian) or set MUJOCO_GL to one this machine has",
        ) from None
    from mjlab.tasks import registry

    return registry


def list_mjlab_tasks() -> list[str]:
    """List the registered mjlab task ids, sorted (empty when mjlab is not installed)."""
    if not mjlab_available():
        return []
    return list(_registry().list_tasks())


def is_mjlab_task(name: str) -> bool:
    """Whether `name` is a registered mjlab task.

    It imports mjlab, which takes seconds: ask about built-in names first.
    """
    return name in list_mjlab_tasks()


@dataclass(frozen=True)
class MjlabRuntime:
    """One rank's mjlab task, ready for an rsl-rl runner."""

    task: str
    env: Any
    """rsl-rl VecEnv: mjlab's RslRlVecEnvWrapper around a ManagerBasedRlEnv."""
    train_cfg: dict[str, Any]
    """`asdict(agent_cfg)`: the dict OnPolicyRunner takes. Runners mutate it: pass
    `runner_cfg()` (a fresh copy) to each runner."""
    runner_cls: type
    """The runner class mjlab uses for this task (MjlabOnPolicyRunner when it names none)."""
    runner_kwargs: dict[str, Any]
    """Extra constructor arguments mjlab passes (registry_name for tracking tasks)."""
    env_cfg: Any
    """The ManagerBasedRlEnvCfg the env was built from (seed filled in)."""
    agent_cfg: Any
    """The RslRlOnPolicyRunnerCfg (or other RslRlBaseRunnerCfg) after flags and overrides."""
    device: str
    seed: int
    recorder: Any = None
    """mjlab's VideoRecorder inside `env` (--video, writer only), else None."""

    def runner_cfg(self) -> dict[str, Any]:
        """A fresh copy of `train_cfg` for one runner."""
        return copy.deepcopy(self.train_cfg)

    def close(self) -> None:
        """Close the environment."""
        self.env.close()


def _unknown_task(task: str) -> KeyError:
    known = list_mjlab_tasks()
    hint = ", ".join(known) if known else "mjlab is not installed (pip install 'mjlab-hpc[mjlab]')"
    return KeyError(f"unknown mjlab task {task!r}; registered: {hint}")


def load_mjlab_cfgs(task: str) -> tuple[Any, Any, type, bool]:
    """Load fresh copies of (env cfg, agent cfg, runner class, is tracking) from the registry."""
    if not mjlab_available():
        raise _unknown_task(task)
    registry = _registry()
    if task not in registry.list_tasks():
        raise _unknown_task(task)
    from mjlab.rl import MjlabOnPolicyRunner

    env_cfg = registry.load_env_cfg(task)
    agent_cfg = registry.load_rl_cfg(task)
    runner_cls = registry.load_runner_cls(task) or MjlabOnPolicyRunner
    return env_cfg, agent_cfg, runner_cls, _is_tracking_cfg(env_cfg)


def _is_tracking_cfg(env_cfg: Any) -> bool:
    # The same test as mjlab's train script: a "motion" command of the tracking kind.
    from mjlab.tasks.tracking.mdp import MotionCommandCfg

    return isinstance(env_cfg.commands.get("motion"), MotionCommandCfg)


# A negative number is a value (`--agent.algorithm.entropy-coef -0.01`), as in mjlab's train.
_NEGATIVE_NUMBER = re.compile(r"^-(\d|\.\d|inf\b|nan\b)", re.IGNORECASE)


def _flags(args: Sequence[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and not _NEGATIVE_NUMBER.match(a)]


def _tyro_message(text: str) -> str:
    """Flatten tyro's error panel (a titled box, then the helptext) into one line."""
    text = re.split(r"Argument helptext:|For full helptext", text)[0]
    text = re.sub(r"[─━│╭╮╰╯┃-]{3,}", " ", text).replace("│", " ")
    lines = [line for line in text.splitlines() if line.strip()]
    # The first line is the panel's title ("Value error"); the message follows.
    return " ".join(" ".join(lines[1:] if len(lines) > 1 else lines).split())


def apply_overrides(env_cfg: Any, agent_cfg: Any, overrides: Sequence[str]) -> tuple[Any, Any]:
    """Parse `--env.*` / `--agent.*` arguments with tyro against the two cfgs.

    It parses them the way mjlab's train script does and returns new (env_cfg, agent_cfg).
    ValueError names a bad argument.
    """
    args = list(overrides)
    if not args:
        return env_cfg, agent_cfg
    flags = _flags(args)
    if not args[0].startswith("-"):
        raise ValueError(f"mjlab override {args[0]!r} is not a flag (--env.* or --agent.*)")
    stray = [f for f in flags if not f.startswith(_OVERRIDE_PREFIXES) and f not in ("-h", "--help")]
    if stray:
        raise ValueError(
            f"mjlab override {stray[0]} is not an --env.* or --agent.* flag "
            f"(overrides given: {' '.join(args)})"
        )
    seeded = [f for f in flags if f.replace("_", "-") in _SEED_FLAGS]
    if seeded:
        raise ValueError(
            f"mjlab override {seeded[0]} is not allowed: use --seed (rank k then uses seed + k, "
            "for both the env and the agent)"
        )

    import mjlab
    import tyro
    from mjlab.envs import ManagerBasedRlEnvCfg
    from mjlab.rl import RslRlBaseRunnerCfg

    # Built with real types: this module's `from __future__ import annotations` would leave
    # a class statement's annotations as strings tyro cannot resolve in a local scope.
    overrides_cls = dataclasses.make_dataclass(
        "Overrides", [("env", ManagerBasedRlEnvCfg), ("agent", RslRlBaseRunnerCfg)], frozen=True
    )

    captured = io.StringIO()
    try:
        # tyro prints its errors (a panel) and exits; turn that into an exception.
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            parsed, unknown = tyro.cli(
                overrides_cls,
                args=args,
                default=overrides_cls(env_cfg, agent_cfg),
                prog="mjlab-train TASK",
                config=mjlab.TYRO_FLAGS,
                return_unknown_args=True,
            )
    except SystemExit as exc:
        if exc.code in (0, None):  # --help: show tyro's text, as mjlab's CLI would
            print(captured.getvalue(), end="")
            raise
        message = _tyro_message(captured.getvalue())
        bad = next((f for f in flags if re.search(re.escape(f) + r"\b", message)), None)
        bad = bad or next(iter(re.findall(r"--[\w.-]+", message)), "?")
        raise ValueError(f"bad mjlab override {bad}: {message}") from None
    if unknown:
        unknown_flags = _flags(unknown) or unknown
        raise ValueError(
            f"unknown mjlab override {unknown_flags[0]} (not a field of the task's env or agent "
            f"config; mjlab's `train TASK --help` lists them); "
            f"unrecognised: {' '.join(unknown)}"
        )
    return parsed.env, parsed.agent


def configured_cfgs(
    task: str, num_envs: int | None, max_iterations: int | None, overrides: Sequence[str]
) -> tuple[Any, Any, type, bool]:
    """Return the task's registered cfgs with our flags, then the user's overrides, applied.

    None keeps the task's value; the overrides win. The answer is (env cfg, agent cfg, runner
    class, is tracking task).
    """
    env_cfg, agent_cfg, runner_cls, tracking = load_mjlab_cfgs(task)
    if num_envs is not None:
        env_cfg.scene.num_envs = num_envs
    if max_iterations is not None:
        agent_cfg.max_iterations = max_iterations
    env_cfg, agent_cfg = apply_overrides(env_cfg, agent_cfg, overrides)
    if env_cfg.scene.num_envs < 1:
        raise ValueError(f"env.scene.num_envs must be >= 1, got {env_cfg.scene.num_envs}")
    return env_cfg, agent_cfg, runner_cls, tracking


def world_model(
    task: str, num_envs: int | None, overrides: Sequence[str]
) -> tuple[Any, int | None, int | None]:
    """Compile one world of the task's scene as mjlab's Simulation does.

    Returns the MjModel and the contacts and constraints per world it allocates (nconmax,
    njmax).
    """
    from mjlab.scene import Scene

    env_cfg, _, _, _ = configured_cfgs(task, num_envs, max_iterations=None, overrides=overrides)
    model = Scene(env_cfg.scene, "cpu").compile()
    env_cfg.sim.mujoco.apply(model)
    return model, env_cfg.sim.nconmax, env_cfg.sim.njmax


def make_mjlab_runtime(
    task: str,
    *,
    num_envs: int | None,
    max_iterations: int | None,
    seed: int,
    device: str,
    overrides: Sequence[str] = (),
    registry_name: str | None = None,
    cpu_graph: bool = False,
    motion_file: str | None = None,
    recording: Recording | None = None,
    nan_guard: bool = False,
    nan_guard_dir: str | None = None,
) -> MjlabRuntime:
    """Build one rank's env for a registered mjlab task, with its rsl-rl config and runner class.

    The order is mjlab's train's: the registered cfgs, our flags (None keeps the task's
    value), the user's `overrides`, then this rank's `seed`. The env is built in
    `wp.ScopedDevice(device)` and wrapped in mjlab's RslRlVecEnvWrapper.

    `motion_file` is what --registry-name fetched, used where the config names no file;
    `registry_name` goes to the runner (W&B lineage). `recording` records videos as mjlab's
    --video does (EGL on this rank's GPU). `nan_guard` is --enable-nan-guard, its dumps in
    `nan_guard_dir` unless the config names another folder. `cpu_graph` replays physics
    through captured Warp graphs on CPU, as mjlab does on CUDA (bit-identical, faster).
    """
    if recording is not None and (problem := gl_unloadable()) is not None:
        raise RuntimeError(f"--video: {problem}; install them on this node, or drop --video")
    env_cfg, agent_cfg, runner_cls, tracking = configured_cfgs(
        task, num_envs=num_envs, max_iterations=max_iterations, overrides=overrides
    )
    agent_cfg.seed = seed
    env_cfg.seed = seed
    if nan_guard:  # as mjlab's train applies --enable-nan-guard: after the overrides
        env_cfg.sim.nan_guard.enabled = True
        if nan_guard_dir and env_cfg.sim.nan_guard.output_dir == _DEFAULT_NAN_DUMPS:
            env_cfg.sim.nan_guard.output_dir = nan_guard_dir
    runner_kwargs: dict[str, Any] = {}
    if tracking:
        motion = env_cfg.commands["motion"]
        if motion_file and not (motion.motion_file and Path(motion.motion_file).is_file()):
            motion.motion_file = motion_file
        if not motion.motion_file or not Path(motion.motion_file).is_file():
            raise ValueError(
                f"{task} imitates a motion: give {_MOTION_FLAG} /path/to/motion.npz "
                f"(got {motion.motion_file!r}) on the shared filesystem; mjlab_hpc does not "
                "download W&B registry motions itself"
            )
        runner_kwargs["registry_name"] = _with_alias(registry_name) if registry_name else None

    import warp as wp
    from mjlab.rl import RslRlVecEnvWrapper

    if device.startswith("cuda"):
        # mjlab's train does this on every rank (TF32 matmuls, cudnn benchmark).
        from mjlab.utils.torch import configure_torch_backends

        configure_torch_backends()
    if recording is not None and device.startswith("cuda"):
        # EGL's device order is its own: render on the EGL device of this rank's GPU.
        os.environ["MUJOCO_EGL_DEVICE_ID"] = egl_device_id(device)
    with wp.ScopedDevice(device):
        env = _make_env(env_cfg, device, recording)
        recorder = record_videos(env, recording) if recording is not None else None
        if cpu_graph:
            enable_cpu_graph(env)
        vec_env = RslRlVecEnvWrapper(recorder or env, clip_actions=agent_cfg.clip_actions)
    return MjlabRuntime(
        task=task,
        env=vec_env,
        train_cfg=dataclasses.asdict(agent_cfg),
        runner_cls=runner_cls,
        runner_kwargs=runner_kwargs,
        env_cfg=env_cfg,
        agent_cfg=agent_cfg,
        device=device,
        seed=seed,
        recorder=recorder,
    )


def _make_env(env_cfg: Any, device: str, recording: Recording | None) -> Any:
    """Make mjlab's env, with an offscreen renderer when it records.

    A renderer that cannot start is one line naming --video, not a GL traceback.
    """
    from mjlab.envs import ManagerBasedRlEnv

    if recording is None:
        return ManagerBasedRlEnv(cfg=env_cfg, device=device, render_mode=None)
    try:
        return ManagerBasedRlEnv(cfg=env_cfg, device=device, render_mode="rgb_array")
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300]
        egl_id = os.environ.get("MUJOCO_EGL_DEVICE_ID", "unset")
        raise RuntimeError(
            f"--video: offscreen rendering does not work on this machine (MUJOCO_GL="
            f"{gl_backend()}, MUJOCO_EGL_DEVICE_ID={egl_id}: {type(exc).__name__}: {detail}); "
            "install EGL (libegl1, libegl-mesa0, libgl1-mesa-dri on Debian) or OSMesa "
            "(libosmesa6, MUJOCO_GL=osmesa), or drop --video"
        ) from None


def enable_cpu_graph(env: Any) -> bool:
    """Make a CPU ManagerBasedRlEnv replay step/forward/reset/sense through Warp graphs.

    mjlab's Simulation captures graphs only on CUDA (`_should_use_cuda_graph`); its replay
    path and its re-capture after array replacement (`create_graph`, called by
    `expand_model_fields` and `set_sensor_context`) are device-neutral, so setting the flag
    and capturing once is enough. Returns whether graphs are now in use.
    """
    import warp as wp

    sim = env.unwrapped.sim
    if sim.use_cuda_graph or sim.wp_device.is_cuda:
        return bool(sim.use_cuda_graph)
    sim.use_cuda_graph = True
    with wp.ScopedDevice(sim.wp_device):
        sim.create_graph()
    return True


# Not the environment's state: the video renderer, mjlab's NaN guard (recent states kept for a
# dump), the step's log output, whether physics replays graphs (--use-graph).
_NOT_STATE = frozenset({"_offline_renderer", "nan_guard", "extras", "use_cuda_graph"})
# mjtState names whose mujoco_warp Data field is named otherwise.
_DATA_FIELDS = {"warmstart": "qacc_warmstart", "plugin": "plugin_state"}


def _integration_state() -> frozenset[str]:
    """Return the mujoco_warp Data fields of MuJoCo's integration state (mjSTATE_INTEGRATION).

    They are what `mj_getState` keeps for an exact continuation; `forward` computes the rest
    of Data from them.
    """
    import mujoco

    every = int(mujoco.mjtState.mjSTATE_INTEGRATION)
    names = set()
    for member in mujoco.mjtState.__members__.values():
        bit = int(member)
        if bit and not bit & (bit - 1) and bit & every:
            name = member.name.removeprefix("mjSTATE_").lower()
            names.add(_DATA_FIELDS.get(name, name))
    return frozenset(names)


def state_rules() -> Any:
    """Say what of an mjlab env (a ManagerBasedRlEnv) is its state, for `envstate`.

    It is everything reachable from the env but the renderer, the NaN guard, the step's log,
    and what the env recomputes exactly after a restore (`restore_env`):

    - of the simulator's Data, all but the integration state (`forward` recomputes the rest);
    - of its Model, all but the fields mjlab expanded per world (`Simulation.expanded_fields`:
      what domain randomisation writes); the others are compiled from the task's config;
    - of a raycast sensor, everything: its rays, hits and caches are computed from Data and
      Model by `sense` (configuration otherwise);
    - the sensors' render context: its acceleration structures are refit before use.

    The observations of the last step stay: they hold the noise drawn for them.
    """
    import mujoco_warp
    from mjlab.sensor.raycast_sensor import RayCastSensor

    from mjlab_hpc.tasks.envstate import Rules  # torch and warp: only where envs are made

    state = _integration_state()

    def derived(env: Any) -> list[Any]:
        data, model = env.sim.wp_data, env.sim.wp_model
        out = [v for k, v in vars(data).items() if k not in state and not _is_plain(v)]
        fields = getattr(env.sim, "expanded_fields", None)  # None (an older mjlab): all kept
        if fields is not None:
            out += [v for k, v in vars(model).items() if k not in fields and not _is_plain(v)]
        for sensor in env.scene.sensors.values():
            if isinstance(sensor, RayCastSensor):  # its own arrays only: it holds Data too
                out += [v for v in vars(sensor).values() if _is_array(v)]
        context = env.scene.sensor_context
        return out if context is None else [*out, context.render_context]

    def only_fields(obj: Any) -> Any:
        if isinstance(obj, mujoco_warp.Data):
            return state
        return () if isinstance(obj, RayCastSensor) else None

    return Rules(skip_names=_NOT_STATE, only_fields=only_fields, derived=derived)


def _is_plain(value: object) -> bool:
    return isinstance(value, int | float | bool | str | type(None))


def _is_array(value: object) -> bool:
    import torch
    import warp as wp

    return isinstance(value, torch.Tensor | wp.array)


def capture_env(env: Any) -> dict[str, Any]:
    """Capture the whole state of an mjlab env (the rsl-rl wrapper or the env) on the CPU."""
    from mjlab_hpc.tasks.envstate import capture

    return capture(env.unwrapped, state_rules())


def restore_env(env: Any, state: dict[str, Any], device: str) -> list[str]:
    """Put `capture_env`'s state into a freshly built env of the same task, in place.

    Returns what could not be put back (empty: everything was).
    """
    import torch
    import warp as wp

    from mjlab_hpc.tasks.envstate import restore

    unwrapped = env.unwrapped
    with wp.ScopedDevice(device):
        # One step first, so that what mjlab creates lazily (the step's buffers, sensor
        # caches) exists to be written into; everything it changed is overwritten below.
        actions = torch.zeros(unwrapped.num_envs, env.num_actions, device=device)
        unwrapped.step(actions)
        problems = restore(unwrapped, state, state_rules(), device)
        unwrapped.sim.forward()  # Data's derived quantities, from the restored state
        _cast_rays(unwrapped)
    return problems


def _cast_rays(env: Any) -> None:
    """Compute the raycast sensors' rays and hits from the restored Data, as `sim.sense` does.

    Only their part of it: the cameras' frames were restored (rendering them again would mark
    their data stale).
    """
    import mujoco_warp

    context = env.scene.sensor_context
    if context is None or not context.raycast_sensors:
        return
    for sensor in context.raycast_sensors:
        sensor.prepare_rays()
    mujoco_warp.refit_bvh(env.sim.wp_model, env.sim.wp_data, context.render_context)
    for sensor in context.raycast_sensors:
        sensor.raycast_kernel(rc=context.render_context)
        sensor.postprocess_rays()


def dump_params(run_dir: str | os.PathLike[str], runtime: MjlabRuntime) -> tuple[Path, Path]:
    """Write <run_dir>/params/env.yaml and agent.yaml exactly as mjlab's train script does.

    Only rank 0 should call it. Returns the two paths.
    """
    from mjlab.utils.os import dump_yaml

    params = Path(run_dir) / "params"
    env_yaml, agent_yaml = params / "env.yaml", params / "agent.yaml"
    dump_yaml(env_yaml, dataclasses.asdict(runtime.env_cfg))
    dump_yaml(agent_yaml, dataclasses.asdict(runtime.agent_cfg))
    return env_yaml, agent_yaml


def _with_alias(registry_name: str) -> str:
    return registry_name if ":" in registry_name else registry_name + ":latest"


@dataclass(frozen=True)
class MjlabDefaults:
    """A registered task's values after our flags and the overrides."""

    num_envs: int
    """env.scene.num_envs"""
    max_iterations: int
    """agent.max_iterations"""
    experiment_name: str
    """agent.experiment_name"""
    description: str
    """One line for listings."""
    tracking: bool = False
    """The task imitates a motion file."""
    motion_file: str = ""
    """env.commands.motion.motion_file (tracking tasks)."""
    resume: bool = False
    """agent.resume: start from a checkpoint of another run (mjlab's --agent.resume True)."""
    load_run: str = ".*"
    """agent.load_run: which run (regular expression on run folder names)."""
    load_checkpoint: str = r"model_.*.pt"
    """agent.load_checkpoint: which checkpoint of it (regular expression)."""
    save_interval: int = 50
    """agent.save_interval"""
    run_name: str = ""
    """agent.run_name: the run folder's suffix (and the W&B run's name)."""
    logger: str = "tensorboard"
    """agent.logger: where rsl-rl logs (mjlab's default: wandb)."""


def task_defaults(
    task: str, num_envs: int | None, max_iterations: int | None, overrides: Sequence[str]
) -> MjlabDefaults:
    """Return a registered task's effective values after our flags and the overrides.

    ValueError names a bad override. It imports mjlab but builds nothing.
    """
    env_cfg, agent_cfg, _, tracking = configured_cfgs(
        task, num_envs=num_envs, max_iterations=max_iterations, overrides=overrides
    )
    return MjlabDefaults(
        num_envs=int(env_cfg.scene.num_envs),
        max_iterations=int(agent_cfg.max_iterations),
        experiment_name=str(agent_cfg.experiment_name),
        description="mjlab task" + (" (motion tracking)" if tracking else ""),
        tracking=tracking,
        motion_file=str(env_cfg.commands["motion"].motion_file or "") if tracking else "",
        resume=bool(agent_cfg.resume),
        load_run=str(agent_cfg.load_run),
        load_checkpoint=str(agent_cfg.load_checkpoint),
        save_interval=int(agent_cfg.save_interval),
        run_name=str(agent_cfg.run_name or ""),
        logger=str(agent_cfg.logger),
    )

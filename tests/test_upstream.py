"""The parts of other libraries mjlab_hpc uses beyond their public API, checked by name.

Each is checked against the installed versions: when an upgrade removes or renames one, the
failure names it and the one module of ours that uses it. submitit:
`mjlab_hpc/launch/executors.py`; rsl-rl: `mjlab_hpc/rank/runner.py` (and the state-dict
buffers of rsl-rl's normalizer, which `mjlab_hpc/rank/normalization.py` extends); mjlab:
`mjlab_hpc/tasks/mjlab.py`. What these parts do is tested by the tests that use them
(scripts, local jobs, training, resume).
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest

SUBMITIT = "used by mjlab_hpc/launch/executors.py"
RSL_RL = "used by mjlab_hpc/rank/runner.py"
MJLAB = "used by mjlab_hpc/tasks/mjlab.py to save and restore an env's whole state"


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_submitit_parts() -> None:
    import submitit
    from submitit.local import local

    for owner, name in (
        (submitit.SlurmExecutor, "_make_submission_file_text"),
        (submitit.SlurmExecutor, "_submitit_command_str"),
        (submitit.SlurmExecutor, "affinity"),
        (submitit.SlurmExecutor, "_submit_command"),
        (submitit.LocalExecutor, "_submit_command"),
        (local.Controller, "start_tasks"),
        (local.Controller, "kill_tasks"),
        (local.Controller, "wait"),
        (local.Controller, "run"),
        (local.Controller, "_forward_signal"),
        (local.LocalJobEnvironment, "_usr_sig"),
    ):
        assert hasattr(owner, name), f"submitit: {owner.__name__}.{name} is gone ({SUBMITIT})"
    job = inspect.signature(local.LocalJob).parameters
    for name in ("folder", "job_id", "process", "tasks"):
        assert name in job, f"submitit: LocalJob({name}=...) is gone ({SUBMITIT})"
    controller = _source(local.Controller)
    for attribute in ("self.tasks", "self.timeout_s", "self.signal_delay_s", "self.pid"):
        assert attribute in controller, f"submitit: Controller {attribute} is gone ({SUBMITIT})"
    started = _source(local.start_controller)
    for variable in (
        "SUBMITIT_LOCAL_NTASKS",
        "SUBMITIT_LOCAL_COMMAND",
        "SUBMITIT_LOCAL_TIMEOUT_S",
        "SUBMITIT_LOCAL_SIGNAL_DELAY_S",
        "SUBMITIT_LOCAL_WITH_SHELL",
    ):
        assert variable in started, f"submitit: the controller's {variable} is gone ({SUBMITIT})"
    for module in ("submitit.core._submit", "submitit.local._local"):  # `python -m` targets
        assert importlib.util.find_spec(module), f"submitit: {module} is gone ({SUBMITIT})"


def test_rsl_rl_parts() -> None:
    from rsl_rl.algorithms import PPO
    from rsl_rl.modules import EmpiricalNormalization
    from rsl_rl.runners import OnPolicyRunner
    from rsl_rl.utils.logger import Logger

    runner = _source(OnPolicyRunner.__init__)
    assert "self._configure_multi_gpu()" in runner, f"rsl-rl: the runner's hook is gone ({RSL_RL})"
    ppo = _source(PPO.__init__)
    for name in ("self._raw_actor", "self._raw_critic"):
        assert name in ppo, f"rsl-rl: PPO {name} is gone ({RSL_RL})"
    for name in ("init_logging_writer", "stop_logging_writer", "process_env_step", "log"):
        assert hasattr(Logger, name), f"rsl-rl: Logger.{name} is gone ({RSL_RL})"
    logger = _source(Logger)
    for name in ("self.rewbuffer", "self.lenbuffer", "self.writer"):
        assert name in logger, f"rsl-rl: Logger {name} is gone ({RSL_RL})"
    from rsl_rl.utils.wandb_log_writer import WandbLogWriter

    writer = _source(WandbLogWriter)
    for name in ("def save_video", "self.logged_videos", "def save_model"):
        assert name in writer, f"rsl-rl: WandbLogWriter {name} is gone ({RSL_RL}: one W&B run)"
    buffers = set(EmpiricalNormalization(3).state_dict())
    assert {"_mean", "_var", "_std", "count"} <= buffers, (
        f"rsl-rl: EmpiricalNormalization's buffers are now {sorted(buffers)} "
        "(used by mjlab_hpc/rank/normalization.py)"
    )


@pytest.mark.mjlab
def test_mjlab_parts() -> None:
    if importlib.util.find_spec("mjlab") is None:
        reason = "mjlab is not installed (the [mjlab] extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    from mjlab.sim.sim import Simulation

    sim = _source(Simulation)
    for name in ("self.use_cuda_graph", "self.wp_device", "def create_graph"):
        assert name in sim, (
            f"mjlab: Simulation {name} is gone (used by mjlab_hpc/tasks/mjlab.py for Warp graphs "
            "on CPU)"
        )
    # The environment's whole state (tasks/mjlab.py `state_rules`, `restore_env`): MuJoCo's
    # integration state names mujoco_warp's Data fields, the simulator recomputes the rest
    # (`forward`), the raycast sensors' render context and what is not state are named.
    import dataclasses

    import mujoco_warp
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.scene import Scene
    from mjlab.sensor.sensor_context import SensorContext

    from mjlab_hpc.tasks.mjlab import _integration_state

    data_fields = {f.name for f in dataclasses.fields(mujoco_warp.Data)}
    state = _integration_state()
    assert {"qpos", "qvel", "act", "qacc_warmstart", "ctrl", "time"} <= state, state
    missing = sorted(state - data_fields - {"plugin_state"})  # no plugins in mujoco_warp
    assert not missing, f"mujoco_warp's Data has no field for MuJoCo's state {missing} ({MJLAB})"
    for owner, name in (
        (Simulation, "wp_data"),
        (Simulation, "forward"),
        (Scene, "sensor_context"),
        (SensorContext, "render_context"),
    ):
        assert hasattr(owner, name), f"mjlab: {owner.__name__}.{name} is gone ({MJLAB})"
    for owner, name in (
        (ManagerBasedRlEnv, "self._offline_renderer"),
        (ManagerBasedRlEnv, "self.extras"),
        (Simulation, "self.nan_guard"),
    ):
        assert name in _source(owner), f"mjlab: {owner.__name__} {name} is gone ({MJLAB})"

"""The GPU path on a real GPU: marker `gpu`, run by `make gpu-check`.

`make test` and `make test-fast` deselect it. Without a usable CUDA GPU every test skips with
the reason, unless MJLAB_HPC_REQUIRE_GPU=1 (what `make gpu-check` sets where `nvidia-smi -L`
lists a GPU): then each one fails instead. The tests use the real commands, as users run
them, and the package's public functions:

- cartpole, ant and Mjlab-Velocity-Flat-Unitree-G1 train on `cuda:0` (`mjlab-train --gpu-ids 0`);
- the device mapping: CUDA_VISIBLE_DEVICES unset and set, `--gpu-ids None`, one GPU per task
  (the local executor's `--gpus-per-node 1`; a task that sees only its GPU as Slurm's
  `--gpus-per-task` gives it), with torch's and Warp's `cuda:0` checked to be the physical GPU
  CUDA_VISIBLE_DEVICES names;
- every Warp array (and captured graph) of a rank's workload on the rank's device;
- graph capture on CUDA, replay against plain stepping; mjlab's own CUDA graphs;
- resume on the GPU: bit-exact where the physics and PPO are deterministic on this GPU (two
  uninterrupted runs agree), else the drift is measured and printed; an mjlab env's whole
  state restored bit for bit, and the drift of its continuation measured;
- two ranks on the one GPU with gloo (the multi-rank code on CUDA tensors); NCCL refuses two
  ranks on one GPU ("Duplicate GPU detected"), which is checked too.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import BIN, cli_env, only_run, progress_records, warp_devices

import mjlab_hpc
from mjlab_hpc.launch.local import free_port
from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.workload import Workload, build_workload
from mjlab_hpc.rundir.checkpoint import load_rank_state, load_verified
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.tasks.memory import init_warp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]  # a cold kernel cache: minutes

REQUIRE = "MJLAB_HPC_REQUIRE_GPU"
G1 = "Mjlab-Velocity-Flat-Unitree-G1"
TB = ["--agent.logger", "tensorboard"]  # rsl-rl's default for mjlab tasks is W&B
# The GPU this session may use: CUDA_VISIBLE_DEVICES's first entry (a Slurm allocation), else 0.
VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
FIRST_GPU = VISIBLE.split(",")[0].strip() if VISIBLE else "0"


def need_gpu() -> None:
    """Skip without a usable CUDA GPU; fail instead where one is expected (REQUIRE=1)."""
    if torch.cuda.is_available():
        return
    if torch.version.cuda:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    else:
        why = f"torch {torch.__version__} is a CPU build, without CUDA"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(
            f"no usable GPU: {why}, but {REQUIRE}=1 says this machine has one (make gpu-check "
            "saw it in nvidia-smi -L): install torch's CUDA build (make install "
            "VENV=.venv-gpu GPU=1) and check the driver (nvidia-smi)",
            pytrace=False,
        )
    pytest.skip(f"no GPU: {why}; these checks run on a GPU machine (make gpu-check)")


def need_mjlab() -> None:
    if importlib.util.find_spec("mjlab") is not None:
        return
    why = "mjlab is not installed (pip install 'mjlab-hpc[mjlab]')"
    if os.environ.get(REQUIRE) == "1" or os.environ.get("CI") == "true":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def need_unset_visible() -> None:
    if VISIBLE is not None:
        pytest.skip(
            f"CUDA_VISIBLE_DEVICES={VISIBLE} is set for this session: unsetting it could reach "
            "GPUs that are not ours"
        )


def env_with_visible(visible: str | None) -> dict[str, str]:
    """The CLIs' environment with CUDA_VISIBLE_DEVICES set to `visible` (None: unset)."""
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return cli_env({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}, base=base)


def run_cli(
    command: list[str], env: dict[str, str] | None = None, timeout: float = 1500
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env=env or cli_env(), capture_output=True, text=True, timeout=timeout
    )


def train(args: list[str], root: Path, env: dict[str, str] | None = None) -> RunDir:
    """`mjlab-train ARGS --log-root ROOT` to a successful end; its one run."""
    proc = run_cli([str(BIN / "mjlab-train"), *args, "--log-root", str(root)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return only_run(root)


def train_at_once(*jobs: tuple[list[str], Path]) -> list[RunDir]:
    """`train(args, root)` for each job, all started at once (independent runs share the GPU:
    the check stays within its time)."""
    procs = [
        subprocess.Popen(
            [str(BIN / "mjlab-train"), *args, "--log-root", str(root)],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args, root in jobs
    ]
    outs = [proc.communicate(timeout=1500)[0] for proc in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    return [only_run(root) for _, root in jobs]


def summary(run: RunDir) -> dict[str, Any]:
    return json.loads(run.summary.read_text())


def rank_head(run: RunDir, rank: int = 0) -> str:
    """A rank's first line about itself: `rank ... on DEVICE, ..., CUDA_VISIBLE_DEVICES=...`."""
    lines = run.rank_log(rank).read_text().splitlines()
    return next(line for line in lines if "CUDA_VISIBLE_DEVICES=" in line)


def visible_of(run: RunDir, rank: int = 0) -> str:
    """CUDA_VISIBLE_DEVICES as the rank's first line gives it (an OOM counter may follow)."""
    found = re.search(r"CUDA_VISIBLE_DEVICES=([^\s,]+(?:,[^\s,]+)*)", rank_head(run, rank))
    assert found, rank_head(run, rank)
    return found.group(1)


def check_gpu_run(run: RunDir, iterations: int, world: int = 1) -> dict[str, Any]:
    done = summary(run)
    got = (done["device"], done["iterations"], done["world_size"])
    assert got == ("cuda:0", iterations, world), done
    assert json.loads(run.record.read_text())["device"] == "cuda:0"
    for k in range(world):
        assert " on cuda:0, " in rank_head(run, k), rank_head(run, k)
    progress = progress_records(run)
    assert [r["iteration"] for r in progress] == list(range(1, iterations + 1))
    assert all(r["env_steps"] > 0 and r["env_steps_per_s"] > 0 for r in progress)
    return done


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """The models' tensors of a checkpoint (every `*state_dict` but the optimizer's)."""
    ckpt = load_verified(path, map_location="cpu")  # weights only, as a resume loads it
    params = {
        f"{key}.{name}": t
        for key, state in ckpt.items()
        if key.endswith("state_dict") and "optimizer" not in key
        for name, t in state.items()
        if torch.is_tensor(t)
    }
    assert params, f"no model tensors in {path}"
    return params


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """A measured figure, printed even though pytest captures output, and appended to the
    file MJLAB_HPC_GPU_REPORT names (`make gpu-check`: its workers' output is not shown)."""
    with capsys.disabled():
        print(f"\n[gpu-check] {line}")
    if path := os.environ.get("MJLAB_HPC_GPU_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")


# --- training on the GPU ------------------------------------------------------------------


@pytest.mark.parametrize("task", ["cartpole", "ant"])
def test_builtin_task_trains_on_gpu(task: str, tmp_path: Path) -> None:
    need_gpu()
    args = [task, "--gpu-ids", "0", "--num-envs", "1024", "--max-iterations", "3", "--seed", "1"]
    run = train([*args, "--save-interval", "100"], tmp_path)
    done = check_gpu_run(run, 3)
    assert len(done["param_digest_per_rank"]) == 1
    if task == "cartpole":  # poles fall within the first iteration: episodes have ended
        assert all(r["mean_reward"] is not None for r in progress_records(run))
    # The final checkpoint holds what an exact resume on the GPU needs: the CUDA generator.
    state = load_rank_state(run.checkpoint(3), 0, 1, {})  # weights only, as a resume loads it
    assert state["cuda_rng"].numel() > 0 and state["env"]["qpos"].shape[0] == 1024


def test_mjlab_velocity_task_trains_on_gpu(tmp_path: Path) -> None:
    need_gpu()
    need_mjlab()
    args = [G1, "--gpu-ids", "0", "--num-envs", "1024", "--max-iterations", "3", *TB]
    run = train(args, tmp_path)
    check_gpu_run(run, 3)
    assert (run.path / "model_3.pt").exists()
    assert (run.path / f"{run.path.name}.onnx").exists()  # the velocity runner's ONNX export


# --- the device mapping ---------------------------------------------------------------------


@pytest.mark.parametrize("visible", ["unset", "set"])
def test_gpu_ids_0_with_cuda_visible_devices(visible: str, tmp_path: Path) -> None:
    """`--gpu-ids 0` counts within CUDA_VISIBLE_DEVICES: unset, the CLI sets it to 0 before
    CUDA starts; set to one GPU (as Slurm gives a task), that GPU is used, as cuda:0."""
    need_gpu()
    if visible == "unset":
        need_unset_visible()
    env = env_with_visible(None if visible == "unset" else FIRST_GPU)
    args = ["cartpole", "--gpu-ids", "0", "--num-envs", "256", "--max-iterations", "1"]
    run = train(args, tmp_path, env)
    check_gpu_run(run, 1)
    assert visible_of(run) == FIRST_GPU, rank_head(run)


def test_gpu_ids_none_trains_on_the_cpu_beside_a_gpu(tmp_path: Path) -> None:
    need_gpu()
    args = ["cartpole", "--gpu-ids", "None", "--num-envs", "64", "--max-iterations", "1"]
    run = train([*args, "--torch-threads", "1"], tmp_path)
    assert summary(run)["device"] == "cpu"
    assert " on cpu, " in rank_head(run)


def test_one_gpu_per_task_through_the_local_executor(tmp_path: Path) -> None:
    """`mjlab-submit --executor local --gpus-per-node 1`: the task gets its GPU in
    CUDA_VISIBLE_DEVICES (as Slurm's --gpus-per-task does) and trains on it as cuda:0."""
    need_gpu()
    cmd = [str(BIN / "mjlab-submit"), "cartpole", "--executor", "local", "--gpus-per-node", "1"]
    cmd += ["--num-envs", "256", "--max-iterations", "2", "--log-root", str(tmp_path), "--follow"]
    proc = run_cli(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert check_gpu_run(run, 2)["launch_mode"] == "submitit-local"
    # One GPU named for the task (submitit names it by its index).
    assert re.fullmatch(r"\d+", visible_of(run)), rank_head(run)


# Run in a fresh process, where CUDA starts under the CUDA_VISIBLE_DEVICES given: the device
# the rank resolves, and which physical GPU torch's and Warp's views of it are.
_DEVICE_PROBE = """
import json, os, sys
import torch, warp as wp
from mjlab_hpc.errors import LaunchError
from mjlab_hpc.rank.context import cuda_device_count, resolve_device
from mjlab_hpc.tasks.memory import init_warp

init_warp()
local_rank, local_world = int(sys.argv[1]), int(sys.argv[2])
try:
    device = resolve_device("auto", local_rank, local_world, cuda_count=cuda_device_count(),
                            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
except LaunchError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
with wp.ScopedDevice(device):
    array = wp.zeros(4, dtype=float)
print(json.dumps({
    "device": device,
    "torch": str(torch.zeros(1, device=device).device),
    "warp": str(array.device),
    "warp_uuid": wp.get_device(device).uuid,
    "torch_uuid": str(torch.cuda.get_device_properties(torch.device(device)).uuid),
}))
"""


def physical_uuids() -> dict[str, str]:
    """nvidia-smi's GPU index -> UUID key (see `uuid_key`); empty without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    out = subprocess.run(
        [smi, "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    rows = [line.split(",", 1) for line in out.splitlines() if "," in line]
    return {index.strip(): uuid_key(uuid) for index, uuid in rows}


def uuid_key(uuid: str) -> str:
    """A GPU's UUID as nvidia-smi and Warp (`GPU-5d2c...`) and torch (`5d2c...`) write it."""
    return uuid.strip().lower().removeprefix("gpu-")


@pytest.mark.parametrize(
    ("visible", "local_rank", "local_world"),
    [
        ("unset", 0, 1),  # one process, all GPUs visible
        ("first", 0, 1),  # one process, given one GPU
        ("first", 1, 2),  # Slurm --gpus-per-task=1: local task 1 sees only its own GPU
        ("first", 3, 4),
    ],
)
def test_each_rank_resolves_the_physical_gpu_it_was_given(
    visible: str, local_rank: int, local_world: int
) -> None:
    need_gpu()
    if visible == "unset":
        need_unset_visible()
    env = env_with_visible(None if visible == "unset" else FIRST_GPU)
    probe = [str(BIN / "python"), "-c", _DEVICE_PROBE, str(local_rank), str(local_world)]
    proc = run_cli(probe, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["device"], got["torch"], got["warp"]) == ("cuda:0",) * 3, got
    # torch and Warp address the same GPU, and it is a GPU of this machine ...
    uuid = uuid_key(got["warp_uuid"])
    assert uuid_key(got["torch_uuid"]) == uuid, got
    uuids = physical_uuids()
    if not uuids:
        return
    assert uuid in uuids.values(), (got, uuids)
    # ... the one CUDA_VISIBLE_DEVICES names, where CUDA counts GPUs as nvidia-smi does (in bus
    # order; its default puts the fastest first) or there is one.
    if FIRST_GPU in uuids and (
        len(uuids) == 1 or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    ):
        assert uuid == uuids[FIRST_GPU], (got, uuids)


def test_a_local_rank_without_a_gpu_is_refused() -> None:
    """All GPUs visible and more local ranks than GPUs: the extra rank is refused, not put on
    another rank's GPU."""
    need_gpu()
    need_unset_visible()
    n = torch.cuda.device_count()
    probe = [str(BIN / "python"), "-c", _DEVICE_PROBE, str(n), str(n + 1)]
    proc = run_cli(probe, env_with_visible(None))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"local rank {n} has no GPU" in got.get("error", ""), got


# --- Warp arrays and graphs on the rank's device ------------------------------------------


def gpu_workload(tmp_path: Path, task: str, envs: int, *overrides: str) -> Workload:
    """One rank's workload on cuda:0, built as `train_rank` builds it (a single process)."""
    init_warp()
    spec = mjlab_hpc.TrainSpec(task=task, num_envs=envs, log_root=str(tmp_path))
    resolved = mjlab_hpc.resolve(spec.replace(overrides=overrides))
    return build_workload(
        resolved,
        DistContext.from_env({}),
        device="cuda:0",
        seed=0,
        run=RunDir(tmp_path / "run"),
        quiet=io.StringIO(),
    )


@pytest.mark.parametrize("task", ["cartpole", "ant", G1])
def test_every_warp_array_of_a_rank_lives_on_its_device(task: str, tmp_path: Path) -> None:
    need_gpu()
    overrides: tuple[str, ...] = ()
    if task == G1:
        need_mjlab()
        overrides = tuple(TB)
    work = gpu_workload(tmp_path, task, 64, *overrides)
    devices = warp_devices(work.env)
    assert len(devices) > 300, len(devices)  # model, data and their nested structs
    misplaced = {path: d for path, d in devices.items() if d != "cuda:0"}
    assert not misplaced, misplaced
    # The policy and the value function sit on the same device.
    tensors = [
        *work.runner.alg.actor.state_dict().values(),
        *work.runner.alg.critic.state_dict().values(),
    ]
    assert {str(t.device) for t in tensors} == {"cuda:0"}
    obs = work.env.get_observations()
    assert {str(v.device) for v in obs.values()} == {"cuda:0"}


# --- graph capture on CUDA ------------------------------------------------------------------


def rollout(env: Any, steps: int, seed: int, key: str = "policy") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        actions = torch.randn(env.num_envs, env.num_actions, generator=g).to(env.device)
        obs, rew, done, _ = env.step(actions)
        out += [obs[key].clone(), rew.clone(), done.clone()]
    torch.cuda.synchronize()
    return out


def outputs_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("task", ["cartpole", "ant"])
def test_graph_capture_on_cuda(task: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The captured graph is a CUDA graph, and replaying it steps the worlds as plain stepping
    does: bit-identically where plain stepping is itself deterministic on this GPU."""
    need_gpu()
    import warp as wp

    from mjlab_hpc.tasks.builtin import get_task

    init_warp()
    make = get_task(task).make_env
    assert make is not None
    with wp.ScopedDevice("cuda:0"):
        graphed = make(256, "cuda:0", 3, True)
        plain, plain_again = (make(256, "cuda:0", 3, False) for _ in range(2))
    assert graphed._graph is not None and str(graphed._graph.device) == "cuda:0"
    assert plain._graph is None
    a, b, c = (rollout(env, 60, seed=4) for env in (graphed, plain, plain_again))
    run_to_run, replay = outputs_difference(b, c), outputs_difference(a, b)
    report(
        capsys,
        f"{task}: graph replay vs plain stepping max |diff| {replay:.3g}, "
        f"plain vs plain {run_to_run:.3g} (60 steps, 256 worlds)",
    )
    if run_to_run == 0.0:
        assert replay == 0.0
    else:  # atomics in the physics: the replay may differ no more than two plain runs do
        assert replay <= 10 * run_to_run + 1e-6


def test_mjlab_captures_cuda_graphs() -> None:
    need_gpu()
    need_mjlab()
    import warp as wp

    from mjlab_hpc.tasks import mjlab as mt

    init_warp()
    runtime = mt.make_mjlab_runtime(G1, num_envs=64, max_iterations=1, seed=0, device="cuda:0")
    try:
        sim = runtime.env.unwrapped.sim
        # mjlab's own conditions (mjlab/sim/sim.py): a memory pool and a 12.4+ driver.
        driver = wp.get_cuda_driver_version()
        pool = wp.is_mempool_enabled(sim.wp_device)
        if not pool or driver is None or tuple(driver) < (12, 4):
            pytest.skip(f"mjlab uses no CUDA graphs here (driver {driver}, memory pool {pool})")
        assert sim.use_cuda_graph
        for name in ("step_graph", "forward_graph", "reset_graph"):
            graph = getattr(sim, name)
            assert graph is not None and str(graph.device) == "cuda:0", name
        env = runtime.env
        for _ in range(5):
            obs, rew, _, _ = env.step(torch.zeros(env.num_envs, env.num_actions, device="cuda:0"))
        assert torch.isfinite(rew).all() and all(torch.isfinite(v).all() for v in obs.values())
    finally:
        runtime.close()


# --- resume on the GPU ----------------------------------------------------------------------


@pytest.mark.parametrize("task", ["cartpole", "ant"])
def test_resume_on_gpu(task: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 iterations, then `--resume` to 4, against two uninterrupted runs of 4: bit-identical
    parameters where the two uninterrupted runs agree bit for bit (deterministic on this GPU);
    else the resumed run may differ no more than they differ from each other."""
    need_gpu()
    args = [task, "--gpu-ids", "0", "--num-envs", "512", "--seed", "5", "--save-interval", "2"]
    a, a2, _ = train_at_once(
        ([*args, "--max-iterations", "4"], tmp_path / "a"),
        ([*args, "--max-iterations", "4"], tmp_path / "a2"),
        ([*args, "--max-iterations", "2"], tmp_path / "b"),
    )
    b = train([*args, "--max-iterations", "4", "--resume"], tmp_path / "b")
    resumed = check_gpu_run(b, 4)
    assert resumed["resumed_from"] == 2
    pa, pa2, pb = (checkpoint_params(r.checkpoint(4)) for r in (a, a2, b))
    run_to_run, drift = max_difference(pa, pa2), max_difference(pa, pb)
    report(
        capsys,
        f"{task} resume on the GPU: max |param diff| resumed vs uninterrupted "
        f"{drift:.3g}, uninterrupted vs uninterrupted {run_to_run:.3g}",
    )
    if run_to_run == 0.0:
        assert resumed["param_digest_per_rank"] == summary(a)["param_digest_per_rank"]
        assert drift == 0.0
    else:
        assert drift <= 10 * run_to_run + 1e-6


def test_mjlab_resume_on_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """mjlab tasks resume their models, optimizer and whole environments on the GPU; where
    mujoco_warp is not bitwise deterministic, the continuation's drift from an uninterrupted
    run is measured beside two uninterrupted runs' drift from each other."""
    need_gpu()
    need_mjlab()
    args = [G1, "--gpu-ids", "0", "--num-envs", "512", "--seed", "5", *TB]
    a, a2, _ = train_at_once(
        ([*args, "--max-iterations", "4"], tmp_path / "a"),
        ([*args, "--max-iterations", "4"], tmp_path / "a2"),
        ([*args, "--max-iterations", "2"], tmp_path / "b"),
    )
    b = train([*args, "--max-iterations", "4", "--resume"], tmp_path / "b")
    assert check_gpu_run(b, 4)["resumed_from"] == 2
    assert json.loads(b.record.read_text())["starts"][-1]["environments"] == "restored"
    pa, pa2, pb = (checkpoint_params(r.checkpoint(4)) for r in (a, a2, b))
    run_to_run, drift = max_difference(pa, pa2), max_difference(pa, pb)
    report(
        capsys,
        f"{G1} resume on the GPU: max |param diff| resumed vs uninterrupted "
        f"{drift:.3g}, uninterrupted vs uninterrupted {run_to_run:.3g}",
    )
    if run_to_run == 0.0:
        assert drift == 0.0


def test_mjlab_state_restores_bit_for_bit_on_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The whole state of a G1 env stepped on the GPU (mjlab's CUDA graphs where it uses
    them), restored into a fresh env, is the saved state bit for bit; both then step on, and
    their drift is measured beside two fresh envs' drift from each other."""
    need_gpu()
    need_mjlab()
    import warp as wp

    from mjlab_hpc.tasks import envstate
    from mjlab_hpc.tasks import mjlab as mt

    init_warp()

    def env() -> Any:
        runtime = mt.make_mjlab_runtime(G1, num_envs=256, max_iterations=1, seed=0, device="cuda:0")
        return runtime.env

    first, second, third = env(), env(), env()
    with wp.ScopedDevice("cuda:0"):
        rollout(first, 20, seed=1, key="actor")
    saved = mt.capture_env(first)
    rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    assert mt.restore_env(second, saved, "cuda:0") == []
    assert envstate.differences(saved, mt.capture_env(second)) == []
    assert mt.restore_env(third, saved, "cuda:0") == []
    outputs = []
    for e in (first, second, third):  # each from the same generators' state
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1])
        with wp.ScopedDevice("cuda:0"):
            outputs.append(rollout(e, 50, seed=2, key="actor"))
    a, b, c = outputs
    drift, run_to_run = outputs_difference(a, b), outputs_difference(b, c)
    report(
        capsys,
        f"{G1} state restored on the GPU: bit for bit; 50 steps on, max |diff| "
        f"original vs restored {drift:.3g}, restored vs restored "
        f"{run_to_run:.3g}",
    )


# --- two ranks on one GPU -------------------------------------------------------------------

# Loaded by Python itself in each rank (sitecustomize on PYTHONPATH): the process group of a
# CUDA rank uses gloo instead of NCCL, which refuses two ranks on one GPU.
GLOO_ON_CUDA = """
import importlib.abc, importlib.util, sys

class _Gloo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "mjlab_hpc.rank.context":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)

            def gloo(device):
                print(f"gpu-check: gloo for {device}", file=sys.stderr, flush=True)
                return "gloo"

            module.backend_for = gloo

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Gloo())
"""


def two_ranks_on_one_gpu(root: Path, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc_per_node=2 mjlab-train cartpole` with both ranks given the one GPU."""
    env = cli_env({"CUDA_VISIBLE_DEVICES": FIRST_GPU, **extra})
    # torchrun as `python -m torch.distributed.run`: a site's torch keeps its script elsewhere.
    torchrun = [str(BIN / "python"), "-m", "torch.distributed.run"]
    torchrun += ["--nproc_per_node=2", f"--master_port={free_port()}", "--no_python"]
    cartpole = ["mjlab-train", "cartpole", "--num-envs", "256", "--max-iterations", "3"]
    cartpole += ["--save-interval", "2", "--dist-timeout-s", "120", "--log-root", str(root)]
    return run_cli([*torchrun, *cartpole], env, timeout=900)


def need_shared_gpu() -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    query = [smi, "-i", FIRST_GPU, "--query-gpu=compute_mode", "--format=csv,noheader"]
    mode = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.strip()
    if "exclusive" in mode.lower():
        pytest.skip(f"GPU {FIRST_GPU} is in compute mode {mode}: one process at a time")


def test_two_ranks_on_one_gpu_with_gloo(tmp_path: Path) -> None:
    """Both ranks on cuda:0 (local rank 1 included: CUDA_VISIBLE_DEVICES names one GPU), in a
    gloo group: gradients, normalizers, stop agreement and checkpoints on CUDA tensors."""
    need_gpu()
    need_shared_gpu()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GLOO_ON_CUDA)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    proc = two_ranks_on_one_gpu(tmp_path / "logs", {"PYTHONPATH": path})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("gpu-check: gloo for cuda:0") == 2, out[-4000:]
    run = only_run(tmp_path / "logs")
    done = check_gpu_run(run, 3, world=2)
    assert done["launch_mode"] == "torchrun" and done["ranks_in_sync"] is True
    assert len(set(done["param_digest_per_rank"])) == 1  # gradients averaged on CUDA tensors
    assert len(set(done["first_obs_digest_per_rank"])) == 2  # each rank its own worlds
    assert all(r["collectives"] > 0 for r in progress_records(run))
    saved = sorted(p.name for p in (run.path / "rank_states" / "model_3").glob("*.pt"))
    assert saved == ["rank0-of-2.pt", "rank1-of-2.pt"]  # each rank wrote its own


def test_nccl_refuses_two_ranks_on_one_gpu(tmp_path: Path) -> None:
    """What the gloo test works around: NCCL fails a communicator with two ranks on one GPU.
    If this starts to pass, NCCL changed and docs/testing.md should say so."""
    need_gpu()
    need_shared_gpu()
    proc = two_ranks_on_one_gpu(tmp_path / "logs", {"NCCL_DEBUG": "WARN"})
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("rank*.log"))
    out = proc.stdout + proc.stderr + logs
    assert proc.returncode != 0, out[-4000:]
    assert re.search(r"duplicate gpu", out, re.IGNORECASE), out[-4000:]

"""mjlab users' commands through `mjlab-train`, unchanged.

Every flag of mjlab's own train is accepted and parsed to the same values. One W&B run
(offline here) spans a preemption with its requeue, a crash and a resume, with no step logged
twice. A new run starts from another run's checkpoint through `--wandb-run-path` (a downloaded
copy: no network), recording videos on the writer only, with mjlab's NaN guard. What cannot
work stops before anything exists.

Skipped when mjlab is not installed, except under CI=true, where that fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import types
import typing
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import mjlab  # make install brings the extra: on CI a missing mjlab fails
else:
    pytest.importorskip("mjlab", reason="mjlab is not installed (pip install 'mjlab-hpc[mjlab]')")

import mjlab
import tyro
from helpers import BIN, cli_env, only_run, progress_records, rank_pids, wait_for_iteration

from mjlab_hpc.cli.common import parse_with_overrides
from mjlab_hpc.cli.train import main as train_main
from mjlab_hpc.rundir.layout import WANDB_RECORD, RunDir
from mjlab_hpc.spec import TrainSpec
from mjlab_hpc.tasks.warmstart import CHECKPOINT_CACHE

pytestmark = pytest.mark.mjlab

CARTPOLE = "Mjlab-Cartpole-Balance"
TRACKING = "Mjlab-Tracking-Flat-Unitree-G1"
# A value for each type of mjlab's train flags (a new type fails the test: add one here).
SAMPLES: dict[str, list[str]] = {
    "bool": ["True"],
    "int": ["7"],
    "str": ["some/where"],
    "str | None": ["ent/proj/abcd1234"],
    # mjlab 1.6 reads lists in Python's syntax; ours also takes `--gpu-ids 0 1` (below).
    "list[int] | Literal['all'] | None": ["[0, 1]"],
}


def _type_name(kind: object) -> str:
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if typing.get_origin(kind) is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if args:
        return f"{typing.get_origin(kind).__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _ours(args: list[str], keep_overrides: bool = True) -> TrainSpec | int:
    """What mjlab-train parses from `CARTPOLE *args`, mjlab's own settings kept or dropped."""

    def attach(spec: TrainSpec, overrides: tuple[str, ...]) -> TrainSpec:
        return spec.replace(overrides=overrides) if keep_overrides else spec

    return parse_with_overrides(TrainSpec, [CARTPOLE, *args], description=None, attach=attach)


def test_every_flag_of_mjlabs_train_is_accepted_with_its_value() -> None:
    """Read from mjlab's own TrainConfig, so a flag a new mjlab release adds fails here: each
    one, spelled as mjlab's CLI takes it, parses through ours to the value mjlab's CLI gets."""
    from mjlab.scripts.train import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    default = TrainConfig.from_task(CARTPOLE)
    flags = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("env", "agent")]
    assert len(flags) >= 10, flags
    helptext = subprocess.run(
        [BIN / "mjlab-train", "--help"], env=cli_env(), capture_output=True, text=True, timeout=120
    ).stdout
    for name in flags:
        flag = "--" + name.replace("_", "-")
        kind = _type_name(hints[name])
        assert kind in SAMPLES, f"mjlab's train has {flag} of type {kind}: add it here and to ours"
        args = [flag, *SAMPLES[kind]]
        theirs = tyro.cli(TrainConfig, args=args, default=default, config=mjlab.TYRO_FLAGS)
        ours = _ours(args)
        assert isinstance(ours, TrainSpec), f"{flag} is refused by mjlab-train"
        assert hasattr(ours, name), f"{flag} has no field of that name in TrainSpec"
        want, got = getattr(theirs, name), getattr(ours, name)
        assert (list(got) if isinstance(got, tuple) else got) == want, (flag, got, want)
        assert flag in helptext, f"{flag} is not in `mjlab-train --help`"
    # Their env and agent settings go to mjlab's configs, spelled as mjlab spells them.
    ours = _ours(["--agent.resume", "True", "--video", "True", "--env.scene.num-envs", "4"])
    assert isinstance(ours, TrainSpec) and ours.video
    assert ours.overrides == ("--agent.resume", "True", "--env.scene.num-envs", "4")
    for args in (["--gpu-ids", "0", "1"], ["--gpu-ids=[0,1]"], ["--gpu-ids", "[0,", "1]"]):
        ours = _ours(args, keep_overrides=False)
        assert isinstance(ours, TrainSpec) and ours.gpu_ids == (0, 1), args
    for value in ("[0]", "all", "None"):
        theirs = tyro.cli(
            TrainConfig, args=["--gpu-ids", value], default=default, config=mjlab.TYRO_FLAGS
        )
        ours = _ours(["--gpu-ids", value], keep_overrides=False)
        assert isinstance(ours, TrainSpec)
        got = list(ours.gpu_ids) if isinstance(ours.gpu_ids, tuple) else ours.gpu_ids
        assert got == theirs.gpu_ids, value


def _offline_runs(wandb_dir: Path) -> list[tuple[str, list[int], list[int], list[str]]]:
    """(run id, logged steps, steps with a video, files) of every offline W&B run, in the
    order they started, read with W&B's own reader of its `.wandb` files."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    runs = []
    for path in wandb_dir.glob("offline-run-*/run-*.wandb"):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        run_id, started, steps, videos = "", 0, [], []
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, started = record.run.run_id, record.run.start_time.ToNanoseconds()
            elif kind == "history":
                steps.append(record.history.step.num)
                keys = {item.key or item.nested_key[0] for item in record.history.item}
                if "video" in keys:
                    videos.append(record.history.step.num)
        files = sorted(p.name for p in (path.parent / "files").iterdir())
        runs.append((started, run_id, steps, videos, files))
    return [run[1:] for run in sorted(runs)]


# Small offscreen frames without shadows: Mesa renders them in milliseconds on a CPU.
SMALL_VIDEO = ["--video", "True", "--video-length", "2"]
SMALL_VIDEO += ["--env.viewer.width", "64", "--env.viewer.height", "48"]
SMALL_VIDEO += ["--env.viewer.enable-shadows", "False", "--env.viewer.enable-reflections", "False"]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """mjlab's default logger (W&B, offline) on 2 ranks recording videos, through a
    preemption, a crash and a resume: (run directory, W&B folder, the iteration of the stop)."""
    tmp = tmp_path_factory.mktemp("wandb")
    env = cli_env({"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "MUJOCO_GL": "egl"})
    root = tmp / "logs"
    # 32 env steps per iteration: a video every 2 iterations.
    common = [CARTPOLE, "--env.scene.num-envs", "16", "--torch-threads", "1"]
    common += ["--save-interval", "100", "--log-root", str(root)]
    common += [*SMALL_VIDEO, "--video-interval", "64"]
    # A time-limit warning (USR2) on the local executor: checkpoint, requeue, the requeued
    # start finishes.
    cmd = [BIN / "mjlab-submit", *common, "--max-iterations", "6", "--executor", "local"]
    cmd += ["--gpus-per-node", "0", "--tasks-per-node", "2", "--follow"]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = wait_for_iteration(root, 1, timeout=300)
    for pid in rank_pids(run):
        os.kill(pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    (stop,) = [json.loads(line) for line in run.restarts.read_text().splitlines()]
    assert stop["kind"] == "requeue" and stop["iteration"] < 6, stop
    # A crash after the stop, as the disk shows it: the last checkpoint never written, W&B
    # holding steps the newest checkpoint is behind.
    for name in ("model_6.pt", "model_6.pt.sha256"):
        (run.path / name).unlink()
    resume = ["--max-iterations", "8", "--num-procs", "2", "--run-dir", str(run.path)]
    again = subprocess.run(
        [BIN / "mjlab-train", *common, *resume],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    return run.path, tmp / "wandb", int(stop["iteration"])


@pytest.mark.slow
def test_one_wandb_run_across_a_requeue_a_crash_and_a_resume(wandb_run) -> None:
    run, wandb_dir, stopped_at = wandb_run
    book = json.loads((run / WANDB_RECORD).read_text())
    runs = _offline_runs(wandb_dir)
    # Three starts (the first, its requeue, the resume), one W&B run id: the run's.
    assert [run_id for run_id, _, _, _ in runs] == [book["id"]] * 3
    # rsl-rl logs iteration n at step n - 1. The resume computed iterations stopped_at + 1..6
    # again (its checkpoint was the stop's) without handing W&B those steps a second time.
    steps = [s for _, run_steps, _, _ in runs for s in run_steps]
    assert steps == list(range(8)), [r[1] for r in runs]
    assert [r[1] for r in runs] == [list(range(stopped_at)), list(range(stopped_at, 6)), [6, 7]]
    assert book["last_step"] == 7
    # Tensorboard (rsl-rl's W&B writer writes it too): each step once, the recomputed ones
    # replacing what the crashed start wrote.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("Loss/learning_rate")] == list(range(8))
    # Checkpoints reach W&B by their names (a W&B run is searched for model_<n>.pt).
    uploaded = {f for r in runs for f in r[3] if f.endswith((".pt", ".tmp"))}
    assert uploaded == {f"model_{stopped_at}.pt", "model_6.pt", "model_8.pt"}, uploaded


@pytest.mark.slow
def test_videos_come_from_the_writer_alone_and_reach_wandb_once(wandb_run) -> None:
    """mjlab's --video on 2 ranks, on this CPU machine (Mesa's EGL): rank 0 records, every
    video is uploaded once, its numbering goes on across restarts."""
    run, wandb_dir, _ = wandb_run
    logs = RunDir(run)
    assert "recording videos" in logs.rank_log(0).read_text()
    assert "recording videos" not in logs.rank_log(1).read_text()
    # Videos start every 64 env steps of the writer: iterations 1, 3, 5 and 7.
    videos = sorted((run / "videos" / "train").iterdir(), key=lambda p: p.stat().st_mtime)
    assert [v.name for v in videos] == [f"rl-video-step-{n}.mp4" for n in (0, 64, 128, 192)]
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(videos[0]), "ffmpeg")  # (list() would ask its len: inf)
    first = reader.get_data(0)
    assert reader.count_frames() == 2 and first.shape == (48, 64, 3) and first.max() > 0
    uploads = [s for r in _offline_runs(wandb_dir) for s in r[2]]
    assert len(uploads) == len(set(uploads)) == len(videos), uploads


@pytest.mark.slow
def test_start_from_a_wandb_checkpoint_with_the_nan_guard(wandb_run, tmp_path: Path) -> None:
    """mjlab's `--agent.resume True --wandb-run-path ...`: a new run starts from the
    downloaded checkpoint (found in the experiment's W&B folder: no network needed) at
    iteration 0, with mjlab's NaN guard dumping into the run."""
    source, _, _ = wandb_run
    cache = tmp_path / "cartpole" / CHECKPOINT_CACHE / "abcd1234"
    cache.mkdir(parents=True)
    shutil.copy(source / "model_8.pt", cache / "model_8.pt")
    cmd = [BIN / "mjlab-train", CARTPOLE, "--torch-threads", "1", "--env.scene.num-envs", "16"]
    cmd += ["--agent.max-iterations", "2", "--agent.logger", "tensorboard"]
    cmd += ["--agent.resume", "True", "--wandb-run-path", "ent/proj/abcd1234"]
    cmd += ["--wandb-checkpoint-name", "model_8.pt", "--enable-nan-guard", "True"]
    cmd += ["--torchrunx-log-dir", "ignored", "--log-root", str(tmp_path)]
    proc = subprocess.run(
        cmd,
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run(tmp_path)
    assert f"started from {cache / 'model_8.pt'}" in run.rank_log(0).read_text()
    effective = json.loads(run.record.read_text())["effective"]
    assert effective["start_checkpoint"] == str((cache / "model_8.pt").resolve())
    summary = json.loads(run.summary.read_text())
    assert (summary["resumed_from"], summary["iterations"]) == (0, 2)
    assert [r["iteration"] for r in progress_records(run)] == [1, 2]
    env_yaml = (run.params / "env.yaml").read_text()
    guard = env_yaml[env_yaml.index("nan_guard:") :].splitlines()[1:4]
    assert guard[0].strip() == "enabled: true"
    assert guard[2].strip() == f"output_dir: {run.path / 'nan_dumps' / 'rank0'}"
    assert not (tmp_path / "ignored").exists()  # --torchrunx-log-dir: accepted, no effect


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (
            [CARTPOLE, "--agent.resume", "True", "--wandb-run-path", "ent/proj/nothere"],
            "--wandb-run-path",
        ),
        (
            [CARTPOLE, "--agent.resume", "True", "--agent.load-run", "no-such-run"],
            "--agent.load-run",
        ),
        ([TRACKING], "--env.commands.motion.motion-file"),
        ([TRACKING, "--registry-name", "ent/proj/no-motion"], "--registry-name"),
        (["cartpole", "--video", "True"], "--video"),
    ],
)
def test_what_cannot_work_stops_before_anything_exists(
    args: list[str],
    flag: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W&B without network, a run that is not there, a motion nobody gave: one line naming
    the flag, exit 2, nothing created (mjlab's train would fail after making its run)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code = train_main([*args, "--log-root", str(tmp_path / "logs")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.startswith(f"error: {flag}:"), err
    assert not (tmp_path / "logs").exists()

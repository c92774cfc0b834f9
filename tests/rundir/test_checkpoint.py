"""Checkpoints survive kills, damage, hostile files and retention.

A SIGKILL during writes never leaves a broken newest checkpoint. Damaged checkpoints (or their
ranks' states) are skipped, and retention keeps the newest. A checkpoint or rank state that
holds code (another user of a shared run directory wrote it) is refused by name, never run.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BIN, cli_env, only_run

from mjlab_hpc.rundir.checkpoint import (
    Checkpoints,
    cannot_continue,
    env_states_pruned,
    load_rank_state,
    load_verified,
    publish_rank_states,
    save_checkpoint,
    write_rank_state,
)
from mjlab_hpc.rundir.layout import list_checkpoints
from mjlab_hpc.rundir.record import read_record


class Kind(enum.Enum):
    ONE = 1


class Settings:
    """A config class with an enum class inside (pickled through the outer class)."""

    class Mode(enum.Flag):
        A = 1
        B = 2


class RunsCommand:
    """What another user slips into a checkpoint: unpickling it runs `touch MARKER`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (subprocess.call, (["touch", str(self.marker)],))


def _poison(path: Path, marker: Path) -> None:
    """Add an object that runs a command to a torch.save file, and a matching checksum
    (the same sidecar header: whoever can write the file can write its sidecar)."""
    state = torch.load(path, weights_only=True, map_location="cpu")  # a file we wrote
    buf = __import__("io").BytesIO()
    torch.save({**state, "extra": RunsCommand(marker)}, buf)
    path.write_bytes(buf.getvalue())
    sidecar = path.with_name(path.name + ".sha256")
    lines = sidecar.read_text().splitlines() if sidecar.exists() else [""]
    lines[0] = hashlib.sha256(buf.getvalue()).hexdigest()
    sidecar.write_text("\n".join(lines) + "\n")


@pytest.mark.training
def test_sigkill_during_checkpoint_writes_keeps_a_valid_one(tmp_path: Path) -> None:
    """A writer SIGKILLed at random moments while writing checkpoints: the newest checkpoint
    on disk always loads, and no truncated file ever carries a checkpoint's name."""
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from mjlab_hpc.rundir.checkpoint import save_checkpoint\n"
        "d = Path(sys.argv[1]); n = int(sys.argv[2])\n"
        "print('ready', flush=True)\n"
        "for i in range(n, n + 1000):\n"
        "    save_checkpoint(d / f'model_{i}.pt', {'iter': i, 'w': torch.full((400_000,), i)})\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_checkpoint(run_dir / "model_0.pt", {"iter": 0, "w": torch.zeros(400_000)})
    rng = random.Random(0)
    newest = []
    for trial in range(6):
        p = subprocess.Popen(
            [sys.executable, str(writer), str(run_dir), str(1000 * (trial + 1))],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdout.readline() == "ready\n"  # imports done
        time.sleep(rng.uniform(0.05, 0.6))  # into the writes
        p.kill()
        p.wait()
        path, damaged = Checkpoints(run_dir).newest_valid()
        assert path is not None and not damaged
        assert path == list_checkpoints(run_dir)[-1]  # the newest name is never a broken file
        ckpt = load_verified(path)
        assert torch.equal(ckpt["w"], torch.full((400_000,), ckpt["iter"]))
        newest.append(ckpt["iter"])
    # The writer really wrote: most kills landed after some checkpoints of that trial.
    assert sum(n >= 1000 for n in newest) >= 4, newest


def test_corrupt_newest_checkpoint_is_skipped(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        save_checkpoint(tmp_path / f"model_{i}.pt", {"iter": i, "w": torch.arange(1000) * i})
    newest = tmp_path / "model_3.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # truncated after the fact
    data = bytearray((tmp_path / "model_2.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (tmp_path / "model_2.pt").write_bytes(bytes(data))
    path, damaged = Checkpoints(tmp_path).newest_valid()
    assert path is not None and path.name == "model_1.pt"
    assert load_verified(path)["iter"] == 1
    mismatched = [(d.name, "does not match its checksum" in d.why) for d in damaged]
    assert mismatched == [("model_3.pt", True), ("model_2.pt", True)]


def test_keep_last_n_counts_only_checkpoints_that_verify(tmp_path: Path) -> None:
    for i in range(1, 6):
        save_checkpoint(tmp_path / f"model_{i}.pt", {"iter": i})
    (tmp_path / "model_5.pt").write_bytes(b"torn")  # the newest is damaged
    checkpoints = Checkpoints(tmp_path)
    deleted = checkpoints.prune(2)
    # Two valid ones are kept (3, 4); the damaged one is neither counted nor deleted.
    assert [p.name for p in deleted] == ["model_1.pt", "model_2.pt"]
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["model_3.pt", "model_4.pt", "model_5.pt"]
    assert not (tmp_path / "model_1.pt.sha256").exists()
    assert checkpoints.prune(0) == []
    valid, damaged = checkpoints.newest_valid()
    assert valid is not None and valid.name == "model_4.pt"
    assert [d.name for d in damaged] == ["model_5.pt"]
    checkpoints.set_aside(damaged)
    assert (tmp_path / "model_5.pt.damaged").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["model_3.pt", "model_4.pt"]


def _with_rank_states(run_dir: Path, n: int, world_size: int = 2, run: str = "r") -> Path:
    path = run_dir / f"model_{n}.pt"
    belongs = {"run": run, "task": "cartpole", "iteration": n}
    written = [
        write_rank_state(path, r, world_size, {"env": torch.full((100 + r,), n + r)}, belongs)
        for r in range(world_size)
    ]
    listed = publish_rank_states(path, written, lambda: None)
    header = {**belongs, "world_size": world_size, "rank_states": listed}
    save_checkpoint(path, {"iter": n}, header=header)
    return path


def test_a_checkpoint_counts_only_with_every_rank_state_verifying(tmp_path: Path) -> None:
    """Each rank's state beside the model file: a damaged or missing one makes the whole
    checkpoint damaged (set aside with its states); pruning removes the states too."""
    for n in (1, 2, 3):
        _with_rank_states(tmp_path, n)
    belongs = {"run": "r", "task": "cartpole", "iteration": 3}
    state = load_rank_state(tmp_path / "model_3.pt", rank=1, world_size=2, belongs=belongs)
    assert state["env"][0] == 4
    states = tmp_path / "rank_states"
    damaged = states / "model_3" / "rank1-of-2.pt"
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (states / "model_2" / "rank0-of-2.pt").unlink()
    checkpoints = Checkpoints(tmp_path)
    path, bad = checkpoints.newest_valid()
    assert path == tmp_path / "model_1.pt"
    assert [d.name for d in bad] == ["model_3.pt", "model_2.pt"]
    assert "rank1-of-2.pt does not match its checksum" in bad[0].why
    assert "incomplete" in bad[1].why
    checkpoints.set_aside(bad)
    kept = sorted(p.name for p in states.iterdir())
    assert kept == ["model_1", "model_2.damaged", "model_3.damaged"]
    for n in (4, 5):
        _with_rank_states(tmp_path, n)
    assert [p.name for p in Checkpoints(tmp_path).prune(keep=2)] == ["model_1.pt"]
    assert not (states / "model_1").exists() and (states / "model_4").is_dir()


def test_environment_states_are_kept_for_the_newest_checkpoints_that_verify(
    tmp_path: Path,
) -> None:
    """--keep-env-states 2: every model stays, the rank states of the newest two checkpoints
    that verify with them stay; a damaged newest one is neither counted nor touched, a
    checkpoint being written (states, no model yet) is not touched, a prune stopped halfway
    leaves a pruned checkpoint (not a damaged one), and the one before them is refused
    without --fresh-envs."""
    for n in range(1, 7):
        _with_rank_states(tmp_path, n)
    states = tmp_path / "rank_states"
    torn = states / "model_6" / "rank1-of-2.pt"
    torn.write_bytes(torn.read_bytes()[:-1])  # the newest does not verify
    write_rank_state(tmp_path / "model_7.pt", 0, 2, {"env": torch.zeros(3)}, {})  # in progress
    checkpoints = Checkpoints(tmp_path)
    dropped = checkpoints.prune_env_states(2)
    assert [p.name for p in dropped] == ["model_3.pt", "model_2.pt", "model_1.pt"]
    assert not (states / "model_1").exists() and (states / "model_4").is_dir()
    assert len(list((states / "model_6").iterdir())) == 4  # damaged: untouched
    assert len(list((states / "model_7").iterdir())) == 1  # its temporary file: untouched
    assert checkpoints.prune_env_states(2) == [] and checkpoints.prune_env_states(0) == []
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"model_{n}.pt" for n in range(1, 7)]
    fresh = Checkpoints(tmp_path)
    assert fresh.newest_valid()[0] == tmp_path / "model_5.pt"  # restorable: states kept
    assert fresh.problem(tmp_path / "model_1.pt") is None  # pruned: its model stands alone
    assert env_states_pruned(tmp_path / "model_1.pt")
    assert not env_states_pruned(tmp_path / "model_4.pt")
    assert load_verified(tmp_path / "model_1.pt")["iter"] == 1
    # Halfway: the sidecar says so, then the files go; stopped between, pruned, not damaged.
    sidecar = tmp_path / "model_4.pt.sha256"
    digest, header = sidecar.read_text().splitlines()
    sidecar.write_text(
        f"{digest}\n{json.dumps({**json.loads(header), 'rank_states_pruned': True})}\n"
    )
    assert Checkpoints(tmp_path).problem(tmp_path / "model_4.pt") is None
    assert env_states_pruned(tmp_path / "model_4.pt")
    # With the newer ones damaged, the checkpoint left has no states: --fresh-envs, said.
    for n in (4, 5, 6):
        (tmp_path / f"model_{n}.pt").write_bytes(b"torn")
    refusal = cannot_continue(Checkpoints(tmp_path), "cartpole", restart_from_scratch=False)
    assert refusal is not None and refusal.flag == "--fresh-envs", refusal
    assert "model_3.pt" in refusal.problem and "were pruned" in refusal.problem
    assert "model_6.pt, model_5.pt, model_4.pt are damaged" in refusal.problem
    again = Checkpoints(tmp_path)
    assert cannot_continue(again, "cartpole", restart_from_scratch=False, fresh_envs=True) is None


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap")
    for x, y in ((a, b), (a.with_name(a.name + ".sha256"), b.with_name(b.name + ".sha256"))):
        x.rename(tmp)
        y.rename(x)
        tmp.rename(y)


def test_a_rank_state_counts_only_where_it_belongs(tmp_path: Path) -> None:
    """Issue 41: rank states swapped with their checksums, one from another run, a model file
    of another task or renamed: each makes its checkpoint damaged, and the one before is
    used; a rank state's own header is checked again when it is loaded."""
    other = tmp_path / "other"
    other.mkdir()
    _with_rank_states(other, 4, run="other")
    for n in (2, 4, 6, 8, 10):
        _with_rank_states(tmp_path, n)
    folder = tmp_path / "rank_states"
    _swap(folder / "model_10" / "rank0-of-2.pt", folder / "model_10" / "rank1-of-2.pt")
    for name in ("rank1-of-2.pt", "rank1-of-2.pt.sha256"):  # another run's, with its checksum
        (other / "rank_states" / "model_4" / name).replace(folder / "model_8" / name)
    (tmp_path / "model_4.pt").replace(tmp_path / "model_6.pt")  # renamed over it
    (tmp_path / "model_4.pt.sha256").replace(tmp_path / "model_6.pt.sha256")
    checkpoints = Checkpoints(tmp_path, "ant")
    path, bad = checkpoints.newest_valid()
    assert path is None  # every model file here says task cartpole
    checkpoints = Checkpoints(tmp_path, "cartpole")
    path, bad = checkpoints.newest_valid()
    assert path == tmp_path / "model_2.pt", bad
    why = {d.name: d.why for d in bad}
    swapped = "rank0-of-2.pt of model_10.pt is not the state rank 0 saved: it is rank 1's"
    assert swapped in why["model_10.pt"]
    assert "rank1-of-2.pt of model_8.pt" in why["model_8.pt"]
    assert "holds" in why["model_8.pt"] or "another checkpoint's or run's" in why["model_8.pt"]
    assert why["model_6.pt"] == "model_6.pt holds iteration 4 (a file renamed or copied over it)"
    problem = Checkpoints(tmp_path, "ant").problem(tmp_path / "model_2.pt")
    assert "task 'cartpole', not 'ant'" in problem
    # Loading checks the state's own header (what a sidecar cannot vouch for).
    with pytest.raises(ValueError, match="belongs to run 'r', not 'other'"):
        other_run = {"run": "other", "task": "cartpole", "iteration": 2}
        load_rank_state(tmp_path / "model_2.pt", rank=0, world_size=2, belongs=other_run)


@pytest.mark.parametrize("kind", ["dev-zero", "directory", "fifo", "sparse"])
def test_nothing_but_a_plausible_file_is_read(tmp_path: Path, kind: str) -> None:
    """A rank state (or a model file) that is a symlink to /dev/zero, a directory, a FIFO or
    a file far larger than was saved is refused by name, unread: the checkpoint is damaged,
    the one before is used."""
    import os
    import resource

    for n in (1, 2):
        _with_rank_states(tmp_path, n)
    for target in (tmp_path / "rank_states" / "model_2" / "rank1-of-2.pt", tmp_path / "model_2.pt"):
        target.unlink()
        if kind == "dev-zero":
            target.symlink_to("/dev/zero")
        elif kind == "directory":
            target.mkdir()
        elif kind == "fifo":
            os.mkfifo(target)
        else:
            with open(target, "wb") as f:
                f.truncate(1 << 40)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        path, bad = Checkpoints(tmp_path).newest_valid()
        assert path == tmp_path / "model_1.pt" and [d.name for d in bad] == ["model_2.pt"]
        what = {
            "dev-zero": "is a character device, not a file",
            "directory": "is a directory",
            "fifo": "is a FIFO",
            "sparse": "bytes, more than",
        }[kind]
        assert target.name in bad[0].why and what in bad[0].why, bad[0].why
        assert time.monotonic() - started < 5
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_a_file_that_holds_code_is_refused_by_name_and_never_run(tmp_path: Path) -> None:
    """A model file or a rank state with an object that runs a command, and a checksum that
    matches, is refused by name (set aside as damaged; the one before is used), and loading
    it directly refuses too: the command never runs. So is a raw pickle without a sidecar.
    What we write is plain data: a state that is not is never written."""
    marker = tmp_path / "MARKER"
    for n in (1, 2, 3):
        _with_rank_states(tmp_path, n)
    _poison(tmp_path / "model_3.pt", marker)
    state = tmp_path / "rank_states" / "model_2" / "rank1-of-2.pt"
    _poison(state, marker)
    sidecar = tmp_path / "model_2.pt.sha256"  # the model's header lists it as saved
    digest, header = sidecar.read_text().splitlines()
    listed = json.loads(header)
    listed["rank_states"][1] = [
        hashlib.sha256(state.read_bytes()).hexdigest(),
        state.stat().st_size,
    ]
    sidecar.write_text(f"{digest}\n{json.dumps(listed)}\n")
    with open(tmp_path / "model_4.pt", "wb") as f:
        pickle.dump({"iter": 4, "extra": RunsCommand(marker)}, f)
    checkpoints = Checkpoints(tmp_path)
    path, damaged = checkpoints.newest_valid()
    assert path is not None and path.name == "model_1.pt"
    why = {d.name: d.why for d in damaged}
    assert list(why) == ["model_4.pt", "model_3.pt", "model_2.pt"]
    assert why["model_3.pt"].startswith("model_3.pt holds more than weights"), why
    assert "GLOBAL" in why["model_3.pt"] and ".call" in why["model_3.pt"]
    assert "rank1-of-2.pt holds more than weights (GLOBAL " in why["model_2.pt"]
    assert "model_4.pt" in why["model_4.pt"] and "refused" in why["model_4.pt"]
    for load in (
        lambda: load_verified(tmp_path / "model_3.pt"),
        lambda: load_verified(tmp_path / "model_4.pt"),
        lambda: load_rank_state(tmp_path / "model_2.pt", 1, 2, {}),
    ):
        with pytest.raises(ValueError, match="refused"):
            load()
    assert not marker.exists()
    checkpoints.set_aside(damaged)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["model_1.pt"]

    # A state that names a class, even an enum's, is never written (it would not load).
    path = tmp_path / "model_5.pt"
    belongs = {"run": "r", "task": "cartpole", "iteration": 5}
    for value in (Kind.ONE, Settings.Mode.A | Settings.Mode.B, np.float32(0.5)):
        with pytest.raises(TypeError, match="more than plain data"):
            write_rank_state(path, 0, 1, {"value": value}, belongs)
    assert not (tmp_path / "rank_states" / "model_5").exists()


def test_an_old_rank_states_enum_builds_nothing_but_its_value(tmp_path: Path) -> None:
    """A rank state in the old format whose simulator enum is called with anything but a
    plain value (a command's argument list) is refused by name; nothing runs."""
    from mujoco import mjtState

    marker = tmp_path / "MARKER"

    class Disguised:
        def __reduce__(self) -> tuple:
            return (mjtState, (["touch", str(marker)],))

    path = tmp_path / "model_1.pt"
    belongs = {"run": "r", "task": "cartpole", "iteration": 1}
    state = {"env": Disguised(), "numpy_rng": np.random.get_state(), "belongs": belongs}
    folder = tmp_path / "rank_states" / "model_1"
    folder.mkdir(parents=True)
    save_checkpoint(folder / "rank0-of-1.pt", state)
    listed = [[hashlib.sha256((folder / "rank0-of-1.pt").read_bytes()).hexdigest(), 0]]
    listed[0][1] = (folder / "rank0-of-1.pt").stat().st_size
    save_checkpoint(path, {"iter": 1}, header={**belongs, "rank_states": listed})
    assert Checkpoints(tmp_path).problem(path) is None  # its names are an old state's
    with pytest.raises(ValueError, match=r"rank0-of-1\.pt holds more than weights.*refused"):
        load_rank_state(path, 0, 1, belongs)
    assert not marker.exists()


MAIN_RUNS = Path(__file__).parent / "data"


def test_checkpoints_written_by_main_d42f375_verify_and_load() -> None:
    """Models and rank states written before states were plain data (numpy's generator
    state, numpy scalars, the simulator's enums): they verify, the models load with a plain
    weights-only load, and the rank states load with their enums as their values, without
    importing the classes they name or changing how other code loads (checked in a fresh
    interpreter)."""
    models = []
    for run in ("main-cartpole", "main-mjlab-cartpole-balance"):
        folder = MAIN_RUNS / run
        task = json.loads((folder / "run.json").read_text())["spec"]["task"]
        models.append(folder / "model_2.pt")
        assert Checkpoints(folder, task).newest_valid() == (models[-1], [])
        assert torch.load(models[-1], weights_only=True)["iter"] == 2
        assert torch.serialization.get_unsafe_globals_in_checkpoint(
            folder / "rank_states" / "model_2" / "rank0-of-1.pt"
        )  # the old format: a plain weights-only load refuses it
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from mjlab_hpc.rundir.checkpoint import load_rank_state, load_verified\n"
        "ends = ('origin_type', 'broadphase', 'transmission_type')\n"
        "for model in map(Path, sys.argv[1:]):\n"
        "    env = load_verified(model)['infos']['environments']\n"
        "    belongs = {k: env[k] for k in ('run', 'task', 'iteration')}\n"
        "    state = load_rank_state(model, 0, 1, belongs)\n"
        "    values = {p: v[4] for p, v in state['env'].items() if p.endswith(ends)}\n"
        "    print(json.dumps({'values': values, 'key': len(state['numpy_rng'][1])}))\n"
        "print(json.dumps({'imported': [m for m in ('mjlab', 'mujoco_warp') if m in sys.modules],\n"
        "    'flag': os.environ.get('TORCH_FORCE_WEIGHTS_ONLY_LOAD')}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, models)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    builtin, mjlab, process = (json.loads(x) for x in done.stdout.splitlines()[-3:])
    assert builtin == {"values": {}, "key": 624}
    assert mjlab["key"] == 624
    assert mjlab["values"]["env.cfg.viewer.origin_type"] == 4  # ViewerConfig.OriginType
    assert mjlab["values"]["env.sim._wp_model.opt.broadphase"] == 0  # mujoco_warp's enum
    assert mjlab["values"]["env.cfg.actions['effort'].transmission_type"] == "joint"
    assert process == {"imported": [], "flag": None}


@pytest.mark.training
@pytest.mark.parametrize(
    "run", ["main-cartpole", pytest.param("main-mjlab-cartpole-balance", marks=pytest.mark.mjlab)]
)
def test_runs_written_by_main_d42f375_continue_exactly(run: str, tmp_path: Path) -> None:
    """A run written before rank states were plain data, continued by this code: its
    environments are restored (nothing left unplaced), and its next checkpoint is the one a
    run that never stopped writes, bit for bit."""
    if "mjlab" in run and os.environ.get("CI") != "true":
        pytest.importorskip("mjlab", reason="mjlab is not installed")
    spec = json.loads((MAIN_RUNS / run / "run.json").read_text())["spec"]
    copy = tmp_path / "logs" / "cartpole" / "2026-11-29_08-00-00"
    shutil.copytree(MAIN_RUNS / run, copy)
    args = [spec["task"], "--num-envs", "4", "--torch-threads", "1", "--save-interval", "2"]
    args += list(spec["overrides"])  # mjlab's logger: tensorboard, as it was trained

    def train(*more: str) -> None:
        done = subprocess.run(
            [BIN / "mjlab-train", *args, "--max-iterations", "3", *more],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]

    train("--run-dir", str(copy))
    last = read_record(copy).last_start
    assert last.environments == "restored" and last.resumed_from_iteration == 2
    assert "not restored" not in (copy / "logs" / "rank0.log").read_text()
    train("--log-root", str(tmp_path / "straight"))
    ours = torch.load(copy / "model_3.pt", weights_only=True)
    straight = torch.load(only_run(tmp_path / "straight").checkpoint(3), weights_only=True)
    for part in ("actor_state_dict", "critic_state_dict"):
        assert ours[part].keys() == straight[part].keys()
        assert all(torch.equal(v, straight[part][k]) for k, v in ours[part].items()), part


@pytest.mark.training
def test_resume_and_dry_run_refuse_a_checkpoint_that_holds_code(tmp_path: Path) -> None:
    """Another user adds an object that runs a command to model_4.pt (with a checksum that
    matches) and a raw pickled model_99.pt: `mjlab-submit --dry-run` and `mjlab-train
    --resume` name both, set them aside and resume from model_2.pt; the command never ran."""
    root, marker = tmp_path / "logs", tmp_path / "MARKER"
    args = ["cartpole", "--num-envs", "16", "--torch-threads", "1", "--save-interval", "2"]
    args += ["--log-root", str(root)]
    first = subprocess.run(
        [BIN / "mjlab-train", *args, "--max-iterations", "4"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(root)
    _poison(run.checkpoint(4), marker)
    with open(run.checkpoint(99), "wb") as f:
        pickle.dump({"iter": 99, "extra": RunsCommand(marker)}, f)

    dry = subprocess.run(
        [BIN / "mjlab-submit", *args, "--max-iterations", "6", "--resume", "--dry-run"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = " ".join((dry.stdout + dry.stderr).split())
    assert not marker.exists(), said
    assert dry.returncode == 0, said[-2000:]
    assert "skipping damaged checkpoint model_99.pt: model_99.pt" in said
    assert "skipping damaged checkpoint model_4.pt: model_4.pt holds more than weights" in said
    assert "Detected pickle protocol" not in said
    resumed = subprocess.run(
        [BIN / "mjlab-train", *args, "--max-iterations", "6", "--resume"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not marker.exists()
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = " ".join(resumed.stderr.split())
    assert "skipped damaged checkpoint model_4.pt: model_4.pt holds more than weights" in said
    assert "skipped damaged checkpoint model_99.pt: model_99.pt" in said
    record = read_record(run.path)
    assert record.starts[-1].resumed_from_iteration == 2
    assert {s.name for s in record.skipped_checkpoints} == {"model_4.pt", "model_99.pt"}
    assert (run.path / "model_4.pt.damaged").exists() and run.checkpoint(6).exists()
    assert json.loads(run.summary.read_text())["iterations"] == 6

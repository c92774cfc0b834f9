"""mjlab's tasks on a node without EGL or OSMesa (containers, minimal GPU images).

mjlab makes EGL MuJoCo's default and MuJoCo loads it when imported, so without a loader an
mjlab task would fail to import. Here the machine's GL libraries are made unloadable for real
(each one replaced by an empty file in a private mount namespace, as root). Training works
without --video, and --video is one clear line before anything starts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, cli_env, only_run

pytestmark = [pytest.mark.mjlab, pytest.mark.training]

CARTPOLE = "Mjlab-Cartpole-Balance"
LIBS = Path("/usr/lib/x86_64-linux-gnu")
# Each of these, emptied: dlopen fails as where the file is missing.
HIDE = ("libEGL*.so*", "libGL*.so*", "libOpenGL*.so*", "libOSMesa*.so*")


def without_gl(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`command` where no GL library loads: an empty file bind-mounted over each one."""
    if os.geteuid() != 0 or not LIBS.is_dir():
        why = "needs root (a private mount namespace) and Debian's library folder"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    hide = " ".join(f"{LIBS}/{pattern}" for pattern in HIDE)
    script = f'for f in {hide}; do [ -f "$f" ] && mount --bind /dev/null "$f"; done; exec "$@"'
    wrap = ["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "bash"]
    return subprocess.run([*wrap, *command], env=env, capture_output=True, text=True, timeout=600)


def test_without_gl_libraries_mjlab_tasks_train_and_video_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env().items() if k != "MUJOCO_GL"}
    args = [str(BIN / "mjlab-train"), CARTPOLE, "--num-procs", "2", "--num-envs", "8"]
    args += ["--max-iterations", "1", "--torch-threads", "1", "--agent.logger", "tensorboard"]

    # The check itself: in the namespace, EGL does not load.
    probe = "from mjlab_hpc.tasks.video import gl_unloadable as g; print(g('egl'))"
    seen = without_gl([str(BIN / "python"), "-c", probe], env)
    assert "libEGL" in seen.stdout and "libegl1" in seen.stdout, seen.stdout + seen.stderr

    trained = without_gl([*args, "--log-root", str(tmp_path / "plain")], env)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "note: rendering is off (MUJOCO_GL=disable): MUJOCO_GL=egl needs libEGL" in (
        trained.stderr
    )
    run = only_run(tmp_path / "plain")
    for rank in (0, 1):
        assert "MUJOCO_GL=disable" in run.rank_log(rank).read_text()

    video = without_gl([*args, "--video", "--log-root", str(tmp_path / "video")], env)
    assert video.returncode == 2, video.stdout + video.stderr
    lines = video.stderr.strip().splitlines()
    assert lines == [
        "error: --video: MUJOCO_GL=egl needs libEGL and libOpenGL (or libGL), which this "
        "machine cannot load (Debian: libegl1 libegl-mesa0 libgl1-mesa-dri); install them, or "
        "drop --video"
    ], video.stderr
    assert not (tmp_path / "video").exists()  # nothing was made

    # A GL asked for by name that does not load: one line, naming it.
    named = without_gl([*args, "--log-root", str(tmp_path / "named")], {**env, "MUJOCO_GL": "egl"})
    assert named.returncode == 2 and "MUJOCO_GL" in named.stderr, named.stderr
    assert "Traceback" not in named.stderr, named.stderr

"""Videos of training as mjlab's train records them (`--video`), and offscreen GL.

The writer rank records env 0 into <run>/videos/train, rendered offscreen (MUJOCO_GL=egl or
osmesa). On a GPU it renders on the EGL device of its own CUDA device (EGL numbers devices in
its own order); on a CPU machine Mesa's software EGL renders (docs/mjlab.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mjlab_hpc.procs import run_command

__all__ = [
    "Recording",
    "egl_device_for_cuda",
    "egl_device_id",
    "gl_backend",
    "gl_unloadable",
    "prepare_gl",
    "record_videos",
    "rendering_problem",
    "use_ffmpeg",
]

# EGL_NV_device_cuda: the CUDA device (this process's numbering) of an EGL device.
_EGL_CUDA_DEVICE_NV = 0x323A
# One tiny offscreen render in a fresh process (a broken GL driver may crash it).
_PROBE = """
import mujoco
m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><geom size=".1"/></worldbody></mujoco>')
d = mujoco.MjData(m)
r = mujoco.Renderer(m, 16, 16)
mujoco.mj_forward(m, d)
r.update_scene(d)
r.render()
r.close()
print("rendered")
"""


@dataclass(frozen=True)
class Recording:
    """What the writer records (mjlab's --video-length and --video-interval)."""

    folder: str
    """Where the mp4 files go (<run>/videos/train)."""
    length: int
    """Frames per video."""
    interval: int
    """A video starts every this many env steps."""


def gl_backend() -> str:
    """Return the offscreen GL MuJoCo uses here (mjlab makes egl the default on Linux)."""
    default = "egl" if sys.platform.startswith("linux") else "glfw"
    return os.environ.get("MUJOCO_GL", default).lower()


# The libraries each MUJOCO_GL loads when MuJoCo is imported (PyOpenGL's platforms): any one of
# each group; install hints for Debian.
_GL_LIBRARIES = {
    "egl": ((("EGL",), ("OpenGL", "GL")), "libegl1 libegl-mesa0 libgl1-mesa-dri"),
    "osmesa": ((("OSMesa",),), "libosmesa6"),
}


def _loads(names: tuple[str, ...]) -> bool:
    for name in names:
        path = ctypes.util.find_library(name)
        if path is None:
            continue
        try:
            ctypes.CDLL(path)
        except OSError:  # listed, but not loadable (a broken or emptied file)
            continue
        return True
    return False


def gl_unloadable(backend: str | None = None) -> str | None:
    """Say why the GL library of `backend` cannot load here, and what to install.

    `backend` defaults to the one MuJoCo will use here. None: it loads, or MuJoCo loads none.
    """
    backend = backend or gl_backend()
    if backend not in _GL_LIBRARIES or not sys.platform.startswith("linux"):
        return None
    groups, debian = _GL_LIBRARIES[backend]
    missing = [
        names[0] + "".join(f" (or {n})" for n in names[1:]) for names in groups if not _loads(names)
    ]
    if not missing:
        return None
    libs = " and ".join(f"lib{name}" for name in missing).replace("(or ", "(or lib")
    return f"MUJOCO_GL={backend} needs {libs}, which this machine cannot load (Debian: {debian})"


def prepare_gl() -> str | None:
    """Set MUJOCO_GL=disable where it is unset and EGL does not load; say so, or return None.

    A node without EGL then trains, rendering nothing. Call it before MuJoCo is first
    imported for mjlab: mjlab makes egl the default, and MuJoCo loads it at import.
    """
    if "MUJOCO_GL" in os.environ:
        return None
    problem = gl_unloadable("egl")
    if problem is None:
        return None
    os.environ["MUJOCO_GL"] = "disable"
    return f"rendering is off (MUJOCO_GL=disable): {problem}; training renders nothing"


def rendering_problem(timeout_s: float = 120.0) -> str | None:
    """Say why MuJoCo cannot render offscreen on this machine (None: it can).

    One tiny render runs in a separate process with this environment.
    """
    env = {**os.environ, "MUJOCO_GL": gl_backend()}
    proc = run_command([sys.executable, "-c", _PROBE], timeout_s=timeout_s, env=env)
    if proc is not None and proc.returncode == 0 and "rendered" in proc.stdout:
        return None
    if proc is None:
        return f"MUJOCO_GL={env['MUJOCO_GL']}: a test render did not finish in {timeout_s:g} s"
    lines = [x.strip() for x in proc.stderr.splitlines() if x.strip()]
    last = lines[-1] if lines else f"exit code {proc.returncode}"
    return f"MUJOCO_GL={env['MUJOCO_GL']}: a test render failed ({last[:300]})"


def egl_device_for_cuda(ordinal: int) -> int | None:
    """Return the EGL device index of CUDA device `ordinal` (this process's numbering).

    It asks EGL_NV_device_cuda. None where EGL is not the backend or cannot say (no NVIDIA
    EGL, a driver without the extension).
    """
    if gl_backend() != "egl":
        return None
    try:
        from mujoco.egl import egl_ext as EGL

        address = EGL.eglGetProcAddress("eglQueryDeviceAttribEXT")
        if not address:
            return None
        query = ctypes.CFUNCTYPE(
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_ssize_t)
        )(address)
        for index, device in enumerate(EGL.eglQueryDevicesEXT()):
            value = ctypes.c_ssize_t(-1)
            found = query(device, _EGL_CUDA_DEVICE_NV, ctypes.byref(value))
            EGL.eglGetError()  # clear a failed query's error: MuJoCo checks it when it opens
            if found and value.value == ordinal:
                return index
    except Exception:
        return None
    return None


def egl_device_id(device: str, egl_of: Callable[[int], int | None] = egl_device_for_cuda) -> str:
    """Return MUJOCO_EGL_DEVICE_ID for a rank on `device` (`cuda:k`).

    It is the EGL device of CUDA device k of this process, whatever CUDA_VISIBLE_DEVICES
    holds (indices, UUIDs, one renumbered GPU). Where EGL cannot say it is k itself (the
    orders agree on most single-GPU tasks).
    """
    ordinal = int(device.partition(":")[2] or 0)
    egl = egl_of(ordinal)
    return str(ordinal if egl is None else egl)


def use_ffmpeg() -> None:
    """Make mediapy, which mjlab's VideoRecorder writes with, find an ffmpeg.

    It takes the one on PATH, else imageio-ffmpeg's binary.
    """
    if shutil.which("ffmpeg"):
        return
    try:
        import imageio_ffmpeg
        import mediapy

        mediapy.set_ffmpeg(imageio_ffmpeg.get_ffmpeg_exe())
    except Exception:  # mediapy then names the missing program itself
        pass


def record_videos(env: Any, recording: Recording) -> Any:
    """Wrap `env` in mjlab's VideoRecorder exactly as mjlab's train wraps it.

    `env` is a ManagerBasedRlEnv made with render_mode="rgb_array".
    """
    from mjlab.utils.wrappers import VideoRecorder

    use_ffmpeg()
    interval = recording.interval
    return VideoRecorder(
        env,
        video_folder=recording.folder,
        step_trigger=lambda step: step % interval == 0,
        video_length=recording.length,
        disable_logger=True,
    )

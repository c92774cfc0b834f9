"""The offline install for a GPU node without internet, beside the site's own torch.

`make wheelhouse` runs where an index is reachable, then `make install-offline` in a network
namespace of its own (no index, nothing else reachable). Its Python gets torch from outside
any venv (a folder on PYTHONPATH, as a site's module gives it). The venv trains, and torch is
still the site's. On a GPU machine the same runs beside the site's CUDA torch
(`make gpu-check WHEELHOUSE=...`, docs/testing.md).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.training, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def site_with_torch(folder: Path) -> None:
    """torch and what it needs, linked from this venv into `folder` (a site's torch module)."""
    folder.mkdir()
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        dist = md.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(source)


def make(*args: str, env: dict[str, str], offline: bool = False) -> subprocess.CompletedProcess:
    cmd = ["make", "--no-print-directory", "-C", str(REPO), *args]
    if offline:  # a network namespace of its own: no interface but loopback, which is down
        cmd = ["unshare", "--net", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_offline_install_beside_the_sites_torch(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        why = "needs root (a network namespace without a network)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    base = sys._base_executable  # the Python without this venv (a site's python3)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{Path(base).parent}{os.pathsep}{env.get('PATH', '')}"
    wheelhouse, venv, site = tmp_path / "wheelhouse", tmp_path / "venv", tmp_path / "site"
    made = make(f"WHEELHOUSE={wheelhouse}", f"PYTHON={base}", "wheelhouse", env=env)
    if made.returncode != 0 and os.environ.get("CI") != "true" and "network" in made.stderr:
        pytest.skip(f"no package index reachable to make the wheelhouse: {made.stderr[-300:]}")
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    wheels = {w.name.split("-")[0].lower() for w in wheelhouse.glob("*.whl")}
    assert {"warp_lang", "mujoco_warp", "rsl_rl_lib", "mjlab", "submitit"} <= wheels
    assert not {"torch", "torchvision", "triton"} & wheels
    assert not [w for w in wheels if w.startswith("nvidia")]

    site_with_torch(site)
    node = {**env, "PYTHONPATH": str(site), "PIP_CONFIG_FILE": os.devnull}
    node.pop("PIP_FIND_LINKS", None)
    args = [f"WHEELHOUSE={wheelhouse}", f"VENV={venv}", f"SITE_PYTHON={base}", f"PYTHON={base}"]
    installed = make(*args, "install-offline", env=node, offline=True)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert "without an index" in installed.stdout and "beside torch" in installed.stdout
    assert (venv / ".installed").exists()
    where = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "import torch, mjlab_hpc, mjlab; print(torch.__file__); print(mjlab_hpc.__file__)",
        ],
        env=node,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert where.returncode == 0, where.stderr
    torch_file, ours = where.stdout.split()
    assert torch_file.startswith(str(site)), torch_file  # the site's, not a copy in the venv
    assert ours.startswith(str(REPO)), ours  # editable: the checkout's code
    assert not list(venv.glob("lib/python*/site-packages/torch"))

    train = [venv / "bin" / "mjlab-train", "cartpole", "--num-envs", "4", "--max-iterations", "1"]
    train += ["--torch-threads", "1", "--log-root", str(tmp_path / "logs")]
    trained = subprocess.run(
        ["unshare", "--net", *train],
        env=node,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert "done: 1 iterations" in trained.stdout

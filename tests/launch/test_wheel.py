"""The installed package, not the source tree.

`pip wheel --no-deps .` builds a wheel that holds the templates (and nothing that does not
exist). In a fresh environment with that wheel installed the commands work: render,
list-tasks, a dry run, and a short training on two local ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import cli_env

pytestmark = [pytest.mark.training, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
_NOT_SOURCE = (
    ".venv",
    ".git",
    "logs",
    "bench-results",
    "build",
    "dist",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".gl",
    ".whl",
)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed; the dependencies come from the
    test's own environment (a .pth line), the package only from the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "dist").glob("mjlab_hpc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mjlab_hpc/slurm_templates/train.sbatch" in names
    assert "mjlab_hpc/slurm_templates/train_apptainer.sbatch" in names
    assert not [n for n in names if n.startswith("tests/")]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(
        subprocess.run(
            [venv / "bin" / "python", "-c", purelib], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip_install = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps"]
    installed = subprocess.run(
        [*pip_install, "--no-index", "--ignore-installed", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def run(
    venv: Path, *args: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = cli_env(path=f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_package_comes_from_the_wheel(wheel_env: Path, tmp_path: Path) -> None:
    proc = run(
        wheel_env, "python", "-c", "import mjlab_hpc; print(mjlab_hpc.__file__)", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(wheel_env)), proc.stdout


def test_render_list_tasks_and_dry_run(wheel_env: Path, tmp_path: Path) -> None:
    render_args = ["render", "train", "cartpole", "--gpus-per-node", "0", "--time", "10"]
    render = run(wheel_env, "mjlab-hpc", *render_args, cwd=tmp_path)
    assert render.returncode == 0, render.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(render.stdout)
    assert "#SBATCH --signal=USR2@90" in render.stdout
    assert "watch_step &" in render.stdout and "{{" not in render.stdout  # the heal loop
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    tasks = run(wheel_env, "mjlab-hpc", "list-tasks", cwd=tmp_path)
    assert tasks.returncode == 0 and "cartpole" in tasks.stdout and "ant" in tasks.stdout
    dry_args = ["cartpole", "--executor", "slurm", "--dry-run", "--gpus-per-node", "0"]
    dry = run(wheel_env, "mjlab-submit", *dry_args, "--nodes", "2", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --nodes=2" in dry.stdout and "--kill-on-bad-exit=1" in dry.stdout
    assert not any(p.name != "job.sbatch" for p in tmp_path.iterdir())  # dry: nothing made


def test_short_training_on_two_local_ranks(wheel_env: Path, tmp_path: Path) -> None:
    args = ["cartpole", "--num-procs", "2", "--num-envs", "16", "--max-iterations", "2"]
    args += ["--torch-threads", "1", "--log-root", "logs"]
    proc = run(wheel_env, "mjlab-train", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (summary,) = (tmp_path / "logs" / "cartpole").glob("*/summary.json")
    data = json.loads(summary.read_text())
    assert data["world_size"] == 2 and data["iterations"] == 2 and data["ranks_in_sync"]

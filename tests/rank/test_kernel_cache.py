"""Warp's compiled kernels under the log root: a second run on a fresh home starts warm.

The suite shares kernels through WARP_CACHE_PATH (tests/conftest.py); these tests unset it to
meet the default a user meets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import BIN, cli_env

from mjlab_hpc.rank.kernel_cache import cache_key, choose_kernel_cache
from mjlab_hpc.rundir.layout import KERNEL_CACHE_DIR

TRAIN = ["cartpole", "--num-envs", "8", "--max-iterations", "1", "--torch-threads", "1"]


# Warp builds a module in `<module>_p<pid>_t<thread>` and renames it into place.
_BUILDING = re.compile(r"_p\d+_t\d+$")


def _modules(folder: Path) -> set[str]:
    return {
        p.name
        for p in folder.iterdir()
        if p.name.startswith("wp_") and not _BUILDING.search(p.name)
    }


def test_the_key_names_what_a_module_is_valid_for() -> None:
    import warp as wp

    key = cache_key("cpu-x86_64")
    assert key.startswith(f"warp-{wp.config.version}-") and key.endswith("_cpu-x86_64")
    assert "mujoco-warp-" in key and "torch-" in key
    assert cache_key("sm90") != key  # another architecture, another folder


def test_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARP_CACHE_PATH", raising=False)
    assert choose_kernel_cache("node", str(tmp_path), "cpu").path is None
    chosen = choose_kernel_cache("auto", str(tmp_path / "logs"), "cpu")
    assert chosen.path is not None and chosen.path.parent.parent == (
        tmp_path / "logs" / KERNEL_CACHE_DIR
    )
    assert chosen.path.parent.stat().st_mode & 0o777 == 0o700
    folder = choose_kernel_cache(str(tmp_path / "team-cache"), "logs", "cpu")
    assert folder.path is not None and folder.path.parent == tmp_path / "team-cache"
    monkeypatch.setenv("WARP_CACHE_PATH", str(tmp_path / "site"))
    assert choose_kernel_cache("auto", str(tmp_path / "logs"), "cpu").path is None


def test_a_folder_others_may_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WARP_CACHE_PATH", raising=False)
    first = choose_kernel_cache("auto", str(tmp_path), "cpu")
    assert first.path is not None
    mine = first.path.parent
    mine.chmod(0o770)  # a teammate could plant code there
    refused = choose_kernel_cache("auto", str(tmp_path), "cpu")
    assert refused.path is None and "others may write" in refused.why
    mine.chmod(0o700)
    (tmp_path / "elsewhere").mkdir()
    mine.rename(tmp_path / "moved")
    mine.symlink_to(tmp_path / "elsewhere")
    linked = choose_kernel_cache("auto", str(tmp_path), "cpu")
    assert linked.path is None and "not a folder" in linked.why


@pytest.mark.training
def test_a_second_run_on_a_fresh_home_loads_the_first_runs_kernels(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    env = {k: v for k, v in cli_env().items() if k != "WARP_CACHE_PATH"}
    for n in (1, 2):
        home = tmp_path / f"home{n}"  # another node: nothing in its home
        home.mkdir()
        proc = subprocess.run(
            [BIN / "mjlab-train", *TRAIN, "--log-root", logs],
            env={**env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not list(home.rglob("wp_*"))  # nothing compiled into the home
        if n == 1:
            (cache,) = (logs / KERNEL_CACHE_DIR).glob("*/*")
            compiled = _modules(cache)
            assert compiled
            stamps = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert _modules(cache) == compiled  # the second run compiled nothing new
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    said = "".join(p.read_text() for p in logs.glob("cartpole/*/logs/rank0.log"))
    assert said.count(f"kernel cache: {cache} (under --log-root)") == 2


COMPILE = textwrap.dedent(
    """
    import sys
    import warp as wp
    from mjlab_hpc.rank.kernel_cache import choose_kernel_cache, use_kernel_cache
    from mjlab_hpc.tasks.memory import init_warp

    init_warp()
    use_kernel_cache(choose_kernel_cache(sys.argv[1], "unused", "cpu"))

    @wp.kernel
    def square(a: wp.array(dtype=float)):
        i = wp.tid()
        a[i] = a[i] * a[i] + 0.5

    a = wp.array([1.0, 2.0, 3.0], dtype=float, device="cpu")
    wp.launch(square, dim=3, inputs=[a], device="cpu")
    print(a.numpy().tolist())
    """
)


@pytest.mark.training
def test_ranks_compiling_one_module_at_once_all_load_a_whole_one(tmp_path: Path) -> None:
    script = tmp_path / "compile.py"
    script.write_text(COMPILE)
    shared = tmp_path / "shared"
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(shared)],
            env={**cli_env(), "PYTHONPATH": os.pathsep.join(sys.path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    assert {out for out, _ in outs} == {"[1.5, 4.5, 9.5]\n"}
    (cache,) = shared.iterdir()
    (module,) = _modules(cache)
    files = {p.suffix for p in (cache / module).iterdir()}
    assert {".o", ".meta"} <= files, files
    assert not [p for p in cache.iterdir() if _BUILDING.search(p.name)]  # none left half-built


@pytest.mark.parametrize("value", ["", "~/cache", "FILE", "a\nb"])
def test_a_bad_kernel_cache_is_refused_before_anything_starts(tmp_path: Path, value: str) -> None:
    (tmp_path / "FILE").write_text("not a folder")
    proc = subprocess.run(
        [BIN / "mjlab-train", *TRAIN, "--log-root", tmp_path / "logs", "--kernel-cache", value],
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--kernel-cache" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists()

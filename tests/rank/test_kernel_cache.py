"""Warp's compiled kernels: the user's own, held as checked, warm in every log root (issue 54).

A cached module is native code: only a folder of the user's own is used, and Warp reads it
through the descriptor that was checked, so a teammate who swaps it for a link to planted
modules runs nothing (a real payload, a real second user). A module cut short is compiled again.
The default keeps kernels in the user's home: a new log root or working folder starts warm.

The suite shares kernels through WARP_CACHE_PATH (tests/conftest.py); these tests unset it to
meet the default a user meets, and copy (hard links) what it holds where they need it warm.
"""

from __future__ import annotations

import os
import platform
import pwd
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import BIN, Team, cli_env, linked_copy, patch_on_import, wait_for

from mjlab_hpc.errors import EXIT_BAD_INPUT
from mjlab_hpc.rank.kernel_cache import (
    cache_key,
    choose_kernel_cache,
    home_cache,
    use_kernel_cache,
)
from mjlab_hpc.tasks.memory import init_warp

TRAIN = ["cartpole", "--num-envs", "8", "--max-iterations", "1", "--torch-threads", "1"]
KEY = cache_key(f"cpu-{platform.machine()}")
USER = pwd.getpwuid(os.getuid()).pw_name

# Warp builds a module in `<module>_p<pid>_t<thread>` and renames it into place.
_BUILDING = re.compile(r"_p\d+_t\d+$")


def _modules(folder: Path) -> dict[str, int]:
    """The modules of a cache folder and when each was written."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in folder.iterdir()
        if p.name.startswith("wp_") and not _BUILDING.search(p.name)
    }


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's own Warp cache (Warp's layout under WARP_CACHE_PATH), holding every module
    of a cartpole run: one run with the suite's environment (warm, but on a new machine)."""
    tmp = tmp_path_factory.mktemp("warm")
    proc = _train(["--log-root", tmp / "logs"], tmp, cli_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(os.environ["WARP_CACHE_PATH"]) / _warp_version()


def _warp_version() -> str:
    import warp as wp

    return str(wp.config.version)


def _train(argv: list[object], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BIN / "mjlab-train", *TRAIN, *map(str, argv)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_key_names_what_a_module_is_valid_for() -> None:
    import warp as wp

    key = cache_key("cpu-x86_64")
    assert key.startswith(f"warp-{wp.config.version}-") and key.endswith("_cpu-x86_64")
    assert "mujoco-warp-" in key and "torch-" in key
    assert cache_key("sm90") != key  # another architecture, another folder


def test_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    init_warp()
    monkeypatch.delenv("WARP_CACHE_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert choose_kernel_cache("node", "cpu").path is None
    chosen = choose_kernel_cache("auto", "cpu")
    assert chosen.path == home_cache() / USER / KEY
    assert chosen.path == tmp_path / "cache/mjlab-hpc/kernels" / USER / KEY
    assert chosen.fd is not None and os.path.samefile(f"/proc/self/fd/{chosen.fd}", chosen.path)
    assert chosen.path.parent.stat().st_mode & 0o777 == 0o700 and not chosen.warning
    team = choose_kernel_cache(str(tmp_path / "team-cache"), "cpu")
    assert team.path == tmp_path / "team-cache" / USER / KEY
    monkeypatch.setenv("WARP_CACHE_PATH", str(tmp_path / "site"))
    assert choose_kernel_cache("auto", "cpu").path is None  # Warp's own variable: Warp's folder
    assert choose_kernel_cache(str(tmp_path / "team-cache"), "cpu").path == team.path
    import warp as wp

    site = tmp_path / "site" / "1.0"
    site.mkdir(parents=True, mode=0o777)
    site.chmod(0o777)  # others may write what Warp would load: the user's own folder instead
    monkeypatch.setattr(wp.config, "kernel_cache_dir", str(site))
    for choice in ("auto", "node"):
        instead = choose_kernel_cache(choice, "cpu")
        assert instead.path == chosen.path and instead.warning, instead
        assert f"not {site}" in instead.why and "others may write" in instead.why


def test_a_folder_others_may_reach_or_that_is_a_link_is_not_used(tmp_path: Path) -> None:
    init_warp()
    first = choose_kernel_cache(str(tmp_path), "cpu")
    assert first.path is not None
    mine = first.path.parent
    mine.chmod(0o750)  # the group may enter: a module folder Warp made group-writable is theirs
    refused = choose_kernel_cache(str(tmp_path), "cpu")
    assert refused.path is None and refused.warning and "others may enter" in refused.why
    mine.chmod(0o700)
    first.path.chmod(0o770)
    refused = choose_kernel_cache(str(tmp_path), "cpu")
    assert refused.path is None and "others may write" in refused.why
    first.path.chmod(0o700)
    mine.rename(tmp_path / "moved")
    mine.symlink_to(tmp_path / "moved")  # even a link to a folder of one's own
    linked = choose_kernel_cache(str(tmp_path), "cpu")
    assert linked.path is None and "is a link" in linked.why


def test_what_was_checked_is_what_warp_reads_after_a_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deterministic race: the folder is swapped for a link between the check and the use;
    every path Warp is handed still reaches the folder that was checked."""
    init_warp()
    import warp as wp

    monkeypatch.setattr(wp.config, "kernel_cache_dir", wp.config.kernel_cache_dir)
    chosen = choose_kernel_cache(str(tmp_path / "shared"), "cpu")
    assert chosen.path is not None and chosen.fd is not None
    planted = tmp_path / "planted" / KEY
    planted.mkdir(parents=True)
    mine = chosen.path.parent
    mine.rename(tmp_path / "shared" / "old")
    mine.symlink_to(planted.parent)
    use_kernel_cache(chosen)
    assert wp.config.kernel_cache_dir == f"/proc/self/fd/{chosen.fd}"
    (Path(wp.config.kernel_cache_dir) / "wp_probe").mkdir()  # what Warp does to publish
    assert (tmp_path / "shared/old" / KEY / "wp_probe").is_dir()
    assert not list(planted.iterdir())


COMPILE = textwrap.dedent(
    """
    import sys
    import warp as wp
    from mjlab_hpc.rank.kernel_cache import choose_kernel_cache, use_kernel_cache
    from mjlab_hpc.tasks.memory import init_warp

    init_warp()
    use_kernel_cache(choose_kernel_cache(sys.argv[1], "cpu"))

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
    """Six ranks compile one module into one folder at once; then its binary is cut short in
    half, and the next start compiles it again instead of failing to load it."""
    script = tmp_path / "compile.py"
    script.write_text(COMPILE)
    shared = tmp_path / "shared"
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join(sys.path)}

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, script, str(shared)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [start() for _ in range(6)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    assert {out for out, _ in outs} == {"[1.5, 4.5, 9.5]\n"}
    cache = shared / USER / KEY
    (module,) = _modules(cache)
    files = {p.suffix for p in (cache / module).iterdir()}
    assert {".o", ".meta"} <= files, files
    assert not [p for p in cache.iterdir() if _BUILDING.search(p.name)]  # none left half-built
    (binary,) = (cache / module).glob("*.o")
    whole = binary.read_bytes()
    binary.write_bytes(whole[: len(whole) // 2])
    again = start()
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and out == "[1.5, 4.5, 9.5]\n", err[-1500:]
    assert f"could not load {cache / module}" in err and "compiling it again" in err
    assert len(binary.read_bytes()) == len(whole)
    assert set(_modules(cache)) == {module}  # the damaged one is gone, not kept aside


@pytest.mark.training
def test_a_cut_short_module_is_compiled_again_not_a_crash_at_every_start(
    tmp_path: Path, warm: Path
) -> None:
    """mujoco_warp's smooth module cut short in Warp's own cache: the run compiles it again
    (it failed to load at every start), and the next start loads it without a word."""
    cache = tmp_path / "warp"
    linked_copy(warm, cache / warm.name)
    binaries = list(cache.glob("*/wp_mujoco_warp._src.smooth_*/*.o"))
    assert binaries
    whole = {}
    for binary in binaries:
        whole[binary] = binary.read_bytes()
        binary.unlink()  # a hard link of the suite's cache: replaced, not written
        binary.write_bytes(whole[binary][: len(whole[binary]) // 2])
    env = cli_env({"WARP_CACHE_PATH": str(cache)})
    for n in (1, 2):
        proc = _train(["--log-root", tmp_path / "logs", "--kernel-cache", "node"], tmp_path, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        damaged = "mujoco_warp._src.smooth" in proc.stderr and "compiling it again" in proc.stderr
        assert damaged == (n == 1), proc.stderr[-3000:]
    assert any(len(b.read_bytes()) == len(whole[b]) for b in binaries if b.exists())


@pytest.mark.training
def test_a_new_log_root_or_working_folder_loads_the_kernels_compiled_before(
    tmp_path: Path, warm: Path
) -> None:
    """The default keeps kernels in the user's home: a run in another working folder (the
    default log root `logs` is relative to it) compiles nothing that one before compiled."""
    home = tmp_path / "home"
    env = cli_env({"HOME": str(home)})
    env.pop("WARP_CACHE_PATH")
    env.pop("XDG_CACHE_HOME", None)
    mine = home / ".cache/mjlab-hpc/kernels" / USER / KEY
    linked_copy(warm, mine)  # warm: kernels compiled before (by the suite)
    mine.parent.chmod(0o700)
    for module in mine.glob("wp_*qfrc_smooth*"):  # one module the first run must compile
        shutil.rmtree(module)
    for n in (1, 2):
        work = tmp_path / f"work{n}"
        work.mkdir()
        proc = _train([], work, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = (work / "logs").glob("cartpole/*/logs/rank0.log")
        assert f"kernel cache: {mine} (--kernel-cache auto)" in next(said).read_text()
        assert not (work / "logs/.kernel-cache").exists()
        if n == 1:
            compiled = _modules(mine)
            assert any("qfrc_smooth" in m for m in compiled)
    assert _modules(mine) == compiled  # the second run compiled nothing, rewrote nothing
    assert not list(home.glob(".cache/warp/*/wp_*"))  # nothing went to Warp's own folder


def test_a_site_config_names_a_shared_kernel_cache(tmp_path: Path) -> None:
    """`kernel-cache` in a config file's [defaults] is every submitted run's --kernel-cache
    (a shared folder: a node that never ran the job is warm); a folder of someone else's where
    the user's own would be is refused before anything is submitted."""
    shared = tmp_path / "shared-kernels"
    (tmp_path / "mjlab-hpc.toml").write_text(f'[defaults]\nkernel-cache = "{shared}"\n')
    submit = [BIN / "mjlab-submit", "cartpole", "--gpus-per-node", "0", "--dry-run"]
    shown = subprocess.run(submit, env=cli_env(), cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"kernel_cache: {shared}\n" in shown.stdout
    source = f'# kernel-cache = "{shared}"  ({tmp_path / "mjlab-hpc.toml"} [defaults])'
    assert source in shown.stdout
    (shared / USER).mkdir(parents=True, mode=0o755)
    refused = subprocess.run(submit, env=cli_env(), cwd=tmp_path, capture_output=True, text=True)
    text = " ".join(refused.stderr.split())
    assert refused.returncode == EXIT_BAD_INPUT, refused.stdout[-2000:] + text
    assert "--kernel-cache" in text and "others may enter" in text


@pytest.mark.parametrize("value", ["", "~/cache", "FILE", "a\nb", "LINK", "OPEN"])
def test_a_bad_kernel_cache_is_refused_before_anything_starts(tmp_path: Path, value: str) -> None:
    (tmp_path / "FILE").write_text("not a folder")
    for name, mode in (("LINK", None), ("OPEN", 0o775)):
        (tmp_path / name).mkdir()
        if mode is None:
            (tmp_path / name / USER).symlink_to(tmp_path)
        else:
            (tmp_path / name / USER).mkdir(mode=mode)
            (tmp_path / name / USER).chmod(mode)
    proc = subprocess.run(
        [BIN / "mjlab-train", *TRAIN, "--log-root", tmp_path / "logs", "--kernel-cache", value],
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--kernel-cache" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists()


# Between the check of the cache and its use, the rank waits for the test (`check` before
# choose_kernel_cache, `use` after it), so a teammate acts exactly there. Loaded by Python
# itself (sitecustomize on PYTHONPATH), into the real mjlab-train.
HOOK = patch_on_import(
    "mjlab_hpc.rank.kernel_cache",
    """
    import os, time
    from pathlib import Path

    _dir = Path(os.environ["KCACHE_HOOK"])

    def _wait(name):
        (_dir / f"{name}.reached").touch()
        while not (_dir / f"{name}.go").exists():
            time.sleep(0.05)

    def _patch(module):
        choose = module.choose_kernel_cache

        def hooked(*args, **kwargs):
            _wait("check")
            chosen = choose(*args, **kwargs)
            _wait("use")
            return chosen

        module.choose_kernel_cache = hooked
    """,
)

# Bob's payload: the C++ source Warp keeps beside each module, with a call at the top of every
# kernel's CPU entry point that creates the file argv[2] (as whoever runs it), compiled by Warp.
PLANT = r"""
import os, re, sys
from pathlib import Path
import warp as wp
wp.config.quiet = True
wp.init()
from warp._src.build import build_cpu

folder, marker = Path(sys.argv[1]), sys.argv[2]
payload = (
    'extern "C" int open(const char*, int, ...);\nextern "C" int close(int);\n'
    'static void wp_payload() { int fd = open("%s", 0101, 0644); if (fd >= 0) close(fd); }\n'
    % marker
)
for cpp in sorted(folder.glob("wp_*/*.cpp")):
    if not re.search(r"_(qfrc_smooth|solve_init_dof)_", cpp.name):
        continue
    (obj,) = cpp.parent.glob("*.o")
    entry = r"(WP_API void \w+_cpu_forward\([^)]*\)\s*\{)"
    src = re.sub(entry, r"\1 wp_payload();", cpp.read_text())
    planted = cpp.with_name("payload.cpp")
    planted.write_text(src.replace('extern "C" {', payload + 'extern "C" {', 1))
    build_cpu(str(obj.with_name("payload.o")), str(planted))
    os.replace(obj.with_name("payload.o"), obj)
    print(cpp.parent.name)
"""


def _as(team: Team, user: str, command: str) -> str:
    proc = team.run(user, ["bash", "-c", command])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _hooked_run(team: Team, argv: list[object], extra: dict[str, str], at: dict[str, str]) -> str:
    """Alice's run, with bob's shell command `at[phase]` run where the rank reaches `phase`;
    returns what it said (it must succeed)."""
    hook = Path(extra["KCACHE_HOOK"])
    shutil.rmtree(hook, ignore_errors=True)
    hook.mkdir()
    shutil.chown(hook, user=Team.USERS[0], group=Team.GROUP)
    out = hook.parent / "run.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            team.argv(Team.USERS[0], argv),
            env=team.env(Team.USERS[0], extra),
            cwd=team.shared,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        for phase in ("check", "use"):
            reached = hook / f"{phase}.reached"
            wait_for(lambda r=reached: r.exists() or proc.poll() is not None, 300, phase)
            assert reached.exists(), out.read_text()[-3000:]
            if phase in at:
                _as(team, Team.USERS[1], at[phase])
            (hook / f"{phase}.go").touch()
        assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    return out.read_text()


@pytest.mark.training
def test_a_teammates_warp_cache_path_is_not_loaded_from(team: Team, warm: Path) -> None:
    """The team's WARP_CACHE_PATH, whose folders bob made (he trained first): alice's run
    trains, with a warning, in her own folder in her home; it neither reads nor writes his."""
    alice, bob = Team.USERS
    teams = team.base / "team-warp"
    linked_copy(warm, teams / warm.name, owner=bob, group=Team.GROUP)
    before = _modules(teams / warm.name)
    mine = team.base / "home" / alice / ".cache/mjlab-hpc/kernels" / alice / KEY
    _as(team, alice, f"mkdir -p {mine} && chmod 700 {mine.parent}")
    linked_copy(warm, mine, owner=alice, group=Team.GROUP)
    train = [BIN / "mjlab-train", *TRAIN, "--log-root", "wcp-logs"]
    proc = team.run(alice, train, extra={"WARP_CACHE_PATH": str(teams)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join(proc.stderr.split())
    assert f"warning: kernel cache: {mine} (--kernel-cache auto), not {teams / warm.name}" in said
    assert f"belongs to {bob}" in said
    assert _modules(teams / warm.name) == before


@pytest.mark.training
def test_a_teammates_planted_kernels_never_run_as_you(team: Team, warm: Path) -> None:
    """Bob owns the team's shared kernel folder (he trained there first) and plants modules
    whose code creates a file as whoever runs it. Alice trains with --kernel-cache on it: bob's
    link in place of her folder before her rank's check is refused (a warning, Warp's default);
    swapped in after the check, it is never read; the key folder he made, and a folder of his
    under her name, are never used: before anything starts, exit 2 naming the flag."""
    alice, bob = Team.USERS
    home = team.base / "home" / alice
    shared = team.shared / "kc-logs" / ".kernel-cache"
    planted = team.base / "home" / bob / "planted"
    marker = team.shared / "kc-pwned"
    _as(team, bob, f"mkdir -p {shared} {planted / KEY} && chmod 2775 {shared} {shared.parent}")
    # Alice's own Warp cache, warm (the suite's modules).
    own = home / "warp"
    linked_copy(warm, own / warm.name, owner=alice, group=Team.GROUP)
    hook = home / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    extra = {"WARP_CACHE_PATH": str(own), "PYTHONPATH": str(hook), "KCACHE_HOOK": str(hook / "at")}
    train = [BIN / "mjlab-train", *TRAIN, "--log-root", "kc-logs", "--kernel-cache", shared]

    said = _hooked_run(team, train, extra, {"check": f"ln -s {planted} {shared / alice}"})
    assert f"warning: kernel cache: {own / _warp_version()} (Warp's own default, not" in said, said
    assert f"{shared / alice} is a link" in said

    # Bob's copy of the modules alice's run loaded, a payload in some; the key folder he made.
    linked_copy(own / _warp_version(), planted / KEY, owner=bob, group=Team.GROUP)
    plant = team.run(bob, [sys.executable, "-c", PLANT, planted / KEY, marker], timeout=600)
    payloads = {name for name in plant.stdout.split() if name.startswith("wp_")}
    assert plant.returncode == 0 and payloads, plant.stdout + plant.stderr
    key = shared / KEY  # what a run made there is moved away: the folder is his
    _as(
        team,
        bob,
        f"rm {shared / alice}; mv {key} {shared}/old 2>/dev/null; ln -s {planted / KEY} {key}",
    )
    # Her own folder there, warm: bob swaps it for a link once her rank checked it.
    real = shared / alice / KEY
    _as(team, alice, f"mkdir -m 700 {shared / alice} && mkdir {real}")
    linked_copy(own / _warp_version(), real, owner=alice, group=Team.GROUP)
    swap = f"mv {shared / alice} {shared / 'taken'} && ln -s {planted} {shared / alice}"
    said = _hooked_run(team, train, extra, {"use": swap})
    assert not marker.exists(), "bob's payload ran as alice"
    assert "warning: kernel cache" not in said, said
    assert payloads <= set(_modules(shared / "taken" / KEY))  # hers, with those names
    logs = team.shared / "kc-logs" / "cartpole"
    assert any(f"kernel cache: {real}" in p.read_text() for p in logs.glob("*/logs/rank0.log"))

    for setup in ("true", f"rm {shared / alice} && mkdir -m 700 {shared / alice}"):
        _as(team, bob, setup)  # a link of bob's, then a folder of his, where hers would be
        refused = team.run(alice, train, extra={"WARP_CACHE_PATH": str(own)})
        text = " ".join(refused.stderr.split())
        assert refused.returncode == EXIT_BAD_INPUT, refused.stdout[-3000:] + text
        assert "--kernel-cache" in text and f"{shared / alice}" in text
    assert not marker.exists()

"""Site defaults (mjlab-hpc.toml, ~/.config/mjlab-hpc/config.toml) and --profile, without a cluster.

The installed mjlab-submit, run in a project folder with a home of its own: what each file
and profile gives, in which order, what the dry run says of it, and every bad file refused
with exit 2 before anything is made or submitted.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, Team, cli_env

from mjlab_hpc.cli.config import write_profile
from mjlab_hpc.errors import SpecError

USER_FILE = """\
[defaults]
partition = "user-part"
account = "user-acct"
time = "3:00:00"

[profile.big]
qos = "user-qos"
nodes = 3
"""
PROJECT_FILE = """\
[defaults]
account = "proj-acct"
setup = ["module load cuda", "source env.sh"]

[profile.big]
nodes = 4
gpus-per-node = 2
sbatch-arg = ["mail-type=END"]
"""


def _submit(
    tmp: Path, *args: str, xdg: bool = False, path: str = str(BIN)
) -> subprocess.CompletedProcess[str]:
    home, project = tmp / "home", tmp / "project"
    work = project / "sub"  # the project's file is found upward of here
    work.mkdir(parents=True, exist_ok=True)
    extra = {"HOME": str(home)}
    if xdg:
        extra["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    env = {k: v for k, v in cli_env(extra).items() if k != "XDG_CONFIG_HOME" or xdg}
    cmd = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--log-root", tmp / "logs"]
    return subprocess.run(
        [*map(str, cmd), *args],
        env=cli_env(path=path, base=env),
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _files(tmp: Path, user: str | None = USER_FILE, project: str | None = PROJECT_FILE) -> Path:
    config = tmp / "home" / ".config" / "mjlab-hpc" / "config.toml"
    if user is not None:
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(user)
    if project is not None:
        (tmp / "project").mkdir(parents=True, exist_ok=True)
        (tmp / "project" / "mjlab-hpc.toml").write_text(project)
    return config


def test_profile_over_project_over_user_and_typed_flags_over_all(tmp_path: Path) -> None:
    user = _files(tmp_path)
    project = tmp_path / "project" / "mjlab-hpc.toml"
    proc = _submit(tmp_path, "--dry-run", "--profile", "big", "--nodes", "5")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "--partition=user-part",  # the user's [defaults]
        "--account=proj-acct",  # the project's [defaults] over the user's
        "--qos=user-qos",  # the user's profile over both files' defaults
        "--gpus-per-node=2",  # the project's profile
        "--nodes=5",  # typed: over the profiles' 3 and 4
        "--time=180",
        "--mail-type=END",
    ):
        assert f"#SBATCH {line}\n" in out, line
    assert "module load cuda\nsource env.sh\n" in out
    # Where each value that is not built-in came from.
    said = out.split("# ---- where each value came from")[1].split("# ----")[0]
    assert f'# partition = "user-part"  ({user} [defaults])' in said
    assert f'# account = "proj-acct"  ({project} [defaults])' in said
    assert f'# qos = "user-qos"  ({user} [profile.big])' in said
    assert f"# gpus-per-node = 2  ({project} [profile.big])" in said
    assert "# nodes = 5  (typed)\n" in said and "user-acct" not in said
    assert not (tmp_path / "logs").exists()


def test_xdg_config_home_and_no_files(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg" / "mjlab-hpc" / "config.toml"
    xdg.parent.mkdir(parents=True)
    xdg.write_text('[defaults]\nqos = "from-xdg"\n')
    _files(tmp_path, project=None)  # ~/.config is not read when XDG_CONFIG_HOME is set
    proc = _submit(tmp_path, "--dry-run", xdg=True)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --qos=from-xdg\n" in proc.stdout
    assert "user-part" not in proc.stdout
    bare = _submit(tmp_path / "bare", "--dry-run")  # no file anywhere: the built-in defaults
    assert bare.returncode == 0, bare.stderr
    assert "site defaults" not in bare.stdout and "#SBATCH --partition" not in bare.stdout


@pytest.mark.parametrize(
    ("user", "project", "args", "said"),
    [
        (None, "[defaults]\ngpu-per-node = 2\n", (), "[defaults] gpu-per-node: unknown key (did "),
        (None, '[profile.a]\nnodes = "two"\n', ("--profile", "a"), 'nodes: is "two", but takes'),
        (None, "[defaults]\nsetup = 'x'\n", (), 'setup: is "x", but takes a list of strings'),
        (None, "[defaults]\nresume = true\n", (), "--resume says what one command does"),
        ("[defaults]\npartition = \n", None, (), "not valid TOML (Invalid value (at line 2"),
        ("[profile.a]\n[profile.b]\n", None, ("--profile", "c"), "the profiles there are: a, b"),
        (None, None, ("--profile", "c"), "there are none (mjlab-hpc doctor --write-profile"),
    ],
)
def test_a_bad_file_or_profile_exits_2_and_nothing_is_made(
    tmp_path: Path, user: str | None, project: str | None, args: tuple[str, ...], said: str
) -> None:
    config = _files(tmp_path, user, project)
    # No dry run: refused before anything is made or submitted (sbatch records any call).
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\n")
    (tools / "sbatch").chmod(0o755)
    proc = _submit(tmp_path, *args, path=f"{tools}:{BIN}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    named = config if user is not None else tmp_path / "project" / "mjlab-hpc.toml"
    if user or project:
        assert str(named) in proc.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "submitted").exists()


def test_a_refused_value_from_a_file_names_the_file(tmp_path: Path) -> None:
    _files(tmp_path, user='[defaults]\ntime = "soon"\n', project=None)
    proc = _submit(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--time (set in " in proc.stderr and "config.toml [defaults])" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_write_profile_adds_a_table_and_replaces_one_only_when_forced(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    before = (
        '# my site\n[defaults]\naccount = "a"  # kept\n\n'
        '[profile."gpu"]\nnodes = 2\n\n[profile.cpu]\ngpus-per-node = 0\n'
    )
    path.write_text(before)
    write_profile(path, "big", {"nodes": 8, "setup": ['echo "hi"\t\x7f']}, ["a note"])
    added = path.read_text()
    assert added.startswith(before) and added.endswith(
        '[profile.big]\n# a note\nnodes = 8\nsetup = ["echo \\"hi\\"\\t\\u007f"]\n'
    )
    with pytest.raises(SpecError, match=r"already has \[profile.gpu\]: pass --force"):
        write_profile(path, "gpu", {"nodes": 3})
    assert path.read_text() == added
    write_profile(path, "gpu", {"nodes": 3, "qos": "high"}, force=True)
    replaced = path.read_text()
    assert replaced == added.replace(  # in its place, spelled as the user spelled it
        '[profile."gpu"]\nnodes = 2\n', '[profile."gpu"]\nnodes = 3\nqos = "high"\n'
    )
    for bad, match in (
        ({"nodes": "x"}, "nodes: is"),
        ({"resume": True}, "says what one command does"),
    ):
        with pytest.raises(SpecError, match=match):
            write_profile(path, "other", bad)
    with pytest.raises(SpecError, match="letters, digits"):
        write_profile(path, "a.b", {"nodes": 1})
    assert path.read_text() == replaced
    broken = tmp_path / "broken.toml"
    broken.write_text("[defaults\n")
    with pytest.raises(SpecError, match=r"not valid TOML .*line 1"):
        write_profile(broken, "x", {"nodes": 1})
    assert broken.read_text() == "[defaults\n"


def test_mjlab_hpc_looks_for_runs_under_the_files_log_root(tmp_path: Path) -> None:
    _files(tmp_path, user='[defaults]\nlog-root = "/user/runs"\n', project=None)

    def logs(*args: str) -> str:
        proc = subprocess.run(
            [str(BIN / "mjlab-hpc"), "logs", "4711", *args],
            env={
                k: v
                for k, v in cli_env({"HOME": str(tmp_path / "home")}, path=str(BIN)).items()
                if k != "XDG_CONFIG_HOME"
            },
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        return proc.stderr

    assert "no run directory for job 4711 under --log-root /user/runs " in logs()
    assert "under --log-root /typed " in logs("--log-root", "/typed")
    # A bad file: said, and the built-in log root used (a run can still be found, cancelled).
    (tmp_path / "mjlab-hpc.toml").write_text("[defaults]\nnodes = 'x'\n")
    said = logs()
    assert said.startswith(f"warning: {tmp_path / 'mjlab-hpc.toml'} [defaults] nodes: is"), said
    assert "under --log-root logs " in said


def test_a_project_file_of_another_user_is_left_out(team: Team) -> None:
    """Setup lines run in every job: a mjlab-hpc.toml that bob left upward of alice's folder
    (a shared folder, /tmp) is not alice's project file."""
    alice, bob = Team.USERS
    planted = team.shared / "mjlab-hpc.toml"
    planted.write_text('[defaults]\nsetup = ["touch PWNED"]\n')
    shutil.chown(planted, user=bob)
    work = team.shared / f"work-{alice}"
    work.mkdir()
    shutil.chown(work, user=alice)
    try:
        submit = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run"]
        proc = team.run(alice, ["bash", "-c", f'cd {work} && exec "$@"', "bash", *submit])
        assert proc.returncode == 0, proc.stderr
        assert f"warning: ignored {planted}: it belongs to {bob};" in proc.stderr
        assert "PWNED" not in proc.stdout and "site defaults" not in proc.stdout
    finally:
        planted.unlink()
        shutil.rmtree(work)


def test_a_config_others_can_write_is_left_out(team: Team) -> None:
    """Issue 54: setup lines run in every job, so a config file is read only where nobody but
    its user (and root) can change it: alice's own file that her group can write, her
    XDG_CONFIG_HOME in the team's shared folder, and a link bob planted upward of her work
    folder are each left out with a warning (the submission goes on without them)."""
    alice, bob = Team.USERS
    home = team.base / "home" / alice
    config = home / ".config" / "mjlab-hpc" / "config.toml"
    shared_xdg = team.shared / f"xdg-{alice}"
    work = team.shared / f"work-{alice}"
    planted = team.shared / "mjlab-hpc.toml"
    for folder in (config.parent, shared_xdg / "mjlab-hpc", work):
        folder.mkdir(parents=True, exist_ok=True)
    for path in (shared_xdg / "mjlab-hpc" / "config.toml", config):
        path.write_text('[defaults]\nsetup = ["touch PWNED"]\n')
    for path in (home / ".config", config.parent, config, shared_xdg, work):
        shutil.chown(path, user=alice, group=Team.GROUP)
    for path in (shared_xdg / "mjlab-hpc", shared_xdg / "mjlab-hpc" / "config.toml"):
        shutil.chown(path, user=alice, group=Team.GROUP)
    submit = [BIN / "mjlab-submit", "cartpole", "--executor", "slurm", "--dry-run"]

    def dry_run(extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = team.run(
            alice, ["bash", "-c", f'cd {work} && exec "$@"', "bash", *submit], extra=extra
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    try:
        assert "touch PWNED" in dry_run().stdout  # her own file, hers alone: read
        config.chmod(0o664)
        said = dry_run()
        why = f"warning: ignored {config}: group {Team.GROUP} can write it (-rw-rw-r--)"
        assert said.stderr.startswith(why) and "PWNED" not in said.stdout, said.stderr
        config.chmod(0o644)
        said = dry_run({"XDG_CONFIG_HOME": str(shared_xdg)})
        assert f"group {Team.GROUP} can write {team.shared} (drwxrwsr-x)" in said.stderr
        assert "PWNED" not in said.stdout
        planted.symlink_to(config)  # bob's link to her own (valid) file
        os.chown(planted, pwd.getpwnam(bob).pw_uid, -1, follow_symlinks=False)
        said = dry_run()
        assert f"warning: ignored {planted}: it belongs to {bob};" in said.stderr, said.stderr
        assert f'setup = ["touch PWNED"]  ({config} [defaults])' in said.stdout  # hers
    finally:
        planted.unlink(missing_ok=True)
        shutil.rmtree(shared_xdg, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(home / ".config", ignore_errors=True)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("fifo", "it is not a regular file; its setup lines would run in your jobs"),
        ("deep", "nested too deeply to be a table of flags: fix it"),
        ("huge", "cannot be read (config.toml holds 2,097,155 bytes, more than such a file"),
    ],
)
def test_a_config_file_that_is_no_table_of_flags_is_one_line(
    tmp_path: Path, kind: str, said: str
) -> None:
    """A FIFO where the config file goes is left out (never waited on); a TOML nested 50,000
    deep, or a file of 2 MiB, is one line and exit 2, not a traceback."""
    config = _files(tmp_path, user=None, project=None)
    config.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "deep":
        config.write_text("[defaults]\nsetup = " + "[" * 50_000 + "]" * 50_000 + "\n")
    else:
        config.write_text("# " + "x" * (2 << 20) + "\n")
    proc = _submit(tmp_path, "--dry-run")
    assert said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.returncode == (0 if kind == "fifo" else 2), proc.stderr

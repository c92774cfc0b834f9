"""Where a new run's weights come from when it starts from another run, and a tracking motion.

Weights come from mjlab's `--agent.resume True` with --agent.load-run / --agent.load-checkpoint,
or from --wandb-run-path; a tracking task's motion from --registry-name. Both are looked up
once, when the task is resolved, before anything of the run exists. W&B downloads land in the
experiment folder (`.wandb_checkpoints/`, `.wandb_motions/`), so ranks and restarts need no
network.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError

__all__ = [
    "CHECKPOINT_CACHE",
    "MOTION_CACHE",
    "fetch_wandb_checkpoint",
    "fetch_wandb_motion",
    "find_run_checkpoint",
    "run_checkpoints",
    "wandb_login_problem",
]

#: Folders of the experiment folder that hold W&B downloads (hidden: not runs).
CHECKPOINT_CACHE = ".wandb_checkpoints"
MOTION_CACHE = ".wandb_motions"
# mjlab's own train caches W&B checkpoints here (a log root shared with it): not a run.
_MJLAB_CACHE = "wandb_checkpoints"
_MODEL = re.compile(r"model_(\d+)\.pt")
_NO_WANDB = (
    "it needs network and a W&B login (`wandb login`, or WANDB_API_KEY) on the machine that "
    "starts the run"
)


def wandb_login_problem() -> str | None:
    """Why W&B would refuse to log a run started here, None when it would log.

    Offline and disabled W&B need no login; otherwise a key (WANDB_API_KEY, an identity token
    file) or `wandb login`'s entry in the netrc file, as wandb itself looks them up.
    """
    mode = os.environ.get("WANDB_MODE", "").lower()
    settings = configparser.ConfigParser()
    folder = os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb"
    with contextlib.suppress(configparser.Error, UnicodeDecodeError):
        settings.read(Path(folder) / "settings")  # `wandb offline` writes its mode here
    mode = mode or settings.get("default", "mode", fallback="").lower()
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    from wandb.sdk.lib.wbauth import read_netrc_auth

    host = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    with contextlib.suppress(Exception):  # a malformed netrc: wandb says so itself
        if read_netrc_auth(host=host):
            return None
    return (
        f"mjlab's logger is W&B and this machine has no W&B login for {host}: run `wandb "
        "login` (or set WANDB_API_KEY), set WANDB_MODE=offline to log locally, or give "
        "--agent.logger tensorboard"
    )


def _order(name: str) -> str:
    # mjlab's order of checkpoint names (`get_checkpoint_path`): shorter numbers first.
    return f"{name:0>15}"


def _compile(flag: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise SpecError(flag, f"{pattern!r} is not a regular expression ({exc})") from None


def run_checkpoints(run: Path, pattern: str = r"model_.*\.pt") -> list[Path]:
    """List a run folder's checkpoint files whose names match `pattern`, oldest first.

    Names match as mjlab matches them (re.match), in mjlab's order. Our checksum sidecars,
    damaged and temporary files are not checkpoints.
    """
    regex = re.compile(pattern)
    try:
        found = [
            p
            for p in run.iterdir()
            if p.name.endswith(".pt")
            and not p.name.startswith(".")
            and regex.match(p.name)
            and p.is_file()
        ]
    except OSError:
        return []
    return sorted(found, key=lambda p: _order(p.name))


def find_run_checkpoint(
    experiment_dir: Path, load_run: str, load_checkpoint: str, exclude: Path | None = None
) -> Path:
    """Find the checkpoint mjlab's `--agent.resume True` starts from.

    It is the last checkpoint matching `load_checkpoint` in the alphabetically last run
    folder of the experiment whose name matches `load_run` (re.match) and holds one. Hidden
    folders, W&B caches and `exclude` (the run being continued) are not candidates. SpecError
    names the flag when none is found.
    """
    run_re = _compile("--agent.load-run", load_run)
    _compile("--agent.load-checkpoint", load_checkpoint)
    try:
        runs = sorted(
            p
            for p in experiment_dir.iterdir()
            if p.is_dir()
            and not p.name.startswith(".")
            and p.name != _MJLAB_CACHE
            and run_re.match(p.name)
        )
    except OSError:
        runs = []
    if exclude is not None:
        runs = [p for p in runs if p.resolve() != exclude.resolve()]
    if not runs:
        raise SpecError(
            "--agent.load-run",
            f"--agent.resume True starts from another run, but no run folder under "
            f"{experiment_dir} matches {load_run!r}; name one (--agent.load-run RUN-FOLDER), "
            "or give --log-root / --experiment-name where it lies",
        )
    for run in reversed(runs):
        found = run_checkpoints(run, load_checkpoint)
        if found:
            return found[-1]
    raise SpecError(
        "--agent.load-checkpoint",
        f"no run under {experiment_dir} matching {load_run!r} holds a checkpoint matching "
        f"{load_checkpoint!r} (runs looked at: {', '.join(p.name for p in runs[-3:])})",
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _download(folder: Path, target: Path, fetch: Callable[[Path], Path]) -> Path:
    """Download with `fetch` into a fresh folder under `folder`, then rename it to `target`.

    `fetch(tmp)` downloads into `tmp` and returns the file. One rename makes it `target`:
    racing downloads leave one whole file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        got = fetch(tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _api() -> Any:
    import wandb

    return wandb.Api(timeout=30)


def fetch_wandb_checkpoint(experiment_dir: Path, run_path: str, name: str | None = None) -> Path:
    """Download checkpoint `name` of the W&B run `run_path` once into the experiment folder.

    `name` defaults to the newest `model_<n>.pt`; `run_path` is entity/project/run-id. It
    works as mjlab's `get_wandb_checkpoint_path` does. A named checkpoint already downloaded
    needs no network; without network the newest downloaded one stands for "the newest".
    Otherwise SpecError names the flag.
    """
    run_path = run_path.strip().strip("/")
    folder = experiment_dir / CHECKPOINT_CACHE / run_path.split("/")[-1]
    if name is not None and (folder / name).is_file():
        return folder / name
    try:
        remote = {
            f.name: f
            for f in _api().run(run_path).files(pattern="model_%.pt")
            if _MODEL.fullmatch(f.name)
        }
    except Exception as exc:
        cached = run_checkpoints(folder, r"model_\d+\.pt$")
        if name is None and cached:
            return cached[-1]
        raise SpecError(
            "--wandb-run-path",
            f"cannot fetch a checkpoint of W&B run {run_path!r} ({_one_line(exc)}): "
            f"{_NO_WANDB}; or copy the checkpoint into a run folder under --log-root and use "
            "--agent.load-run",
        ) from None
    if not remote:
        raise SpecError("--wandb-run-path", f"W&B run {run_path!r} holds no model_<n>.pt file")
    if name is None:
        name = max(remote, key=lambda n: int(_MODEL.fullmatch(n).group(1)))  # type: ignore[union-attr]
    elif name not in remote:
        raise SpecError(
            "--wandb-checkpoint-name",
            f"{name!r} is not in W&B run {run_path!r}; it holds "
            + ", ".join(sorted(remote, key=_order)),
        )
    target = folder / name
    if target.is_file():
        return target
    chosen = remote[name]

    def fetch(tmp: Path) -> Path:
        chosen.download(root=str(tmp), replace=True)
        return tmp / name

    try:
        return _download(folder, target, fetch)
    except Exception as exc:
        raise SpecError(
            "--wandb-run-path",
            f"downloading {name} of W&B run {run_path!r} failed: {_one_line(exc)}",
        ) from None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "motion"


def fetch_wandb_motion(experiment_dir: Path, registry_name: str) -> Path:
    """Download a tracking task's motion.npz from the W&B registry once per version.

    `registry_name` is `name[:alias]` (`:latest` by default), fetched as mjlab's train does,
    into the experiment folder. A version (`:v3`) already downloaded needs no network; without
    network the newest download of the name stands for an alias. Otherwise SpecError names
    --registry-name.
    """
    base_name, _, alias = registry_name.strip().partition(":")
    alias = alias or "latest"
    base = experiment_dir / MOTION_CACHE / _slug(base_name)
    pinned = base / _slug(alias) / "motion.npz"
    if re.fullmatch(r"v\d+", alias) and pinned.is_file():
        return pinned
    try:
        artifact = _api().artifact(f"{base_name}:{alias}")
        version = _slug(str(getattr(artifact, "version", None) or alias))
    except Exception as exc:
        with contextlib.suppress(OSError):
            cached = sorted(base.glob("*/motion.npz"), key=lambda p: p.stat().st_mtime)
            if cached and not re.fullmatch(r"v\d+", alias):
                return cached[-1]
        raise SpecError(
            "--registry-name",
            f"cannot fetch motion {base_name}:{alias} from the W&B registry ({_one_line(exc)}): "
            f"{_NO_WANDB}; or give --env.commands.motion.motion-file /path/to/motion.npz",
        ) from None
    target = base / version / "motion.npz"
    if target.is_file():
        return target

    def fetch(tmp: Path) -> Path:
        got = Path(artifact.download(root=str(tmp))) / "motion.npz"
        if not got.is_file():
            raise FileNotFoundError(f"{base_name}:{alias} holds no motion.npz")
        return got

    try:
        return _download(base, target, fetch)
    except Exception as exc:
        raise SpecError(
            "--registry-name", f"downloading motion {base_name}:{alias} failed: {_one_line(exc)}"
        ) from None

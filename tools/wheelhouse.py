"""Install without internet, next to a site's own torch.

Compute nodes of many clusters reach no package index, and sites provide their CUDA torch (a
module, a container). Two steps:

- `make`, on a machine with internet: the wheels of everything the project needs but torch,
  for the Python version and platform of the nodes, in a folder (the wheelhouse), with
  `requirements.txt` naming each one's version (the versions `constraints.txt` pins).
- `install`, on the node: a virtual environment that sees the Python's own packages (its
  torch), the wheelhouse's wheels installed into it (a version the Python already has is
  kept), then the project itself (editable), all without an index. torch is never touched.

pip does each part (its resolver with `--dry-run --report`, `download`, `install
--no-index`); what it has no option for is leaving torch's CUDA build and its libraries out of
the set, which this script does between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXTRAS = "mjlab,dev"
# The site's torch brings these: torch, torchvision (rsl-rl's metadata asks for it, nothing
# imports it), and the CUDA libraries of PyPI's torch build.
SITE_TORCH = re.compile(r"(torch|torchvision|triton|nvidia-.*|cuda-.*)", re.IGNORECASE)
LOCK = "requirements.txt"
# Wheels of these platforms run on glibc 2.28 and newer: pip matches each tag exactly.
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(28, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


def _pip(*args: str, python: str = sys.executable) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True)


def _target(python_version: str, platforms: list[str]) -> list[str]:
    flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    for platform in platforms:
        flags += ["--platform", platform]
    return flags


def make(folder: Path, python_version: str, platforms: list[str], extras: str) -> None:
    """Resolve the project's needs for the target, then download them, torch's set left out."""
    folder.mkdir(parents=True, exist_ok=True)
    target = _target(python_version, platforms)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # The project's needs, and what pip builds it with (an editable install offline).
        _pip(
            "install",
            "--dry-run",
            "--quiet",
            "--ignore-installed",
            "--target",
            tmp,
            "--report",
            str(report),
            *target,
            "-c",
            str(REPO / "constraints.txt"),
            f"{REPO}[{extras}]",
            "setuptools>=77",
            "wheel",
        )
        found = json.loads(report.read_text())["install"]
    pins = sorted(
        f"{m['name']}=={m['version']}"
        for m in (item["metadata"] for item in found)
        if not SITE_TORCH.fullmatch(m["name"]) and _key(m["name"]) != "mjlab-hpc"
    )
    lock = folder / LOCK
    lock.write_text("".join(f"{pin}\n" for pin in pins))
    _pip("download", "--quiet", "--no-deps", *target, "-d", str(folder), "-r", str(lock))
    print(
        f"wheelhouse {folder}: {len(pins)} wheels for Python {python_version} "
        f"({platforms[0]}), torch left to the site"
    )


_INSTALLED = """
import importlib.metadata as md, json
print(json.dumps([(d.metadata["Name"], d.version) for d in md.distributions()]))
"""
_TORCH = "import torch; print(torch.__version__, torch.version.cuda or 'none', torch.__file__)"


def _wheel_of(folder: Path, pin: str) -> bool:
    """Whether the wheelhouse holds a wheel of `name==version`."""
    name, version = pin.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    return any(
        w.name.lower().startswith(f"{stem}-{version}-".lower()) for w in folder.glob("*.whl")
    )


def _ask(python: str, code: str) -> str:
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _key(name: str) -> str:
    """Normalise a distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def install(folder: Path, venv: Path, python: str, extras: str, keep: bool = False) -> int:
    """Install the project and the wheelhouse's wheels in `venv`, beside `python`'s own torch.

    A package `python` has at the wheelhouse's version is kept (with `keep`: at any version).
    """
    lock = folder / LOCK
    if not lock.is_file():
        print(
            f"error: {lock} does not exist: make the wheelhouse first (make wheelhouse "
            "WHEELHOUSE=DIR on a machine with internet)",
            file=sys.stderr,
        )
        return 2
    probe = subprocess.run([python, "-c", _TORCH], capture_output=True, text=True)
    if probe.returncode != 0:
        print(
            f"error: {python} cannot import torch: load the site's torch first (its module "
            "or container), or name the Python that has it with GPU_PYTHON=",
            file=sys.stderr,
        )
        return 2
    before = probe.stdout.split()
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpython = str(venv / "bin" / "python")
    # The venv sees what `python` sees, after its own packages: `--system-site-packages` would
    # skip a site's torch that lives in a venv or conda environment of its own.
    sites = json.loads(_ask(python, "import json, site; print(json.dumps(site.getsitepackages()))"))
    purelib = Path(_ask(vpython, "import sysconfig; print(sysconfig.get_path('purelib'))"))
    # As site directories (their own .pth files count), after the venv's own packages.
    add = f"import site; [site.addsitedir(d) for d in {sites!r}]\n"
    (purelib / "zz_site_python.pth").write_text(add)
    # The first of each name on the path is the one Python imports.
    have: dict[str, str] = {}
    for name, version in json.loads(_ask(vpython, _INSTALLED)):
        if name:
            have.setdefault(_key(name), version)
    pins = [line.strip() for line in lock.read_text().splitlines() if line.strip()]
    missing = [
        pin
        for pin in pins
        if (found := have.get(_key(pin.split("==")[0]))) is None
        or (not keep and found != pin.split("==")[1])
    ]
    absent = [pin for pin in missing if not _wheel_of(folder, pin)]
    if absent:
        print(
            f"error: {folder} has no wheel for {', '.join(absent)}: make the wheelhouse again "
            "for this Python and platform",
            file=sys.stderr,
        )
        return 2
    offline = ["--no-index", "--find-links", str(folder)]
    # Only the wheelhouse: whatever pip's configuration names elsewhere is not reachable.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_FIND_LINKS", None)
    if missing:
        subprocess.run(
            [vpython, "-m", "pip", "install", "--quiet", "--no-deps", *offline, *missing],
            check=True,
            env=env,
        )
    subprocess.run(
        [
            vpython,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            *offline,
            "-e",
            f"{REPO}[{extras}]",
        ],
        check=True,
        env=env,
    )
    # What pip finds wrong among our packages; torchvision is rsl-rl's metadata only.
    check = subprocess.run([vpython, "-m", "pip", "check"], capture_output=True, text=True)
    ours = {_key(pin.split("==")[0]) for pin in pins} | {"mjlab-hpc"}
    for line in check.stdout.splitlines():
        words = line.split()
        if words and _key(words[0]) in ours and "torchvision" not in line:
            print(f"note: pip check: {line}", file=sys.stderr)
    after = subprocess.run([vpython, "-c", _TORCH], capture_output=True, text=True, check=True)
    if after.stdout.split() != before:
        print(f"error: torch changed: {before} -> {after.stdout.split()}", file=sys.stderr)
        return 1
    print(
        f"installed into {venv} from {folder} without an index: {len(missing)} of "
        f"{len(pins)} wheels (the rest were there), beside torch {before[0]} (CUDA "
        f"{before[1]}) from {Path(before[2]).parent.parent}"
    )
    return 0


def main() -> int:
    """`make DIR` or `install DIR`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="download the wheelhouse (needs an index)")
    mk.add_argument("folder", type=Path)
    mk.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    mk.add_argument(
        "--platform",
        action="append",
        help="wheel platform tags (default: x86-64 Linux, glibc 2.28 and older)",
    )
    mk.add_argument("--extras", default=EXTRAS)
    ins = sub.add_parser("install", help="install from the wheelhouse, without an index")
    ins.add_argument("folder", type=Path)
    ins.add_argument("--venv", type=Path, required=True)
    ins.add_argument("--python", default="python3", help="the Python that has the site's torch")
    ins.add_argument("--extras", default=EXTRAS)
    ins.add_argument(
        "--keep-installed",
        action="store_true",
        help="keep every package the Python has, whatever its version",
    )
    args = parser.parse_args()
    if args.command == "make":
        make(
            args.folder.resolve(),
            python_version=args.python_version,
            platforms=args.platform or list(PLATFORMS),
            extras=args.extras,
        )
        return 0
    folder, venv = args.folder.resolve(), args.venv.resolve()
    return install(folder, venv, python=args.python, extras=args.extras, keep=args.keep_installed)


if __name__ == "__main__":
    sys.exit(main())

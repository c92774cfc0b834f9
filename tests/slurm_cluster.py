"""The real Slurm test cluster (tests/cluster/cluster.sh) as a pytest fixture.

`slurm_cluster` (session scope) reuses a cluster that is already up (e.g. from
`make cluster-up`: its env.sh exists and sinfo answers), else starts one and stops it at the
end of the session. `slurm_cluster3` is a second cluster beside it, of three nodes, with a
short SlurmdTimeout. If one cannot be started the tests using it are skipped, or fail when
CI=true, so a CI machine that should run them cannot silently skip them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from mjlab_hpc.slurm.client import FINAL_STATES

SCRIPT = Path(__file__).resolve().parent / "cluster" / "cluster.sh"

# sacct states after which a job never runs again (REQUEUED is not one of them).
TERMINAL_STATES = FINAL_STATES

# apt-get may have to install ~20 packages on the first bring-up.
UP_TIMEOUT_S = 600
DOWN_TIMEOUT_S = 120


def default_state_dir() -> Path:
    """The state directory cluster.sh uses, resolved the same way as the script does."""
    configured = os.environ.get("MJLAB_HPC_CLUSTER_DIR")
    if configured:
        return Path(configured).absolute()
    return Path(os.environ.get("TMPDIR") or "/tmp") / "mjlab-hpc-cluster"


def read_env_file(path: Path) -> dict[str, str]:
    """The `export NAME=VALUE` lines of a cluster's env.sh."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster and helpers that run Slurm clients against it."""

    state_dir: Path
    # Merge into os.environ for any subprocess that talks to the cluster (SLURM_CONF, ...).
    env: dict[str, str]
    # True when this process started the cluster (and so must stop it).
    started_here: bool = False

    @property
    def version(self) -> str:
        """Slurm's version, as its daemons say (`22.05.8`, `24.11.5`)."""
        return (self.state_dir / "slurm-version").read_text().strip()

    @property
    def cgroup(self) -> bool:
        """proctrack/cgroup and task/cgroup with ConstrainDevices: each task sees only its
        GPUs, numbered from 0."""
        return self.env.get("MJLAB_HPC_CLUSTER_CGROUP") == "1"

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ plus the cluster's variables: jobs inherit it (sbatch --export=ALL)."""
        return {**os.environ, **self.env, **(extra or {})}

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command; raises with its output unless check=False."""
        check = kw.pop("check", True)
        kw["env"] = self.environ(kw.pop("env", None))
        kw.setdefault("timeout", 60)
        kw.setdefault("text", True)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        proc = subprocess.run(cmd, check=False, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{shlex.join(cmd)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def sbatch(self, args: list[str], **kw: Any) -> int:
        """Submit with sbatch --parsable; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], **kw).stdout.strip()
        return int(out.split(";")[0])

    def sacct_state(self, job_id: int | str) -> str | None:
        """The job's state in accounting ("CANCELLED by 0" -> "CANCELLED"), None if unknown yet."""
        proc = self.run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State"], check=False)
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            return None
        return lines[-1].split()[0]

    @property
    def nodes(self) -> int:
        """How many nodes it has."""
        return int((self.state_dir / "node-count").read_text())

    def lose_node(self, node: str) -> list[str]:
        """A hard node loss, as a power cut (`cluster.sh lose`): SIGKILL at once to the node's
        slurmd and every process it started (step daemons, ranks). What was killed."""
        env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(self.state_dir)}
        proc = subprocess.run(
            ["bash", str(SCRIPT), "lose", node], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    def start_node(self, node: str) -> None:
        """Start a lost node's slurmd again (`cluster.sh node-up`)."""
        env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(self.state_dir)}
        subprocess.run(
            ["bash", str(SCRIPT), "node-up", node],
            env=env,
            check=True,
            timeout=60,
            capture_output=True,
        )

    @contextlib.contextmanager
    def controller_down(self) -> Iterator[None]:
        """slurmctld stopped for real (the slurmds, jobs and accounting go on), started again
        from its saved state at the end."""
        env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(self.state_dir)}
        subprocess.run(
            ["bash", str(SCRIPT), "ctld-stop"], env=env, check=True, timeout=60, capture_output=True
        )
        try:
            yield
        finally:
            subprocess.run(
                ["bash", str(SCRIPT), "ctld-start"],
                env=env,
                check=True,
                timeout=60,
                capture_output=True,
            )

    def wait_job(self, job_id: int | str, timeout: float = 60.0) -> str:
        """Poll sacct until the job reaches a final state and return it."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.sacct_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(0.2)
        info = self.run(["scontrol", "show", "job", str(job_id)], check=False)
        raise TimeoutError(
            f"job {job_id} not finished after {timeout:.0f}s (sacct: {state})\n"
            f"{info.stdout}{info.stderr}"
        )

    def node_seconds(self, job_id: str) -> tuple[int, int]:
        """sacct's own accounting of a job: ElapsedRaw x NNodes summed over every run of it
        (requeues: --duplicates) and its RESIZING rows, and its Suspended seconds summed."""
        fields = "ElapsedRaw,NNodes,Suspended"
        cmd = ["sacct", "-n", "-P", "-X", "--duplicates", "-j", job_id, "-o", fields]
        rows = [r.split("|") for r in self.run(cmd).stdout.split()]
        suspended = [[int(x) for x in r[2].split(":")] for r in rows]
        return (
            sum(int(r[0]) * int(r[1]) for r in rows),
            sum(h * 3600 + m * 60 + s for h, m, s in suspended),
        )

    def report_is_sacct(self, run: Path, job_id: str, timeout: float = 30) -> dict[str, Any]:
        """`mjlab-hpc report --json RUN` once it agrees with sacct's node-seconds (sacct's
        record lands a moment after a job ends); its allocations also hold every start of
        the ranks and every iteration of the run's own records."""
        cmd = [str(Path(sys.executable).parent / "mjlab-hpc"), "report", "--json", str(run)]
        report: dict[str, Any] = {}
        truth = (-1, -1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            report = json.loads(self.run(cmd, timeout=120).stdout)
            truth = self.node_seconds(job_id)
            if abs(report["node_hours"] * 3600 - truth[0]) < 1e-3 * max(1, truth[0]):
                break
            time.sleep(1)
        assert report["node_hours"] * 3600 == pytest.approx(truth[0], abs=1e-3), (report, truth)
        assert report["suspended_s"] == truth[1], (report, truth)
        shares = sum(report["phase_hours"].values())
        assert shares == pytest.approx(report["node_hours"], rel=1e-6), report
        begin = min(a["begin"] for a in report["allocations"])
        end = max(a["end"] for a in report["allocations"])
        for path in (run / "logs" / "ranks").glob("*.start.json"):
            assert begin - 1 <= json.loads(path.read_text())["at"] <= end + 1, (path, begin)
        for line in (run / "progress.jsonl").read_text().splitlines():
            assert begin <= json.loads(line)["time"] <= end + 1, (line, begin, end)
        return report


def running_cluster(state_dir: Path) -> SlurmCluster | None:
    """The cluster at state_dir if it is up (env.sh present, slurmctld runs, sinfo answers)."""
    env_file = state_dir / "env.sh"
    if not env_file.is_file():
        return None
    env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(state_dir)}
    try:
        # `status` checks the controller's process before asking sinfo, which can hang ~9 s.
        proc = subprocess.run(
            ["bash", str(SCRIPT), "status"], env=env, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return SlurmCluster(state_dir=state_dir, env=read_env_file(env_file))


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def start_cluster(
    state_dir: Path, nodes: int | None = None, slurmd_timeout_s: int | None = None
) -> SlurmCluster:
    """Run `cluster.sh up` for state_dir.

    It has `nodes` nodes (else cluster.sh's default, 2) and the SlurmdTimeout given (else
    Slurm's 300 s). Raises RuntimeError with the script's output on failure.
    """
    env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(state_dir)}
    if nodes is not None:
        env["MJLAB_HPC_CLUSTER_NODES"] = str(nodes)
    if slurmd_timeout_s is not None:
        env["MJLAB_HPC_CLUSTER_SLURMD_TIMEOUT"] = str(slurmd_timeout_s)
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "up"],
            env=env,
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"cluster.sh up took more than {UP_TIMEOUT_S}s") from exc
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"cluster.sh up exited {proc.returncode}:\n{_tail(output)}")
    # Someone else brought it up between our check and our call: not ours to stop.
    started_here = "already up" not in proc.stdout
    env_file = state_dir / "env.sh"
    return SlurmCluster(state_dir, read_env_file(env_file), started_here=started_here)


def stop_cluster(state_dir: Path) -> str:
    """Run `cluster.sh down` for state_dir; returns its output, raises if it failed."""
    env = {**os.environ, "MJLAB_HPC_CLUSTER_DIR": str(state_dir)}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "down"],
        env=env,
        capture_output=True,
        text=True,
        timeout=DOWN_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cluster.sh down exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def _unavailable(reason: str) -> NoReturn:
    # On CI the cluster is a requirement: a skip there would hide a broken setup.
    if os.environ.get("CI") == "true":
        pytest.fail(f"Slurm test cluster unavailable (CI=true): {reason}", pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _check_version() -> None:
    """Fail or skip unless the Slurm that MJLAB_HPC_SLURM_VERSION names can be reached here."""
    version = os.environ.get("MJLAB_HPC_SLURM_VERSION", "22.05")
    if version != "22.05" and os.environ.get("MJLAB_HPC_IN_ROOT") != version:
        # Its clients and daemons live in their own root; 22.05's cannot talk to them.
        _unavailable(
            f"Slurm {version} runs inside its root: bash tests/cluster/cluster.sh "
            "exec .venv/bin/pytest ..."
        )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running two-node cluster: node1 and node2, with 8 CPUs and 4 fake GPUs each.

    Its Slurm version is the one MJLAB_HPC_SLURM_VERSION names (22.05 by default; 24.11
    inside its root).
    """
    _check_version()
    state_dir = default_state_dir()
    cluster = running_cluster(state_dir)
    if cluster is None:
        if os.geteuid() != 0:
            _unavailable("needs root (starts daemons, mknod, mount namespace)")
        failure = ""
        try:
            cluster = start_cluster(state_dir)
        except (OSError, RuntimeError) as exc:
            failure = str(exc)
        if failure:
            # Outside the except block, so the report is the reason, not a chained traceback.
            _unavailable(failure)
    try:
        yield cluster
    finally:
        if cluster.started_here:
            stop_cluster(state_dir)


#: slurm_cluster3's SlurmdTimeout: a node lost for good is called dead within a test.
SLURMD_TIMEOUT_S = 20


@pytest.fixture(scope="session")
def slurm_cluster3() -> Iterator[SlurmCluster]:
    """A running cluster of three nodes beside the session's, with a short SlurmdTimeout.

    Its state directory is the session's with `-3`, and its SlurmdTimeout is SLURMD_TIMEOUT_S
    (Slurm's default is 300 s). It is a cluster of its own (its own daemons, munge and
    ports), so its tests run beside the two-node cluster's. It is stopped at the end of the
    session.
    """
    _check_version()
    state_dir = default_state_dir().with_name(default_state_dir().name + "-3")
    cluster = running_cluster(state_dir)
    if cluster is None or cluster.nodes < 3:
        if os.geteuid() != 0:
            _unavailable("needs root (starts daemons, mknod, mount namespace)")
        try:
            cluster = start_cluster(state_dir, nodes=3, slurmd_timeout_s=SLURMD_TIMEOUT_S)
        except (OSError, RuntimeError) as exc:
            _unavailable(str(exc))
    try:
        yield cluster
    finally:
        if cluster.started_here:
            stop_cluster(state_dir)

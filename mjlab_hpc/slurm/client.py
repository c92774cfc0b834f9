"""One client for every Slurm command the toolkit runs, with one timeout policy.

A command that is missing or hangs answers None instead of raising: callers decide what a
missing answer means (status falls back to the run record).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from mjlab_hpc.procs import run_command
from mjlab_hpc.slurm import rows as cell
from mjlab_hpc.slurm.rows import read_rows
from mjlab_hpc.slurm.units import slurm_seconds

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FINAL_STATES",
    "QUERY_CHUNK",
    "RETRY_ENV",
    "RETRY_S",
    "UNREACHABLE",
    "Association",
    "Partition",
    "SlurmAnswer",
    "SlurmClient",
    "SlurmRow",
    "Usage",
    "controller_unreachable",
    "own_job",
    "retry_s",
]

log = logging.getLogger("mjlab_hpc")
T = TypeVar("T")

# Seconds any one Slurm command may take before it counts as not answering.
DEFAULT_TIMEOUT_S = 30.0

# Seconds a caller that needs slurmctld (the heal step, its srun and requeue) keeps trying
# while slurmctld cannot be reached: a restart or an upgrade takes tens of seconds, a failover
# to the backup controller SlurmctldTimeout (120 s by default) and then some. Each try itself
# already waits MessageTimeout (10 s by default) before Slurm's client gives up.
RETRY_S = 180.0
RETRY_ENV = "MJLAB_HPC_SLURM_RETRY_S"
"""Overrides RETRY_S (seconds; 0: one try)."""

# What Slurm's clients print when slurmctld does not answer (22.05 and 24.11: stopped, in a
# restart or failing over): worth trying again once it is back. `scontrol requeue` of a
# stopped slurmctld says "Unexpected message received".
UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out on send/recv",
    "Connection refused",
    "Zero Bytes were transmitted or received",
    "Unexpected message received",
    "backup controller in standby mode",
)
# Backoff between tries: the first pause, and the longest.
_PAUSE_S = (1.0, 10.0)


def controller_unreachable(said: str) -> bool:
    """Whether a Slurm command's output says slurmctld could not be reached."""
    return any(words in said for words in UNREACHABLE)


def own_job(env: Mapping[str, str]) -> str | None:
    """Return this job as a command sent to Slurm from inside it must name it (None: none).

    An array element is `<array>_<index>`: one element's SLURM_JOB_ID is the array's own id,
    which scancel, scontrol and squeue take for every element of the array.
    """
    array, index = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and index:
        return f"{array}_{index}"
    return env.get("SLURM_JOB_ID") or None


def retry_s(env: Mapping[str, str] | None = None) -> float:
    """RETRY_S, or MJLAB_HPC_SLURM_RETRY_S where it is set to a number of seconds."""
    value = (os.environ if env is None else env).get(RETRY_ENV, "")
    try:
        return max(0.0, float(value)) if value.strip() else RETRY_S
    except ValueError:
        return RETRY_S


# Job ids per squeue / sacct / scontrol call: a status of thousands of runs stays a few calls,
# each command line a few kB (far below ARG_MAX and what slurmctld parses quickly).
QUERY_CHUNK = 500

# Slurm states after which a job never runs again (REQUEUED is not one of them).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
_GPUS = re.compile(r"gpu(?::[\w.-]+)?[:=](\d+)")

# Slurm node states that mean a node is lost, not preempted (a drain lets jobs finish).
_LOST = ("DOWN", "FAIL", "NOT_RESPONDING")


def _down(state: str) -> bool:
    """Tell whether a node state (sinfo's, or an accounting event's) says the node is lost."""
    return any(w in state for w in _LOST)


@dataclass(frozen=True)
class SlurmRow:
    """One job (or array element) as squeue or sacct reports it."""

    job_id: str
    """`4711`, or `4711_2` for an element of a job array."""
    raw_id: str
    state: str
    nodes: int | None
    gpus_per_node: int | None
    node_list: str | None
    source: Literal["squeue", "sacct"]
    reason: str | None = None
    """Why it pends, or why it ended without running (JobLaunchFailure, BadConstraints,
    JobHeldAdmin); None: none given."""

    @property
    def final(self) -> bool:
        """The job will never run again."""
        return self.state in FINAL_STATES

    def matches(self, asked: str) -> bool:
        """Whether this row answers a question about job `asked`."""
        return asked in (self.job_id, self.raw_id)


@dataclass(frozen=True)
class SlurmAnswer:
    """What Slurm said about a set of jobs."""

    rows: dict[str, SlurmRow]
    """The freshest row for every asked id that Slurm knows."""
    accounting: bool
    """Whether sacct answered (False: accounting disabled, sacct missing or hanging)."""
    queue: bool
    """Whether squeue answered (False: missing, or slurmctld did not answer in time)."""


def _chunks(ids: Sequence[str]) -> list[list[str]]:
    ids = list(ids)
    return [ids[i : i + QUERY_CHUNK] for i in range(0, len(ids), QUERY_CHUNK)]


_FOLDED = re.compile(r"^(\d+)_\[([\d,-]+)(?:%\d+)?\]$")


def _array_elements(job: str) -> list[str]:
    """Expand sacct's one row for the elements of an array that never started.

    `4711_[0-2,5%2]` becomes `4711_0 4711_1 4711_2 4711_5`; any other id stays as it is.
    """
    m = _FOLDED.match(job)
    if not m:
        return [job]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _index(rows: Sequence[SlurmRow]) -> dict[str, list[SlurmRow]]:
    """Rows by every id a caller may ask them by: job id, raw id, and the array's id."""
    out: dict[str, list[SlurmRow]] = {}
    for row in rows:
        keys = {row.job_id, row.raw_id, row.job_id.split("_", 1)[0]}
        for key in keys:
            out.setdefault(key, []).append(row)
    return out


# sacct's row for a job's allocation before Slurm shrank it (a node lost under --no-kill):
# the job goes on in the next row, under the same id.
_RESIZED = "RESIZING"


def _pick(rows: Sequence[SlurmRow]) -> SlurmRow | None:
    """Pick the row that answers for an id.

    That is the job itself, or for a whole array an element that is still queued or running.
    """
    return next((r for r in rows if not r.final), rows[0] if rows else None)


@dataclass(frozen=True)
class Partition:
    """What a partition can give one job, as sinfo reports it."""

    name: str
    nodes: int
    """Nodes in the partition (every state)."""
    cpus_per_node: int | None
    """The most CPUs a node of it has."""
    gpus_per_node: int
    """The most GPUs (gres gpu) a node of it has."""
    max_minutes: int | None
    """The partition's time limit (None: infinite or unknown)."""
    mem_mb_per_node: int | None = None
    """The most memory a node of it has, in MB (its RealMemory; None: unknown)."""
    max_nodes: int | None = None
    """Its MaxNodes: the most nodes one job may have (None: unlimited or unknown)."""
    gres: str = ""
    """Its nodes' generic resources as sinfo says them (`gpu:a100:4`; several: `,`-joined)."""


@dataclass(frozen=True)
class Association:
    """An account a user may charge jobs to (sacctmgr's association), with its QOS."""

    account: str
    partition: str
    """The partition it is limited to ("": every partition)."""
    qos: tuple[str, ...]
    """The QOS the user may ask for under it."""
    default_qos: str
    """The QOS a job gets without --qos ("": Slurm's own default)."""
    default_account: bool
    """Whether it is the user's default account (the one a job without --account charges)."""


def _minutes(limit: str) -> int | None:
    """Return the minutes of sinfo's `%l` (`infinite`, `1-00:00:00`, `30:00`), rounded up."""
    seconds = slurm_seconds(limit)
    return None if seconds is None else math.ceil(seconds / 60)


@dataclass(frozen=True)
class Usage:
    """One row of `sacct --duplicates`: one run of a job (each requeue is another) or a step.

    Times are epoch seconds (sacct prints the local time); None where sacct has none yet.
    """

    job_id: str
    """As sacct prints it: `4711` (a run), `4711.batch`, `4711.0` (its steps), `4711_2`."""
    state: str
    submit: float | None
    """When the run was queued (a requeued run: when it was queued again)."""
    eligible: float | None
    """When it could start: after Submit for a job that waited on a dependency or a
    --begin time (a chain's link waits for the previous one)."""
    start: float | None
    end: float | None
    elapsed_s: int
    """ElapsedRaw: seconds it held its nodes, suspended time left out."""
    suspended_s: float
    """Seconds it was suspended (sacct's Suspended): held, not running, not charged."""
    nodes: int | None
    cpus: int | None
    """AllocCPUS: the cores the run held."""
    gpus: int | None
    """GPUs the run held, over all its nodes (AllocTRES gres/gpu; None: none)."""
    total_cpu_s: float | None
    """TotalCPU: CPU time its processes used (None: not gathered)."""
    max_rss: int | None
    """MaxRSS in bytes: the largest resident memory of one task (None: not gathered)."""
    tres_usage: Mapping[str, str] = field(default_factory=dict)
    """TRESUsageInMax's items (`gres/gpuutil`, `gres/gpumem`, ...) where the site gathers them."""

    @property
    def step(self) -> bool:
        """A step of a run (`.batch`, `.extern`, `.0`), not the run itself."""
        return "." in self.job_id


# The columns each command is asked for, by their header names.
_SQUEUE = ("JOBID", "ARRAY_JOB_ID", "ARRAY_TASK_ID", "JOBID", "STATE", "NODES", "NODELIST")
_SQUEUE += ("TRES_PER_NODE", "REASON")
_USAGE = ("JobID", "State", "Submit", "Eligible", "Start", "End", "ElapsedRaw", "Suspended")
_USAGE += ("NNodes", "AllocCPUS", "AllocTRES", "TotalCPU", "MaxRSS", "TRESUsageInMax")
_SINFO = ("PARTITION", "NODES", "CPUS", "GRES", "TIMELIMIT", "MEMORY", "JOB_SIZE")
_ASSOCIATION = ("Def Acct", "Account", "Partition", "QOS", "Def QOS")


def _squeue_row(r: Mapping[str, str]) -> SlurmRow:
    # Read in order: the first JOBID is %i (`4711_2`), the second %A (the raw id).
    job, raw = cell.job_id(r["JOBID"], "JOBID"), cell.job_id(r["JOBID#2"], "JOBID")
    task = cell.text(r["ARRAY_TASK_ID"], "ARRAY_TASK_ID")
    array = cell.text(r["ARRAY_JOB_ID"], "ARRAY_JOB_ID")
    gpus = _GPUS.search(cell.text(r["TRES_PER_NODE"], "TRES_PER_NODE"))
    return SlurmRow(
        job_id=f"{cell.job_id(array, 'ARRAY_JOB_ID')}_{task}" if task.isdigit() else job,
        raw_id=raw,
        state=cell.state(r["STATE"], "STATE"),
        nodes=cell.count(r["NODES"], "NODES"),
        gpus_per_node=cell.count(gpus.group(1), "TRES_PER_NODE") if gpus else None,
        node_list=cell.text(r["NODELIST"], "NODELIST") or None,
        source="squeue",
        reason=cell.text(r["REASON"], "REASON") or None,
    )


def _sacct_row(r: Mapping[str, str]) -> SlurmRow:
    nodes = cell.count(r["NNodes"], "NNodes")
    gpus = re.search(r"gres/gpu=(\d+)", cell.text(r["AllocTRES"], "AllocTRES"))
    total = cell.count(gpus.group(1), "AllocTRES") if gpus else None
    return SlurmRow(
        job_id=cell.job_id(r["JobID"], "JobID"),
        raw_id=cell.job_id(r["JobIDRaw"], "JobIDRaw"),
        state=cell.state(r["State"], "State"),  # "CANCELLED by 0" -> CANCELLED
        nodes=nodes,
        gpus_per_node=total // nodes if total is not None and nodes else None,
        node_list=cell.text(r["NodeList"], "NodeList").replace("None assigned", "") or None,
        source="sacct",
        reason=cell.text(r["Reason"], "Reason") or None,
    )


def _state_only(r: Mapping[str, str]) -> str:
    return cell.state(r["State"], "State")


def _attempt_row(r: Mapping[str, str]) -> tuple[str, str, str]:
    cell.epoch(r["End"], "End")  # checked; kept as sacct said it (`Unknown` while it runs)
    return cell.state(r["State"], "State"), cell.text(r["NodeList"], "NodeList"), r["End"].strip()


def _usage_row(r: Mapping[str, str]) -> Usage:
    tres = cell.text(r["AllocTRES"], "AllocTRES")
    gpus = re.search(r"gres/gpu=(\d+)", tres)
    used = cell.text(r["TRESUsageInMax"], "TRESUsageInMax")
    return Usage(
        job_id=cell.job_id(r["JobID"], "JobID"),
        state=cell.state(r["State"], "State"),
        submit=cell.epoch(r["Submit"], "Submit"),
        eligible=cell.epoch(r["Eligible"], "Eligible"),
        start=cell.epoch(r["Start"], "Start"),
        end=cell.epoch(r["End"], "End"),
        elapsed_s=cell.count(r["ElapsedRaw"], "ElapsedRaw", _MAX_S) or 0,
        suspended_s=cell.cpu_seconds(r["Suspended"], "Suspended") or 0.0,
        nodes=cell.count(r["NNodes"], "NNodes"),
        cpus=cell.count(r["AllocCPUS"], "AllocCPUS"),
        gpus=cell.count(gpus.group(1), "AllocTRES") if gpus else None,
        total_cpu_s=cell.cpu_seconds(r["TotalCPU"], "TotalCPU"),
        max_rss=cell.rss_bytes(r["MaxRSS"], "MaxRSS"),
        tres_usage=dict(item.split("=", 1) for item in used.split(",") if "=" in item),
    )


# The longest a job may run (seconds): a century.
_MAX_S = 100 * 365 * 86400


@dataclass(frozen=True)
class _SinfoRow:
    """One row of sinfo: a partition's nodes of one kind."""

    name: str
    default: bool
    nodes: int
    cpus: int | None
    gpus: list[int]
    gres: str
    max_minutes: int | None
    mem_mb: int | None
    max_nodes: int | None


def _sinfo_row(r: Mapping[str, str]) -> _SinfoRow:
    name = cell.text(r["PARTITION"], "PARTITION")
    gres = cell.text(r["GRES"], "GRES")
    limit = cell.text(r["TIMELIMIT"], "TIMELIMIT")
    if limit and limit != "infinite" and slurm_seconds(limit) is None:
        raise cell.BadValue(f"TIMELIMIT {limit[:40]!r} is not a time limit")
    size = cell.text(r["JOB_SIZE"], "JOB_SIZE").rpartition("-")[2]  # `1-infinite`, `1-4`
    return _SinfoRow(
        name=name.rstrip("*"),
        default=name.endswith("*"),
        nodes=cell.count(r["NODES"], "NODES") or 0,
        cpus=cell.count(r["CPUS"].rstrip("+"), "CPUS"),  # `8+`: nodes of 8 and more
        gpus=[int(g) for g in re.findall(r"gpu(?::[\w.-]+)?:(\d{1,6})", gres)],
        gres=gres,
        max_minutes=_minutes(limit),
        mem_mb=cell.count(cell.text(r["MEMORY"], "MEMORY").rstrip("+"), "MEMORY"),
        max_nodes=None if size == "infinite" else cell.count(size, "JOB_SIZE"),
    )


def _node_row(r: Mapping[str, str]) -> tuple[str, str, str]:
    reason = cell.text(r["REASON"], "REASON")
    state = cell.text(r["STATE"], "STATE")
    if state and not re.fullmatch(r"[a-z_+*~#!%$@^-]+", state):  # `down*`, `idle+drain`
        raise cell.BadValue(f"STATE {state[:40]!r} is not a node state")
    return cell.text(r["NODELIST"], "NODELIST"), state, "" if reason == "none" else reason


def _association_row(r: Mapping[str, str]) -> Association:
    account = cell.text(r["Account"], "Account")
    qos = tuple(q for q in cell.text(r["QOS"], "QOS").split(",") if q)
    return Association(
        account=account,
        partition=cell.text(r["Partition"], "Partition"),
        qos=qos,
        default_qos=cell.text(r["Def QOS"], "Def QOS"),
        default_account=account == cell.text(r["Def Acct"], "Def Acct"),
    )


# Commands that ask slurmctld (sacct and sacctmgr ask slurmdbd).
_CONTROLLER_COMMANDS = frozenset({"squeue", "scontrol", "scancel", "sbatch", "sinfo", "srun"})


@dataclass(frozen=True)
class SlurmClient:
    """Runs Slurm's commands with a given environment and one timeout for all of them."""

    env: Mapping[str, str] | None = None
    """Environment of the commands (default: this process's; tests add SLURM_CONF)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a command may take; past that it is killed and counts as not answering."""
    unreachable: list[subprocess.CompletedProcess[str]] = field(
        default_factory=list, compare=False, repr=False
    )
    """How a command found slurmctld unreachable ("Unable to contact slurm controller"):
    without `retry_s`, later commands that need it give the same answer at once instead of
    waiting for seconds each (sacct asks slurmdbd: it still runs)."""
    retry_s: float = 0.0
    """Seconds to keep trying a command that found slurmctld unreachable, with backoff
    (`retry_s()` for the callers that need it; 0: one try). sbatch is never tried again: a
    lost answer may have submitted the job."""
    bad_rows: list[str] = field(default_factory=list, compare=False, repr=False)
    """The rows of Slurm's answers that were left out, and why (a value that does not fit
    its column): a report names them."""

    def _rows(
        self,
        command: str,
        output: str,
        columns: Sequence[str],
        make: Callable[[Mapping[str, str]], T],
    ) -> list[T]:
        """`read_rows` of a command's output; a row left out is logged and kept in bad_rows."""
        bad: list[str] = []
        rows = read_rows(command, output, columns, make, bad)
        for why in bad:
            log.warning("%s", why)
        self.bad_rows.extend(bad)
        return rows

    def run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
        """Run a Slurm command; None when it is not installed or does not answer in time."""
        controller = args[0] in _CONTROLLER_COMMANDS
        if self.unreachable and controller and not self.retry_s:
            return subprocess.CompletedProcess(list(args), 1, "", self.unreachable[0].stderr)
        retry = controller and args[0] != "sbatch"
        deadline, pause = time.monotonic() + self.retry_s, _PAUSE_S[0]
        env = self.env
        if args[0] in ("sacct", "sacctmgr", "squeue", "sinfo"):  # times as rows.epoch reads them
            env = {**(os.environ if env is None else env), "SLURM_TIME_FORMAT": "standard"}
        while True:
            proc = run_command(args, timeout_s=self.timeout_s, env=env)
            if proc is None:
                log.debug("%s: not found or no answer within %gs", args[0], self.timeout_s)
                return None
            if not (controller and controller_unreachable(proc.stderr)):
                self.unreachable.clear()
                return proc
            left = deadline - time.monotonic()
            if not retry or left <= 0:
                break
            if pause == _PAUSE_S[0]:
                log.warning(
                    "slurmctld unreachable (%s): trying %s again for up to %.0f s",
                    proc.stderr.strip().splitlines()[-1],
                    " ".join(args[:2]),
                    left,
                )
            time.sleep(min(pause, left))
            pause = min(2 * pause, _PAUSE_S[1])
        if UNREACHABLE[0] in proc.stderr:  # the words people know, for the answers below
            self.unreachable.append(proc)
        if self.retry_s and retry:
            log.error(
                "slurmctld unreachable for %.0f s (%s=%g): %s gave up",
                self.retry_s,
                RETRY_ENV,
                self.retry_s,
                " ".join(args[:2]),
            )
        return proc

    def squeue(self, ids: Sequence[str]) -> list[SlurmRow] | None:
        """Return the jobs slurmctld still knows: running, pending and recently ended ones.

        One row per array element (`-r`: else a pending array is one row `4711_[0-199]`).
        Asked in chunks of QUERY_CHUNK ids; None when squeue is missing, fails or does not
        answer.
        """
        fmt = "%i|%F|%K|%A|%T|%D|%N|%b|%r"
        rows: list[SlurmRow] = []
        for chunk in _chunks(ids):
            proc = self.run(["squeue", "-r", "-t", "all", "-j", ",".join(chunk), "-o", fmt])
            if proc is not None and proc.returncode != 0 and "Invalid job id" in proc.stderr:
                continue  # every id of the chunk unknown: slurmctld forgot them
            if proc is None or proc.returncode != 0:
                return None  # slurmctld down or too slow ("Unable to contact slurm controller")
            rows += self._rows("squeue", proc.stdout, _SQUEUE, _squeue_row)
        return rows

    def sacct(self, ids: Sequence[str]) -> list[SlurmRow] | None:
        """Return the jobs in accounting; None when sacct fails (accounting disabled, say).

        Asked in chunks of QUERY_CHUNK ids. Array elements that never started, which sacct
        folds into one row (`4711_[3-199]`), come back one row each.
        """
        fields = "JobID,JobIDRaw,State,NNodes,AllocTRES,NodeList,Reason"
        rows: list[SlurmRow] = []
        for chunk in _chunks(ids):
            proc = self.run(["sacct", "-P", "-X", "-j", ",".join(chunk), "-o", fields])
            if proc is None or proc.returncode != 0:
                return None
            for found in self._rows("sacct", proc.stdout, fields.split(","), _sacct_row):
                if found.state != _RESIZED:
                    elements = _array_elements(found.job_id)
                    rows += [dataclasses.replace(found, job_id=e) for e in elements]
        return rows

    def attempts(self, job_id: str) -> list[tuple[str, str, str]] | None:
        """Return every run of a requeued job, oldest first, as (state, node list, end time).

        None when sacct fails. An attempt that ended because a node failed says NODE_FAIL.
        """
        fields = "State,NodeList,End"
        proc = self.run(["sacct", "-P", "-X", "--duplicates", "-j", job_id, "-o", fields])
        if proc is None or proc.returncode != 0:
            return None
        rows = self._rows(
            "sacct",
            proc.stdout,
            fields.split(","),
            _attempt_row,
        )
        return [r for r in rows if r[0] != _RESIZED]

    def usage(self, job_ids: Sequence[str]) -> list[Usage] | None:
        """Return what accounting says each run of the jobs (and its steps) used.

        Every run of a requeued job is a row (`--duplicates`). None when sacct fails
        (accounting disabled, sacct missing or hanging).
        """
        args = ["sacct", "-P", "--duplicates", "-j", ",".join(job_ids), "-o", ",".join(_USAGE)]
        proc = self.run(args)
        if proc is None or proc.returncode != 0:
            return None
        return self._rows("sacct", proc.stdout, _USAGE, _usage_row)

    def out_of_memory(self, job_id: str) -> bool:
        """Tell whether a step of the job's latest run ended OUT_OF_MEMORY.

        Slurm's cgroup plugin says so when its OOM killer ended a task. False when sacct does
        not say so or cannot answer.
        """
        proc = self.run(["sacct", "-P", "-j", job_id, "-o", "State"])
        if proc is None or proc.returncode != 0:
            return False
        states = self._rows("sacct", proc.stdout, ["State"], _state_only)
        return "OUT_OF_MEMORY" in states

    def answer(self, ids: Sequence[str]) -> SlurmAnswer:
        """Return the freshest row for every id that Slurm knows.

        One squeue and one sacct call serve all of them (more only past QUERY_CHUNK distinct
        jobs): array elements (`4711_2`) are asked by their array's id, which lists every
        element at once.

        squeue is current while slurmctld knows the job; sacct has the precise end state
        (squeue says COMPLETING while sacct already says CANCELLED) and jobs slurmctld has
        forgotten. Without accounting only squeue is used, and callers fall back to the run
        record for jobs squeue no longer lists. An asked array id (`4711`) is answered by an
        element still queued or running, else by any of its elements.
        """
        ids = sorted(set(ids))
        asked = sorted({i.split("_", 1)[0] for i in ids})
        queue = self.squeue(asked)
        accounting = self.sacct(asked)
        sq, sa = _index(queue or []), _index(accounting or [])
        out: dict[str, SlurmRow] = {}
        for job in ids:
            q, a = _pick(sq.get(job, [])), _pick(sa.get(job, []))
            if q is not None and not (q.final or q.state == "COMPLETING"):
                out[job] = q  # sacct may still say PENDING for a job that just started
            elif a is not None and a.final:
                # sacct's Reason of an ended job is its last reason to wait; why it ended
                # without running (JobLaunchFailure) only slurmctld says, while it knows it.
                reason = q.reason if q is not None and q.final else None
                out[job] = dataclasses.replace(a, reason=reason)
            elif q is not None or a is not None:
                out[job] = q or a  # type: ignore[assignment]
        return SlurmAnswer(out, accounting is not None, queue is not None)

    def query(self, ids: Sequence[str]) -> tuple[dict[str, SlurmRow], bool]:
        """`answer(ids)` as (rows by asked id, whether accounting answered)."""
        got = self.answer(ids)
        return got.rows, got.accounting

    def show_job(self, job_id: str) -> str | None:
        """`scontrol show job JOB` as printed (None when slurmctld does not know the job)."""
        proc = self.run(["scontrol", "show", "job", job_id])
        if proc is None or proc.returncode != 0:
            return None
        return proc.stdout

    def job_fields(self, job_id: str) -> dict[str, str] | None:
        """`scontrol show job`'s `Name=value` fields of the job (None: no answer)."""
        text = self.show_job(job_id)
        if text is None:
            return None
        return {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", text)}

    def excluded_nodes(self, job_id: str) -> list[str]:
        """Return the nodes the job may not run on (its ExcNodeList; none when unknown)."""
        value = (self.job_fields(job_id) or {}).get("ExcNodeList", "(null)")
        return [] if value in ("(null)", "") else self.hostnames(value) or []

    def job_state(self, job_id: str) -> str | None:
        """The job's state as slurmctld sees it now (RUNNING, CANCELLED, ...), None if unknown."""
        return (self.job_fields(job_id) or {}).get("JobState")

    def job_stdout_paths(self, job_id: str) -> list[Path] | None:
        """Return the StdOut files of a job, one per array element.

        None when slurmctld did not answer; none for a job it does not know.
        """
        proc = self.run(["scontrol", "show", "job", job_id])
        if proc is None or (proc.returncode != 0 and "Invalid job id" not in proc.stderr):
            return None
        return [Path(m.group(1)) for m in re.finditer(r"StdOut=(\S+)", proc.stdout)]

    def requeue(self, job_id: str) -> bool:
        """Ask Slurm to run this job again (same job id, SLURM_RESTART_COUNT + 1).

        Only a job that is still RUNNING is requeued. SIGTERM also comes from `scancel`: the
        job is then CANCELLED, and requeueing it would undo the user's cancel. A preempted job
        that Slurm requeues itself (PreemptMode=REQUEUE) is no longer RUNNING either. True
        when the job will run again or was deliberately left alone.
        """
        state = self.job_state(job_id)
        if state is not None and state != "RUNNING":
            log.info("job %s is %s: not requeued (checkpoint saved)", job_id, state)
            return state in ("REQUEUED", "PENDING", "PREEMPTED", "CANCELLED", "COMPLETING")
        proc = self.run(["scontrol", "requeue", job_id])
        # A try whose answer was lost may have requeued it already.
        lost = proc is not None and proc.returncode != 0 and not self.unreachable
        if lost and self.job_state(job_id) in ("REQUEUED", "PENDING"):
            log.info("requeued Slurm job %s", job_id)
            return True
        if proc is None or proc.returncode != 0:
            why = "no answer" if proc is None else proc.stderr.strip()
            log.error("scontrol requeue %s failed: %s", job_id, why)
            return False
        log.info("requeued Slurm job %s", job_id)
        return True

    def scancel(self, ids: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
        """Cancel jobs: SIGTERM to their steps, then SIGKILL after KillWait.

        Each call takes QUERY_CHUNK ids. Returns the answer of the first call that failed,
        else of the last.
        """
        last = None
        for chunk in _chunks(ids):
            last = self.run(["scancel", *chunk])
            if last is None or last.returncode != 0:
                return last
        return last

    def signal_steps(self, ids: Sequence[str], name: str) -> bool:
        """Send signal `name` (TERM, KILL, ...) to the tasks of jobs or steps, not ending them.

        A step is named like `4711.0`. The tasks decide what to do with the signal.
        """
        proc = self.run(["scancel", f"--signal={name}", *ids])
        return proc is not None and proc.returncode == 0

    def step_of(self, job_id: str, step_name: str) -> str | None:
        """The id (`4711.3`) of the running step of a job that has this name."""
        proc = self.run(["squeue", "-s", "-j", job_id, "-o", "%i|%j"])
        if proc is None or proc.returncode != 0:
            return None
        steps = self._rows(
            "squeue",
            proc.stdout,
            ["STEPID", "NAME"],
            lambda r: (cell.job_id(r["STEPID"], "STEPID"), cell.text(r["NAME"], "NAME")),
        )
        return next((step for step, name in steps if name == step_name), None)

    def forbid_requeue(self, job_ids: str | Sequence[str]) -> bool:
        """Mark jobs as not requeueable, before cancelling them.

        Our ranks answer SIGTERM with a checkpoint and `scontrol requeue`; a job that may not
        be requeued stays cancelled. One `scontrol update` per QUERY_CHUNK jobs; False when
        any call failed.
        """
        ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
        ok = True
        for chunk in _chunks(ids):
            proc = self.run(["scontrol", "update", f"JobId={','.join(chunk)}", "Requeue=0"])
            ok = ok and proc is not None and proc.returncode == 0
        return ok

    def partitions(self) -> dict[str, Partition] | None:
        """Return every partition by name, the default one also under "".

        None when sinfo does not answer.
        """
        # -a: hidden partitions too (a user may have access to one).
        proc = self.run(["sinfo", "-a", "-o", "%P|%D|%c|%G|%l|%m|%s"])
        if proc is None or proc.returncode != 0:
            return None
        groups: dict[str, list[_SinfoRow]] = {}
        default = None
        for row in self._rows("sinfo", proc.stdout, _SINFO, _sinfo_row):
            if row.default:
                default = row.name
            groups.setdefault(row.name, []).append(row)
        out = {}
        for name, group in groups.items():
            gpus = [g for r in group for g in r.gpus]
            cpus = [r.cpus for r in group if r.cpus is not None]
            mems = [r.mem_mb for r in group if r.mem_mb is not None]
            out[name] = Partition(
                name=name,
                nodes=sum(r.nodes for r in group),
                cpus_per_node=max(cpus) if cpus else None,
                gpus_per_node=max(gpus) if gpus else 0,
                max_minutes=group[0].max_minutes,
                mem_mb_per_node=max(mems) if mems else None,
                max_nodes=group[0].max_nodes,
                gres=",".join(sorted({r.gres for r in group if r.gres})),
            )
        if default is not None:
            out[""] = out[default]
        return out

    def lost_nodes(self, nodelist: str, since: float | None = None) -> list[str] | None:
        """Return the nodes of a node list that Slurm marks down or failing, expanded.

        A SIGTERM then came because a node failed, not from a preemption (a drain lets jobs
        finish). With `since` (epoch s), also those Slurm set DOWN or FAIL since then and that
        are back already: an admin's `state=down` on a node whose slurmd answers lasts a
        moment (ReturnToService=2), so its state is gone when the ranks ask; accounting keeps
        the event (`sacctmgr show event`). None when Slurm does not answer.
        """
        hosts = self.hostnames(nodelist)
        states = self.node_states(hosts) if hosts else None
        if states is None:
            return None
        lost = {n for n, (state, _) in states.items() if _down(state.upper())}
        if since is not None and hosts:
            lost |= set(self.down_events(hosts, since) or ())
        return sorted(lost)

    def down_events(self, nodes: Sequence[str], since: float) -> list[str] | None:
        """Return the nodes among `nodes` that Slurm's accounting saw DOWN or FAIL since `since`.

        `since` is epoch s (sacctmgr reads local time). None when sacctmgr does not answer
        (no accounting).
        """
        start = dt.datetime.fromtimestamp(since - 1).strftime("%Y-%m-%dT%H:%M:%S")
        fields = "format=NodeName,State,TimeStart"
        query = ["show", "event", f"nodes={','.join(nodes)}", f"start={start}", fields]
        proc = self.run(["sacctmgr", "-P", *query])
        if proc is None or proc.returncode != 0:
            return None
        found = self._rows(
            "sacctmgr",
            proc.stdout,
            ["NodeName", "State", "TimeStart"],
            lambda r: (
                cell.text(r["NodeName"], "NodeName"),
                cell.text(r["State"], "State"),
                cell.epoch(r["TimeStart"], "TimeStart"),
            ),
        )
        # sacctmgr lists every event overlapping the window: one that began before it (a node
        # back from an earlier loss as this start began) is not a loss of this start.
        return sorted(
            {
                node
                for node, state, began in found
                if node in nodes and _down(state.upper()) and (began is None or began >= since - 1)
            }
        )

    def node_states(self, nodes: Sequence[str]) -> dict[str, tuple[str, str]] | None:
        """Return each node's state and Slurm's reason for it, from one sinfo call.

        `nodes` are names or hostlist expressions. A state and reason read like
        `("down*", "Not responding")` or `("idle", "")`. None when Slurm does not answer.
        """
        proc = self.run(["sinfo", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"])
        if proc is None or proc.returncode != 0:
            return None
        found = self._rows("sinfo", proc.stdout, ["NODELIST", "STATE", "REASON"], _node_row)
        return {name: (state, reason) for name, state, reason in found if name and state}

    def hostnames(self, expr: str) -> list[str] | None:
        """Expand a hostlist expression with `scontrol show hostnames`.

        None when scontrol is missing, fails, hangs or prints no host (as it does for an
        invalid hostlist, while exiting 0).
        """
        argv = ["scontrol", "show", "hostnames", expr]
        if expr.startswith("-"):
            argv.insert(-1, "--")  # else scontrol's getopt takes "-[1-2]" for options
        proc = self.run(argv)
        if proc is None or proc.returncode != 0:
            return None
        hosts = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        return hosts or None

    def config(self) -> dict[str, str] | None:
        """`scontrol show config` as a dict (None when scontrol does not answer)."""
        proc = self.run(["scontrol", "show", "config"])
        if proc is None or proc.returncode != 0:
            return None
        out = {}
        for line in proc.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and " " not in key.strip():
                out[key.strip()] = value.strip()
        return out

    def associations(self, user: str) -> list[Association] | None:
        """The user's accounts and QOS in slurmdbd (None: sacctmgr does not answer)."""
        fields = "format=DefaultAccount,Account,Partition,QOS,DefaultQOS"
        proc = self.run(["sacctmgr", "-P", "show", "user", user, "withassoc", fields])
        if proc is None or proc.returncode != 0:
            return None
        return [
            a
            for a in self._rows("sacctmgr", proc.stdout, _ASSOCIATION, _association_row)
            if a.account
        ]

    def sbatch(self, args: Sequence[str]) -> tuple[str | None, str]:
        """`sbatch --parsable ARGS`: the job id (None when refused) and what sbatch said."""
        proc = self.run(["sbatch", "--parsable", *args])
        if proc is None:
            return None, "sbatch is not on PATH or did not answer"
        said = " ".join((proc.stderr + " " + proc.stdout).split())
        if proc.returncode != 0:
            return None, said or f"sbatch exited {proc.returncode}"
        job = proc.stdout.strip().split(";")[0]
        return (job, said) if job.isdigit() else (None, said)

    def test_only(self, args: Sequence[str]) -> tuple[bool, str]:
        """Ask `sbatch --test-only ARGS` whether Slurm would accept the job; nothing is submitted.

        Returns the verdict and Slurm's answer (where and when it would start, or why not).
        """
        proc = self.run(["sbatch", "--test-only", *args])
        if proc is None:
            return False, "sbatch is not on PATH or did not answer"
        said = " ".join((proc.stderr + " " + proc.stdout).split())
        return proc.returncode == 0, said.removeprefix("sbatch: ")

    def pending_reason(self, job_id: str) -> str | None:
        """Why a pending job waits (squeue's reason), None when it is not pending."""
        proc = self.run(["squeue", "-j", job_id, "-t", "PD", "-o", "%r"])
        if proc is None or proc.returncode != 0:
            return None
        reasons = self._rows("squeue", proc.stdout, ["REASON"], lambda r: r["REASON"].strip())
        return next((r for r in reasons if r), None)

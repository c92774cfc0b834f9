"""`--sbatch-arg KEY=VALUE` checked against sbatch's own options.

A key sbatch does not know is a typo; a key the toolkit sets itself is refused, naming the
flag that sets it.
"""

from __future__ import annotations

import difflib
import re

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import SubmitSpec
from mjlab_hpc.validate.places import sbatch_value

__all__ = ["SBATCH_OPTIONS", "sbatch_options"]

#: sbatch's long options (Slurm 22.05-24.11).
SBATCH_OPTIONS = frozenset(
    [
        "account",
        "acctg-freq",
        "array",
        "batch",
        "bb",
        "bbf",
        "begin",
        "chdir",
        "cluster-constraint",
        "clusters",
        "comment",
        "constraint",
        "container",
        "container-id",
        "contiguous",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "cpus-per-task",
        "deadline",
        "delay-boot",
        "dependency",
        "distribution",
        "error",
        "exclude",
        "exclusive",
        "export",
        "export-file",
        "extra",
        "extra-node-info",
        "get-user-env",
        "gid",
        "gpu-bind",
        "gpu-freq",
        "gpus",
        "gpus-per-node",
        "gpus-per-socket",
        "gpus-per-task",
        "gres",
        "gres-flags",
        "hint",
        "hold",
        "ignore-pbs",
        "input",
        "job-name",
        "kill-on-invalid-dep",
        "licenses",
        "mail-type",
        "mail-user",
        "mcs-label",
        "mem",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "mincpus",
        "network",
        "nice",
        "no-kill",
        "no-requeue",
        "nodefile",
        "nodelist",
        "nodes",
        "ntasks",
        "ntasks-per-core",
        "ntasks-per-gpu",
        "ntasks-per-node",
        "ntasks-per-socket",
        "open-mode",
        "output",
        "overcommit",
        "oversubscribe",
        "parsable",
        "partition",
        "power",
        "prefer",
        "priority",
        "profile",
        "propagate",
        "qos",
        "quiet",
        "reboot",
        "requeue",
        "reservation",
        "segment",
        "signal",
        "sockets-per-node",
        "spread-job",
        "switches",
        "test-only",
        "thread-spec",
        "threads-per-core",
        "time",
        "time-min",
        "tmp",
        "tres-bind",
        "tres-per-task",
        "uid",
        "usage",
        "use-min-nodes",
        "verbose",
        "version",
        "wait",
        "wait-all-nodes",
        "wckey",
        "wrap",
    ]
)
# What the toolkit sets itself, and the flag that sets it.
_RESERVED = {
    "time": "--time",
    "signal": "--preempt-signal and --signal-delay-s",
    "requeue": "nothing (jobs are always requeueable)",
    "no-requeue": "nothing (jobs must be requeueable to survive preemption)",
    "nodes": "--nodes",
    "ntasks": "--nodes and --tasks-per-node",
    "ntasks-per-node": "--tasks-per-node",
    "gpus-per-node": "--gpus-per-node",
    "gpus": "--gpus-per-node",
    "gres": "--gpus-per-node",
    "cpus-per-task": "--cpus-per-task",
    "mem": "--mem",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "exclusive": "--exclusive",
    "job-name": "--job-name",
    "array": "--sweep",
    "output": "nothing (output paths are the run directory's)",
    "error": "nothing (output paths are the run directory's)",
    "open-mode": "nothing (logs are appended across requeues)",
    "chdir": "nothing (paths in the job are absolute)",
    "export": "nothing (the job needs the submitting environment)",
    "wrap": "nothing (the toolkit writes the script)",
    "parsable": "nothing",
    "test-only": "nothing",
    "wait": "--follow",
    "hold": "nothing",
    "dependency": "--after JOBID (or --chain N)",
    "uid": "nothing",
    "gid": "nothing",
    "batch": "nothing",
    # Other spellings of the same resources: Slurm refuses them beside ours, or they change
    # how ranks meet GPUs and cores behind the flags' backs.
    "time-min": "--time",
    "mem-per-cpu": "--mem",
    "mem-per-gpu": "--mem",
    "cpus-per-gpu": "--cpus-per-task",
    "gpus-per-task": "--gpus-per-node",
    "gpus-per-socket": "--gpus-per-node",
    "tres-per-task": "--gpus-per-node and --cpus-per-task",
    "ntasks-per-gpu": "--tasks-per-node",
    "ntasks-per-core": "--tasks-per-node",
    "ntasks-per-socket": "--tasks-per-node",
    "container": "--container",
    "container-id": "--container",
    "input": "nothing (a job reads no standard input)",
    "export-file": "nothing (the job needs the submitting environment)",
    "get-user-env": "nothing (the job needs the submitting environment)",
    "clusters": "nothing (status, cancel and requeue talk to the cluster submitted from)",
    "nodefile": "--nodes (or --sbatch-arg nodelist=...)",
    "version": "nothing",
    "usage": "nothing",
}
# sbatch's one-letter options, by the long option each stands for.
_SHORT = {
    "A": "account",
    "a": "array",
    "B": "extra-node-info",
    "b": "begin",
    "C": "constraint",
    "c": "cpus-per-task",
    "D": "chdir",
    "d": "dependency",
    "e": "error",
    "F": "nodefile",
    "G": "gpus",
    "H": "hold",
    "i": "input",
    "J": "job-name",
    "k": "no-kill",
    "L": "licenses",
    "M": "clusters",
    "m": "distribution",
    "N": "nodes",
    "n": "ntasks",
    "o": "output",
    "p": "partition",
    "Q": "quiet",
    "q": "qos",
    "S": "core-spec",
    "s": "oversubscribe",
    "t": "time",
    "V": "version",
    "v": "verbose",
    "W": "wait",
    "w": "nodelist",
    "x": "exclude",
}
# Options that take no value (or an optional one): only these may be given as a bare KEY.
_BARE = frozenset(
    [
        "contiguous",
        "ignore-pbs",
        "no-kill",
        "overcommit",
        "oversubscribe",
        "reboot",
        "spread-job",
        "use-min-nodes",
        "nice",
        "propagate",
        "quiet",
        "verbose",
        "exclusive",
    ]
)
_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def _allowed_anyway(key: str, value: str | None, spec: SubmitSpec) -> bool:
    """Whether a reserved key is used in a way the flags leave alone.

    Such uses are a generic resource that is not a GPU (`gres=lscratch:100`), an exclusivity
    the flag cannot say (`exclusive=user`), and memory or CPUs per GPU/CPU when --mem or
    --cpus-per-task are not given.
    """
    if key == "gres":
        return value is not None and "gpu" not in value.lower()
    if key == "exclusive":
        return value is not None and value.strip() != ""
    if key in ("mem-per-cpu", "mem-per-gpu"):
        return spec.mem is None and value is not None
    if key == "cpus-per-gpu":
        return spec.cpus_per_task is None and value is not None
    return False


def sbatch_options(spec: SubmitSpec) -> dict[str, str | bool]:
    """Parse the --sbatch-arg KEY=VALUE pairs into {option: value} (a bare KEY is a flag).

    SpecError for a malformed pair, a key sbatch does not know, or one the toolkit sets
    itself (naming the flag that does).
    """
    out: dict[str, str | bool] = {}
    for item in spec.sbatch_arg:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        key = _SHORT.get(key, key)  # `o=...` is `output=...`: judged as sbatch reads it
        if not _KEY.match(key):
            raise SpecError(
                "--sbatch-arg", f"{item!r} is not KEY=VALUE with an sbatch option as KEY"
            )
        if key in _RESERVED and not _allowed_anyway(key, value if sep else None, spec):
            raise SpecError(
                "--sbatch-arg", f"{key} is set by mjlab-submit itself: use {_RESERVED[key]}"
            )
        if key not in SBATCH_OPTIONS:
            close = difflib.get_close_matches(key, SBATCH_OPTIONS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SpecError("--sbatch-arg", f"{key} is not an sbatch option{hint}")
        if not sep and key not in _BARE:
            raise SpecError("--sbatch-arg", f"{key} needs a value: --sbatch-arg {key}=VALUE")
        out[key] = sbatch_value("--sbatch-arg", value) if sep else True
    return out

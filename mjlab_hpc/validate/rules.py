"""The rules a value must follow, from the flags' own rules (bounds, names, signals) to the
place it ends up in: a path component, an `#SBATCH` value, a shell line, a Slurm name, an sbatch
option. Each check returns the value or raises SpecError naming the flag and what would work.

Values are refused rather than escaped where escaping cannot keep them in place: a newline or
another control character would end an `#SBATCH` line (what follows runs as a command), and a
`/` or `..` in a name that becomes a folder would write outside the log root.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import shutil
import subprocess
import unicodedata
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.slurm.units import check_mem, slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, TrainSpec
from mjlab_hpc.tasks import registry

__all__ = [
    "MAX_ENVS_PER_RANK",
    "NAME_MAX",
    "RUN_NAME_PREFIX",
    "SBATCH_OPTIONS",
    "check_job_paths",
    "check_submit",
    "check_train",
    "job_name",
    "no_control",
    "path_component",
    "positive_seconds",
    "resolve",
    "sbatch_options",
    "sbatch_value",
    "shell_line",
    "slurm_name",
]

#: More environments than this on one rank is a typo (Warp indexes worlds with 32 bits).
MAX_ENVS_PER_RANK = 2**24
_NOT_FINITE = frozenset({"nan", "inf", "infinity"})
#: What a run's folder name holds before the run name: `2026-11-23_09-12-51_`.
RUN_NAME_PREFIX = "YYYY-mm-dd_HH-MM-SS_"
# Signals Slurm can send ahead of the time limit that no library we load relies on, and
# that mean nothing else to a rank (INT, HUP and TERM are stops by a user or a scheduler).
_SIGNALS = ("USR2", "USR1", "URG")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")
#: The longest file or folder name Linux filesystems take, in bytes.
NAME_MAX = 255

# C0 and C1 control characters and Unicode's line and paragraph separators: each ends a line
# for somebody (bash, Python's splitlines, a terminal).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Invisible format characters (bidi overrides and isolates, zero-width spaces, BOM, soft
# hyphen, tags) and lone surrogates (bytes that are not UTF-8): they reorder or hide what
# `ls`, status tables and logs show. The joiners ZWJ/ZWNJ stay: words of Persian and Indic
# scripts need them.
_JOINERS = frozenset({"\u200c", "\u200d"})
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+@:,-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.+@:,&|()\[\]*!-]+$")


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def no_control(flag: str, value: str, allow_tab: bool = False) -> str:
    """`value` without newlines or other control characters (they would end a script line or a
    log record)."""
    bad = _CONTROL.search(value.replace("\t", "") if allow_tab else value)
    if bad:
        raise SpecError(
            flag,
            f"{_shown(value)} holds the control character {bad.group()!r} (a newline would end "
            "the line it is written into); remove it",
        )
    for char in value:
        kind = unicodedata.category(char)
        if kind == "Cs":
            raise SpecError(flag, f"{_shown(value)} holds bytes that are not UTF-8; use UTF-8")
        if kind == "Cf" and char not in _JOINERS:
            raise SpecError(
                flag,
                f"{_shown(value)} holds U+{ord(char):04X} ({unicodedata.name(char, '?')}), an "
                "invisible character that reorders or hides what ls, status and logs show; "
                "remove it",
            )
    return value


def path_component(flag: str, value: str, reserved: int = 0) -> str:
    """A name that becomes one folder: not empty, no `/`, not `.`/`..`, not hidden, no control
    characters, and short enough that it fits NAME_MAX with `reserved` more bytes (a
    timestamp and suffix around a run name)."""
    no_control(flag, value)
    if not value:
        raise SpecError(flag, "must not be empty")
    if value != value.strip():
        # Records are read back stripped: a requeued job would look for another folder.
        raise SpecError(flag, f"{_shown(value)} starts or ends with white space; remove it")
    if "/" in value or value in (".", ".."):
        raise SpecError(
            flag, f"{_shown(value)} must be a plain name without '/' (a folder of its own)"
        )
    if value.startswith("."):
        raise SpecError(
            flag, f"{_shown(value)} must not start with '.' (hidden folders are the toolkit's)"
        )
    size = len(os.fsencode(value))
    if size + reserved > NAME_MAX:
        chars = f" ({len(value)} characters)" if len(value) != size else ""
        raise SpecError(
            flag,
            f"{size} bytes{chars} is too long: a folder name holds at most {NAME_MAX} bytes "
            f"({reserved} of them are taken by the timestamp); use at most "
            f"{NAME_MAX - reserved} bytes (a non-ASCII character takes 2-4)",
        )
    return value


def check_job_paths(resolved: ResolvedSpec) -> None:
    """The user's pieces of a job's file paths hold no `%`. Slurm expands %-patterns in the
    --output/--error paths of sbatch and srun (`%j` the job id, `%x` the job name, `%20x`),
    and submitit replaces `%j`, `%t`, `%A`, `%a` in its folder by plain text substitution, so
    no escape keeps such a path exact in both: a run would split over two directories, or
    its job fail at launch with no log anywhere."""
    train = resolved.train
    for flag, value in (
        ("--log-root", str(Path(train.log_root).absolute())),
        ("--run-dir", str(Path(train.run_dir).absolute()) if train.run_dir else ""),
        ("--experiment-name", resolved.experiment_name),
        ("--run-name", train.run_name),
    ):
        if "%" in value:
            raise SpecError(
                flag,
                f"{_shown(value)} holds '%', which Slurm and submitit expand in the job's "
                "file names (%j: the job id, %x: the job name), so the run's files would "
                "not stay in one place: use a name (and folder) without '%'",
            )


def sbatch_value(flag: str, value: str) -> str:
    """A value written into an `#SBATCH` line (quoted there): no control characters."""
    return no_control(flag, value)


def job_name(flag: str, value: str) -> str:
    """A Slurm job name: an `#SBATCH` value that also fills `%x` in output paths, so no `/`
    either (it would put the batch log outside its folder)."""
    no_control(flag, value)
    if not value.strip():
        raise SpecError(flag, "must not be empty")
    if "/" in value:
        raise SpecError(
            flag, f"{_shown(value)} holds '/', and Slurm puts the job name into file names "
            "(%x); use a name without '/'"
        )  # fmt: skip
    return value


def slurm_name(flag: str, value: str, constraint: bool = False) -> str:
    """A Slurm partition, account or QOS name (comma-separated lists allowed), or with
    `constraint` a feature expression (`a100&ib`, `[a|b]`)."""
    no_control(flag, value)
    pattern = _CONSTRAINT if constraint else _SLURM_NAME
    if not pattern.match(value):
        allowed = "letters, digits and _.+@:,-" + ("&|()[]*!" if constraint else "")
        raise SpecError(flag, f"{_shown(value)} is not a Slurm name (allowed: {allowed})")
    return value


def shell_line(flag: str, value: str) -> str:
    """One complete shell line (a `--setup` command): no newline or other control character
    but tab, and it parses (`bash -n`; shlex where bash is missing)."""
    no_control(flag, value, allow_tab=True)
    if not value.strip():
        raise SpecError(flag, "is empty: give a command (e.g. 'module load cuda')")
    if value.lstrip().startswith("#"):
        # sbatch reads `#SBATCH` lines up to the first command, and submitit's script has none
        # before its setup lines: such a line would change the job's options.
        raise SpecError(
            flag,
            f"{_shown(value)} is a comment (an #SBATCH line would change the job): give a "
            "command, and set job options with mjlab-submit's flags or --sbatch-arg",
        )
    if re.search(r"(?<!\\)(\\\\)*\\\s*$", value):
        # A line continued into the next would take the next line (the next --setup, or the
        # command that starts the ranks) as its arguments.
        raise SpecError(flag, f"{_shown(value)} ends with '\\' (continued into the next line)")
    bash = shutil.which("bash")
    if bash is not None:
        # The line, then a marker line: bash must parse both as commands, without a warning
        # (an open here-document parses, but swallows every line after it).
        proc = subprocess.run([bash, "-n"], input=value + "\n:\n", capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if proc.returncode != 0 or proc.stderr.strip():
            why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "a syntax error"
            why = re.sub(r"^.*?line \d+: ", "", why)
            raise SpecError(flag, f"{_shown(value)} is not a complete shell line ({why})")
        return value
    try:
        shlex.split(value)
    except ValueError as exc:
        raise SpecError(flag, f"{_shown(value)} is not a complete shell line ({exc})") from None
    return value


def positive_seconds(flag: str, value: float, minimum: float = 0.0) -> float:
    """A finite duration of at least `minimum` seconds (nan and inf are refused)."""
    if not math.isfinite(value) or value < minimum:
        raise SpecError(flag, f"must be a number of seconds >= {minimum:g}, got {value}")
    return value


def _within(flag: str, value: int | None, low: int, high: int) -> None:
    if value is not None and value < low:
        raise SpecError(flag, f"must be >= {low}, got {value}")
    if value is not None and value > high:
        raise SpecError(flag, f"must be at most {high}, got {value}")


def check_train(spec: TrainSpec) -> TrainSpec:
    """The training spec, or SpecError naming the flag for a value no launcher could run."""
    # Upper bounds: far above any real run, below what torch, Warp and the OS overflow on.
    for flag, value, low, high in (
        ("--num-envs", spec.num_envs, 1, MAX_ENVS_PER_RANK),
        ("--max-iterations", spec.max_iterations, 1, 10**9),
        ("--save-interval", spec.save_interval, 1, 10**9),
        ("--num-procs", spec.num_procs, 1, 4096),
        ("--torch-threads", spec.torch_threads, 0, 4096),
        ("--seed", spec.seed, -(2**62), 2**62),
    ):
        _within(flag, value, low, high)
    if not math.isfinite(spec.dist_timeout_s) or spec.dist_timeout_s <= 0:
        raise SpecError("--dist-timeout-s", f"must be > 0 seconds, got {spec.dist_timeout_s}")
    if spec.hang_timeout_s is not None and (
        not math.isfinite(spec.hang_timeout_s) or spec.hang_timeout_s <= 0
    ):
        raise SpecError(
            "--hang-timeout-s",
            f"must be > 0 seconds, got {spec.hang_timeout_s} (`none` disables the hang watchdog)",
        )
    if spec.save_every_min is not None and (
        not math.isfinite(spec.save_every_min) or spec.save_every_min <= 0
    ):
        raise SpecError(
            "--save-every-min",
            f"must be > 0 minutes, got {spec.save_every_min} (`none`: iterations only)",
        )
    if isinstance(spec.gpu_ids, tuple) and any(i < 0 for i in spec.gpu_ids):
        raise SpecError("--gpu-ids", f"ids must be >= 0, got {list(spec.gpu_ids)}")
    if isinstance(spec.gpu_ids, tuple) and len(set(spec.gpu_ids)) != len(spec.gpu_ids):
        raise SpecError("--gpu-ids", f"ids must be distinct, got {list(spec.gpu_ids)}")
    if spec.num_procs > 1 and spec.gpu_ids not in ("auto", None):
        raise SpecError(
            "--num-procs",
            "starts CPU ranks; it cannot be combined with --gpu-ids "
            "(use --gpu-ids 0 1 ... for one rank per GPU)",
        )
    if spec.keep_checkpoints < 0:
        raise SpecError("--keep-checkpoints", f"must be >= 0, got {spec.keep_checkpoints}")
    if spec.max_restarts < 0:
        raise SpecError("--max-restarts", f"must be >= 0, got {spec.max_restarts}")
    name = spec.preempt_signal.upper().removeprefix("SIG")
    if name not in _SIGNALS:
        raise SpecError(
            "--preempt-signal", f"{spec.preempt_signal!r}: use one of {', '.join(_SIGNALS)}"
        )
    no_control("--log-root", spec.log_root)
    if not spec.log_root.strip():
        raise SpecError("--log-root", "must not be empty (default: logs)")
    for flag, path in (("--log-root", spec.log_root), ("--run-dir", spec.run_dir)):
        if path is not None and path.startswith("~"):
            # No shell expanded it (it was quoted), and the job script would not either.
            raise SpecError(flag, f"{path!r}: '~' is not expanded here; write $HOME/... "
                            "or the full path")  # fmt: skip
    if spec.experiment_name is not None:
        path_component("--experiment-name", spec.experiment_name)
    if spec.run_name:
        # The run's folder is <YYYY-mm-dd_HH-MM-SS>_<run-name>[-<n>].
        path_component("--run-name", spec.run_name, reserved=len(RUN_NAME_PREFIX) + 5)
    if spec.run_dir is not None:
        no_control("--run-dir", spec.run_dir)
        if not spec.run_dir.strip():
            raise SpecError("--run-dir", "must not be empty: name a run directory")
    for flag, low, value in (("--video-length", 1, spec.video_length),
                             ("--video-interval", 1, spec.video_interval)):  # fmt: skip
        if not low <= value <= 10**9:
            raise SpecError(flag, f"must be between {low} and 10^9, got {value}")
    for flag, text in (("--registry-name", spec.registry_name),
                       ("--wandb-run-path", spec.wandb_run_path),
                       ("--torchrunx-log-dir", spec.torchrunx_log_dir)):  # fmt: skip
        if text is not None:
            no_control(flag, text)
    if spec.wandb_run_path is not None and not spec.wandb_run_path.strip("/ "):
        raise SpecError("--wandb-run-path", "must name a W&B run: entity/project/run-id")
    if spec.wandb_checkpoint_name is not None:
        path_component("--wandb-checkpoint-name", spec.wandb_checkpoint_name)
    flag = "--env/--agent"
    for arg in spec.overrides:
        no_control(flag, arg)
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
        else:
            value = arg
        if value.strip().lower().lstrip("+-") in _NOT_FINITE:
            raise SpecError(flag, f"{value!r} is no setting (nan and inf are refused)")
    return spec


#: sbatch's long options (Slurm 22.05-24.11), for --sbatch-arg: a key not among them is a typo.
SBATCH_OPTIONS = frozenset((
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir",
    "cluster-constraint", "clusters", "comment", "constraint", "container", "container-id",
    "contiguous", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task",
    "deadline", "delay-boot", "dependency", "distribution", "error", "exclude", "exclusive",
    "export", "export-file", "extra", "extra-node-info", "get-user-env", "gid", "gpu-bind",
    "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
    "gres-flags", "hint", "hold", "ignore-pbs", "input", "job-name", "kill-on-invalid-dep",
    "licenses", "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu",
    "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "no-requeue", "nodefile", "nodelist",
    "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
    "ntasks-per-socket", "open-mode", "output", "overcommit", "oversubscribe", "parsable",
    "partition", "power", "prefer", "priority", "profile", "propagate", "qos", "quiet", "reboot",
    "requeue", "reservation", "segment", "signal", "sockets-per-node", "spread-job", "switches",
    "test-only", "thread-spec", "threads-per-core", "time", "time-min", "tmp", "tres-bind",
    "tres-per-task", "uid", "usage", "use-min-nodes", "verbose", "version", "wait",
    "wait-all-nodes", "wckey", "wrap",
))  # fmt: skip
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
    "A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint",
    "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile",
    "G": "gpus", "H": "hold", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses",
    "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks", "o": "output",
    "p": "partition", "Q": "quiet", "q": "qos", "S": "core-spec", "s": "oversubscribe",
    "t": "time", "V": "version", "v": "verbose", "W": "wait", "w": "nodelist", "x": "exclude",
}  # fmt: skip
# Options that take no value (or an optional one): only these may be given as a bare KEY.
_BARE = frozenset((
    "contiguous", "ignore-pbs", "no-kill", "overcommit", "oversubscribe", "reboot",
    "spread-job", "use-min-nodes", "nice", "propagate", "quiet", "verbose", "exclusive",
))  # fmt: skip
_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def _allowed_anyway(key: str, value: str | None, spec: SubmitSpec) -> bool:
    """Reserved keys in a use the flags leave alone: a generic resource that is not a GPU
    (`gres=lscratch:100`), an exclusivity the flag cannot say (`exclusive=user`), memory or
    CPUs per GPU/CPU when --mem / --cpus-per-task are not given."""
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
    """--sbatch-arg KEY=VALUE pairs (a bare KEY is a flag). SpecError for a malformed one, a
    key sbatch does not know, or one the toolkit sets itself (naming the flag that does)."""
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


def resolve(spec: TrainSpec) -> ResolvedSpec:
    """The spec checked (`check_train`) and its task resolved (`mjlab_hpc.tasks.registry`):
    what every entry point starts with. mjlab's --agent.save-interval and --agent.run-name
    change the spec as they resolve; the changed spec is checked too."""
    resolved = registry.resolve(check_train(spec))
    if resolved.train != spec:
        check_train(resolved.train)
    return resolved


def check_submit(spec: SubmitSpec) -> SubmitSpec:
    """The submission (its training spec included), or SpecError naming the flag for a value
    no cluster could run."""
    check_train(spec.train)
    for flag, value, low, high in (
        # Far above any cluster, below what sbatch or the ranks overflow on: a typo.
        ("--nodes", spec.nodes, 1, 100_000),
        ("--spare-nodes", spec.spare_nodes, 0, 100_000),
        ("--gpus-per-node", spec.gpus_per_node, 0, 1024),
        ("--tasks-per-node", spec.tasks_per_node, 1, 4096),
        ("--cpus-per-task", spec.cpus_per_task, 1, 4096),
        ("--array-parallelism", spec.array_parallelism, 1, 10**6),
        ("--signal-delay-s", spec.signal_delay_s, 1, 10**7),
    ):
        _within(flag, value, low, high)
    if spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nodes:
        raise SpecError(
            "--min-nodes",
            f"must be between 1 and --nodes ({spec.nodes}), got {spec.min_nodes}: the fewest "
            "nodes the run may go on with after a node fails",
        )
    if not 1 <= spec.chain <= 1000:
        raise SpecError("--chain", f"must be between 1 and 1000 jobs, got {spec.chain}")
    if spec.gpus_per_node > 0 and spec.ranks_per_node != spec.gpus_per_node:
        raise SpecError(
            "--tasks-per-node",
            f"{spec.ranks_per_node} ranks for {spec.gpus_per_node} GPUs per node: the job "
            "runs one rank per GPU; drop --tasks-per-node or make it equal --gpus-per-node",
        )
    if spec.mem is not None:
        check_mem(spec.mem)
    minutes = slurm_time_minutes(spec.time)
    if spec.signal_delay_s >= minutes * 60:
        raise SpecError(
            "--signal-delay-s",
            f"{spec.signal_delay_s} s is not shorter than --time {spec.time}; "
            "the warning must come before the limit",
        )
    for flag, value in (("--partition", spec.partition), ("--account", spec.account),
                        ("--qos", spec.qos)):  # fmt: skip
        if value is not None:
            slurm_name(flag, value)
    if spec.constraint is not None:
        slurm_name("--constraint", spec.constraint, constraint=True)
    if spec.job_name is not None:
        job_name("--job-name", spec.job_name)
    for line in spec.setup:
        shell_line("--setup", line)
    if spec.container is not None:
        no_control("--container", spec.container)
    if spec.container_image is not None:
        no_control("--container-image", spec.container_image)
        if spec.container is not None:
            raise SpecError("--container-image", "one image: drop --container (Apptainer) or "
                            "--container-image (pyxis)")  # fmt: skip
    if spec.train.num_procs != 1:
        raise SpecError("--num-procs", "mjlab-submit starts ranks itself: use --tasks-per-node")
    if spec.train.gpu_ids != "auto":
        raise SpecError("--gpu-ids", "mjlab-submit gives each rank its GPU: use --gpus-per-node")
    sbatch_options(spec)
    for job in spec.after:
        if not _JOB_ID.fullmatch(job):
            raise SpecError("--after", f"{job!r} is not a Slurm job id (4711, or 4711_2)")
    if not spec.sweep and spec.array_parallelism is not None:
        raise SpecError("--array-parallelism", "throttles a sweep: use it with --sweep")
    if spec.sweep and spec.train.run_dir:
        raise SpecError("--run-dir", "a sweep makes one run directory per element")
    if spec.sweep and spec.train.resume:
        raise SpecError("--resume", "a sweep starts new runs; resume each run by itself")
    return spec

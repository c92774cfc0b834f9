"""The Slurm job script, one home for every form of it.

The forms: the script submitit submits for a SubmitSpec (its sbatch parameters, the code
snapshot's PYTHONPATH, the heal step after srun); the plain-sbatch templates filled from the
same parameters (`mjlab-hpc render`, from `slurm_templates/`); and the srun command that
starts the ranks inside an existing allocation (salloc, an interactive job) instead of a new
job. `launch/plan` decides each once for a submission; what is here renders and runs them.

A template is a shell script with `{{NAME}}` placeholders. Values are shell-quoted here, so no
user string (a run name with `;` or `$(...)`) can run a command. A line holding a placeholder
whose value is None (an option the user did not set) is left out.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mjlab_hpc.errors import SpecError
from mjlab_hpc.launch.batch_loop import heal_loop, heal_options
from mjlab_hpc.launch.executors import SlurmJobExecutor
from mjlab_hpc.launch.follow import Closing, follow_to_end
from mjlab_hpc.rank.context import ALLOCATION_ENV, CHAIN_ENV, SIGNAL_DELAY_ENV, Allocation
from mjlab_hpc.rundir.layout import LOGS_DIR, SUBMITIT_DIR
from mjlab_hpc.rundir.snapshot import import_path, snapshot_for, with_snapshot
from mjlab_hpc.slurm.client import SlurmClient
from mjlab_hpc.slurm.units import slurm_time_minutes
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec
from mjlab_hpc.validate.sbatch_args import sbatch_options

__all__ = [
    "TEMPLATE_NAMES",
    "allocation_env",
    "allocation_srun",
    "container_python",
    "heal_python",
    "job_script",
    "pyxis_args",
    "read_template",
    "render_sbatch",
    "render_template",
    "run_in_allocation",
    "slurm_executor",
    "slurm_parameters",
    "step_shape",
    "template_context",
]


def slurm_parameters(
    spec: SubmitSpec, link: int = 1, after: Sequence[str] = (), snapshot: str | None = None
) -> dict[str, Any]:
    """Return submitit's SlurmExecutor parameters for a validated spec.

    They are those of job `link` of its --chain, which starts once the jobs `after` ended.
    `snapshot`: the code snapshot's import roots, put first on PYTHONPATH for every rank and
    requeue.
    """
    # The time-limit signal's delay: a time limit that leaves no start-up is not requeued.
    setup = [f"export {SIGNAL_DELAY_ENV}={spec.signal_delay_s}", *spec.setup]
    if spec.chain > 1:  # the ranks leave a time-limit stop to the next job of the chain
        setup.insert(0, f"export {CHAIN_ENV}={link}/{spec.chain}")
    if snapshot:  # before --setup: a `conda activate` there keeps PYTHONPATH
        path = f"export PYTHONPATH={shlex.quote(snapshot)}${{PYTHONPATH:+:$PYTHONPATH}}"
        # `python -m` would put the working directory (the checkout) first otherwise.
        setup[:0] = [path, "export PYTHONSAFEPATH=1"]
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": spec.nodes + spec.spare_nodes,
        "ntasks_per_node": spec.ranks_per_node,
        "time": slurm_time_minutes(spec.time),
        "signal_delay_s": spec.signal_delay_s,
        # A dead rank ends the whole step instead of leaving the others in a collective.
        "srun_args": ["--kill-on-bad-exit=1", *pyxis_args(spec), *step_shape(spec)],
        # submitit writes --signal=USR2@delay; this also honours --preempt-signal.
        "additional_parameters": {
            "requeue": True,
            "signal": f"{spec.preempt_signal}@{spec.signal_delay_s}",
            **sbatch_options(spec),
        },
        "setup": setup,
    }
    if spec.spare_nodes or spec.min_nodes is not None:
        # A node failure must not end the allocation (Slurm's default, at SlurmdTimeout): the
        # healer goes on without the node, on a spare or on fewer nodes.
        params["additional_parameters"]["no_kill"] = True
    if after:
        params["additional_parameters"]["dependency"] = "afterany:" + ":".join(after)
    if spec.gpus_per_node > 0:
        params["gpus_per_node"] = spec.gpus_per_node
    optional = {
        "cpus_per_task": spec.cpus_per_task,
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    if spec.mem is not None:
        params["additional_parameters"]["mem"] = spec.mem
    if spec.exclusive:
        params["exclusive"] = True
    return params


def step_shape(spec: SubmitSpec) -> list[str]:
    """Return srun's options for a step on --nodes of the job's nodes.

    There are none without spare nodes: the step takes the whole allocation.
    """
    if not spec.spare_nodes:
        return []
    return [f"--nodes={spec.nodes}", f"--ntasks={spec.world_size}"]


def pyxis_args(spec: SubmitSpec) -> list[str]:
    """Return srun's options that start a step in the pyxis image.

    There are none without --container-image. The log root is mounted at its own path.
    """
    if spec.container_image is None:
        return []
    root = Path(spec.train.log_root).resolve()
    return [f"--container-image={spec.container_image}", f"--container-mounts={root}:{root}"]


def heal_python(spec: SubmitSpec) -> str | None:
    """Return how the batch script's heal step runs Python, where it differs from the ranks'.

    With pyxis it is a one-task step in the image (the batch shell is outside it); else None.
    """
    if spec.container_image is None:
        return None
    return shlex.join(["srun", "--nodes=1", "--ntasks=1", *pyxis_args(spec)]) + " python3"


def container_python(spec: SubmitSpec, run_dir: Path) -> str | None:
    """The command that runs Python inside the image on every rank (None: no container)."""
    if spec.container_image is not None:
        return "python3"  # srun starts the image (pyxis): its own Python
    if spec.container is None:
        return None
    image = str(Path(spec.container).resolve())
    nv = " --nv" if spec.gpus_per_node > 0 else ""
    bind = shlex.quote(str(run_dir.parent.parent.resolve()))
    # Apptainer where installed, else Singularity (its former name, still common).
    return (
        '"$(command -v apptainer || command -v singularity)" exec'
        f"{nv} --bind {bind} {shlex.quote(image)} python3"
    )


def slurm_executor(
    spec: SubmitSpec,
    folder_parent: Path,
    parameters: dict[str, Any],
    sweep: bool = False,
    script: str | None = None,
) -> Any:
    """Return a submitit SlurmExecutor writing into `<folder_parent>/submitit`.

    `parameters`: submitit's (`slurm_parameters`). `sweep`: a sweep's job array, whose
    `folder_parent` is the sweep's directory. `script`: the batch script it submits, as
    planned (None: it renders its own, and submits nothing: a dry run).
    """
    executor = SlurmJobExecutor(
        folder=folder_parent / SUBMITIT_DIR,
        python=container_python(spec, folder_parent),
        max_restarts=spec.train.max_restarts,
        render_only=script is None,
        heal_python=heal_python(spec),
        step_nodes=spec.nodes if spec.spare_nodes else None,
        min_nodes=spec.min_nodes,
        tasks_per_node=spec.ranks_per_node,
        sweep=sweep,
        script=script,
    )
    executor.update_parameters(**parameters)
    return executor


def job_script(
    spec: SubmitSpec,
    folder_parent: Path,
    snapshot: dict[str, Any] | None,
    link: int = 1,
    after: Sequence[str] = (),
    count: int = 0,
) -> tuple[dict[str, Any], str]:
    """submitit's parameters and the exact batch script of job `link` of the spec's --chain.

    It starts once the jobs `after` ended, runs from the code record `snapshot` (None: the
    code as it is), and writes into `<folder_parent>/submitit`. `count`: a sweep's elements,
    one job array of them (0: one job).
    """
    roots = import_path(snapshot) if snapshot else None
    params = slurm_parameters(spec, link=link, after=after, snapshot=roots)
    if count and spec.array_parallelism is not None:
        params["array_parallelism"] = spec.array_parallelism
    executor = slurm_executor(spec, folder_parent, params, sweep=bool(count))
    if count:
        executor.parameters["map_count"] = count  # what submitit sets when it submits an array
    return params, executor.script()


def render_sbatch(
    spec: SubmitSpec,
    run_dir: Path,
    snapshot: dict[str, Any] | None = None,
    link: int = 1,
    after: Sequence[str] | None = None,
) -> str:
    """Return the exact sbatch script submitit submits for this spec into `run_dir`.

    It is job `link` of its --chain, after the jobs `after` (default: --after). `snapshot`:
    the code record whose import roots the script puts first (default: the run's own).
    """
    record = snapshot if snapshot is not None else snapshot_for(run_dir)
    return job_script(spec, run_dir, record, link, spec.after if after is None else after)[1]


# Plain-sbatch templates.

TEMPLATE_NAMES = ("train", "train_apptainer")
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def read_template(name: str) -> str:
    """Return a template's text, by name or by path.

    The named ones (`train`, `train_apptainer`) ship inside the package, so an installed wheel
    has them.
    """
    path = Path(name)
    if path.is_file():
        return path.read_text()
    if name in TEMPLATE_NAMES:
        return (resources.files("mjlab_hpc") / "slurm_templates" / f"{name}.sbatch").read_text()
    raise SpecError(
        "TEMPLATE",
        f"no template {name!r}: use one of {', '.join(TEMPLATE_NAMES)} or a path to a file",
    )


def template_context(
    spec: SubmitSpec,
    resolved: ResolvedSpec,
    parameters: dict[str, Any],
    train_args: Sequence[str],
    run_dir: Path | None,
) -> dict[str, str | None]:
    """Placeholder values, already quoted for the shell, of a validated spec.

    The sbatch options are submitit's `parameters` of the same job, so the template's
    #SBATCH lines are those mjlab-submit submits. `train_args`: mjlab-train's arguments on
    every rank. `run_dir`: where the run trains (None: a new run, made by the job's first
    start with `mjlab-hpc run-dir --key`).
    """
    q = shlex.quote
    more = parameters["additional_parameters"]
    log_root = Path(resolved.train.log_root).resolve()

    def opt(value: object) -> str | None:
        return None if value is None else q(str(value))

    extra = [
        f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={q(str(v))}"
        for k, v in sbatch_options(spec).items()
    ]
    return {
        "JOB_NAME": q(parameters["job_name"]),
        "NODES": str(parameters["nodes"]),
        "TASKS_PER_NODE": str(parameters["ntasks_per_node"]),
        "GPUS_PER_NODE": opt(parameters.get("gpus_per_node")),
        "CPUS_PER_TASK": opt(parameters.get("cpus_per_task")),
        "MEM": opt(more.get("mem")),
        "PARTITION": opt(parameters.get("partition")),
        "ACCOUNT": opt(parameters.get("account")),
        "QOS": opt(parameters.get("qos")),
        "CONSTRAINT": opt(parameters.get("constraint")),
        "EXCLUSIVE": "--exclusive" if parameters.get("exclusive") else None,
        "NO_KILL": "--no-kill" if more.get("no_kill") else None,
        "TIME": str(parameters["time"]),
        "SIGNAL": more["signal"],
        "SIGNAL_DELAY_S": str(parameters["signal_delay_s"]),
        "BATCH_LOG": "slurm-%x-%j.out",
        "SBATCH_EXTRA": "\n".join(extra) or None,
        "SETUP": "\n".join(spec.setup) or None,  # shell lines by design: not quoted
        "RUN_DIR": q(str(run_dir) if run_dir is not None else ""),
        "LOG_ROOT": q(str(log_root)),
        # What an image sees of the host: the run's log root (where its record of keys is).
        "BIND": q(str(run_dir.parent.parent if run_dir is not None else log_root)),
        "EXPERIMENT": q(resolved.experiment_name),
        "RUN_NAME": q(resolved.train.run_name),
        "TRAIN_ARGS": " ".join(q(a) for a in train_args),
        "MAX_RESTARTS": str(spec.train.max_restarts),
        "IMAGE": opt(Path(spec.container).resolve() if spec.container else None),
        "NV": "--nv" if spec.gpus_per_node > 0 else "",
        "HEAL_LOOP": _template_loop(spec),
    }


def _template_loop(spec: SubmitSpec) -> str:
    """The heal loop of a template: its ranks run `${train[@]}`, its healer `${hpc[@]}`."""
    output = '--output="$RUN_DIR/logs/task-%j-%t.out"'
    return heal_loop(
        srun_options=" ".join(["--kill-on-bad-exit=1", "--unbuffered", output, *step_shape(spec)]),
        command='"${train[@]}"',
        hpc='"${hpc[@]}"',
        run_dir='"$RUN_DIR"',
        logs='"$RUN_DIR"/logs',
        max_restarts=spec.train.max_restarts,
        heal_options=heal_options(
            spec.nodes if spec.spare_nodes else None, spec.min_nodes, spec.ranks_per_node
        ),
    ).rstrip("\n")


def render_template(text: str, context: dict[str, str | None]) -> str:
    """Fill `{{NAME}}` placeholders; drop lines whose placeholder is None."""
    out = []
    for line in text.splitlines():
        names = _PLACEHOLDER.findall(line)
        unknown = [n for n in names if n not in context]
        if unknown:
            raise SpecError("TEMPLATE", f"unknown placeholder {{{{{unknown[0]}}}}} in: {line}")
        if any(context[n] is None for n in names):
            continue
        out.append(_PLACEHOLDER.sub(lambda m: str(context[m.group(1)]), line))
    return "\n".join(out) + "\n"


# Inside an existing allocation.


def allocation_srun(spec: SubmitSpec, train_args: Sequence[str], run_dir: Path) -> list[str]:
    """Return the srun command that starts every rank inside the current allocation.

    Every rank runs mjlab-train with `train_args` in `run_dir`. The step is named after the
    run directory (`mjlab-ranks-<hash>`).
    """
    python = container_python(spec, run_dir)
    step = f"mjlab-ranks-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
    argv = [
        "srun",
        f"--job-name={step}",
        f"--nodes={spec.nodes}",
        f"--ntasks={spec.world_size}",
        f"--ntasks-per-node={spec.ranks_per_node}",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        # The allocation's end, as a submitted job's: the ranks stop with a checkpoint, in
        # time (without it Slurm's SIGTERM at the end leaves only KillWait to save).
        f"--signal={spec.preempt_signal}@{spec.signal_delay_s}",
        f"--output={run_dir}/{LOGS_DIR}/task-%j.%s-%t.out",
    ]
    if spec.gpus_per_node > 0:
        argv.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    argv += pyxis_args(spec)
    run = [*shlex.split(python), "-u"] if python else [sys.executable, "-u"]
    return [*argv, *run, "-m", "mjlab_hpc.cli.train", *train_args, "--run-dir", str(run_dir)]


def allocation_env(alloc: Allocation, snapshot: dict[str, Any] | None) -> dict[str, str]:
    """Return the variables srun gets beside this process's own; a dry run prints them.

    They say that the allocation's ranks are not requeued, and put the code snapshot first on
    PYTHONPATH.
    """
    env = with_snapshot({**os.environ, ALLOCATION_ENV: alloc.job_id}, snapshot)
    return {k: v for k, v in sorted(env.items()) if os.environ.get(k) != v}


def run_in_allocation(
    argv: Sequence[str],
    env: dict[str, str],
    run_dir: Path,
    alloc: Allocation,
    resolved: ResolvedSpec,
    resume: str,
) -> Closing:
    """Run every rank with the srun command `argv` inside the allocation, to their end.

    `env`: the variables srun gets beside this process's own (`allocation_env`). It runs in
    the foreground: rank 0's progress is shown and this process's stop signals are
    forwarded: the first stops every rank at its next iteration boundary with a checkpoint,
    the second at once. Returns how the run ended.
    """
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    name = argv[1].removeprefix("--job-name=")
    # A session of its own: the terminal's Ctrl-C reaches srun only through us. srun takes a
    # single Ctrl-C as a request for its status, and ends the step on SIGTERM (SIGKILL after
    # KillWait, before the ranks' checkpoint): stops go to the ranks through scancel.
    proc = subprocess.Popen(
        list(argv),
        env={**os.environ, **env},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    slurm = SlurmClient(timeout_s=10)

    def to_ranks(sig: str) -> None:
        step = slurm.step_of(alloc.job_id, name)
        if step is None or not slurm.signal_steps([step], sig):
            proc.send_signal(signal.SIGKILL if sig == "KILL" else signal.SIGTERM)

    def failures() -> list[str]:
        code = proc.wait()
        return [f"srun exited {code}; task output: {run_dir}/logs/task-*"] if code else []

    ended, _ = follow_to_end(
        run_dir,
        resolved.max_iterations,
        stop=lambda: to_ranks("TERM"),
        kill=lambda: to_ranks("KILL"),
        done=lambda: proc.poll() is not None,
        resume=resume,
        failures=failures,
        num_envs=resolved.num_envs,
    )
    proc.wait()
    return ended

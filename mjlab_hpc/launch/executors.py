"""Our submitit executors: every use of submitit beyond its public API, in one place.

That is its script text and its local controller; tests/test_upstream.py names what a
submitit upgrade removes. `SlurmJobExecutor`'s batch script ends with our heal loop
(`launch/batch_loop.py`).
`LocalJobExecutor` runs its jobs under `HealingController`, which does locally what srun and
the batch script do on Slurm.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils
from submitit.local.local import Controller, LocalJob, LocalJobEnvironment
from submitit.slurm.slurm import SlurmJob

from mjlab_hpc import console
from mjlab_hpc.errors import (
    EXIT_BAD_INPUT,
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_LOCAL_REQUEUE,
    EXIT_OK,
    EXIT_STOPPED,
)
from mjlab_hpc.launch.batch_loop import heal_loop, heal_options
from mjlab_hpc.launch.heal import decide, record_healing, restart_here
from mjlab_hpc.rundir.durable import read_regular
from mjlab_hpc.rundir.layout import LOGS_DIR, SWEEP_ELEMENTS
from mjlab_hpc.rundir.running import RUN_ENV, record_controller

__all__ = [
    "CONTROLLER_MODULE",
    "SUBMITIT_CONTROLLER_MODULE",
    "TASK_MODULE",
    "HealingController",
    "LocalJobExecutor",
    "SlurmJobExecutor",
    "task_outcome",
]

# What `python -m` runs: our local controller, submitit's own, and a task of either.
CONTROLLER_MODULE = "mjlab_hpc.launch.executors"
SUBMITIT_CONTROLLER_MODULE = "submitit.local._local"
TASK_MODULE = "submitit.core._submit"

# The largest submitit result read back: a traceback or a probe's answer is far smaller.
_RESULT_LIMIT = 16 << 20


class _Inert:
    """What an unpickled result holds in place of every class or function its pickle names.

    submitit's `<job>_<task>_result.pkl` lies in the run's folder, which a teammate may be
    able to write (`MJLAB_HPC_GROUP_WRITABLE_RUNS=1`); unpickling it as submitit does imports
    and calls what it names, so their code would run as us. pickle has no data-only mode, so
    every global resolves to this class, which is never imported and does nothing.
    """

    def __new__(cls, *args: object, **kwargs: object) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return _Inert()

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type[_Inert]:
        return _Inert


def task_outcome(task: Any) -> tuple[str, object] | None:
    """A submitit task's result as data: ("success", value) or ("error", its traceback).

    Only pickle's own types are built (str, numbers, tuples, lists, dicts, ...); anything a
    class would make is an inert stand-in. None: no result yet, or not a readable one.
    """
    try:
        data = read_regular(Path(task.paths.result_pickle), _RESULT_LIMIT)
        outcome = _DataOnly(io.BytesIO(data)).load()
    except Exception:  # missing, a link, too big, truncated or not a pickle at all
        return None
    ok = isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] in ("success", "error")
    return outcome if ok else None


# Seconds the other ranks get after one failed, before they are killed: a rank whose peer
# died has nothing to save, and one that waits on a frozen peer never ends by itself.
_KILL_GRACE_S = 5.0
# Starts in one job at most, whatever the ranks say (each rank also counts its requeues).
_MAX_STARTS = 1000
# Exit codes of a rank that ended on purpose (all ranks end alike): no reason to end others.
_ON_PURPOSE = (EXIT_OK, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED, EXIT_LOCAL_REQUEUE)


class SlurmJobExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose batch script ends with our heal loop.

    It also renders its script where there is no srun (a dry run on a laptop), and submits
    the script it is given as planned (`script`) instead of rendering it again.
    """

    def __init__(
        self,
        folder: Path,
        python: str | None,
        max_restarts: int,
        render_only: bool = False,
        heal_python: str | None = None,
        step_nodes: int | None = None,
        min_nodes: int | None = None,
        tasks_per_node: int = 1,
        sweep: bool = False,
        script: str | None = None,
    ) -> None:
        self._render_only = render_only
        self._script = script
        self.sweep = sweep
        """A sweep's job array: `folder`'s parent is the sweep's directory, each element's
        run is linked from its `elements/<index>`."""
        self.max_restarts = max_restarts
        self.step_nodes = step_nodes
        """Nodes each srun step runs on (None: all of the allocation's; fewer: spares)."""
        self.min_nodes = min_nodes
        """--min-nodes: the fewest nodes a step may go on with after a node fails."""
        self.tasks_per_node = tasks_per_node
        """Ranks per node, for a step on fewer nodes."""
        super().__init__(folder, python=python)
        self.heal_python = heal_python or self.python
        """How the heal step runs Python (pyxis: a step in the image)."""

    def affinity(self) -> int:  # type: ignore[override]
        # submitit refuses to build an executor without srun; rendering needs none.
        return 2 if self._render_only else submitit.SlurmExecutor.affinity()

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        if self._script is not None:  # the plan's: what the dry run showed is what runs
            return self._script
        # submitit's script ends with its srun line; the healer runs after it, in the batch
        # shell (which outlives the ranks), with srun's exit code.
        # Each healed fault loops: a new step, without the nodes the healer printed.
        text = str(super()._make_submission_file_text(command, uid))
        head, srun = text.rstrip("\n").rsplit("\nsrun ", 1)
        # The healer's options go after submitit's: srun takes an option's last value (a step
        # on fewer nodes than a spare job's --nodes).
        assert srun.endswith(command), srun
        run_dir = shlex.quote(str(Path(self.folder).parent))
        # A sweep's rank logs are in its element's run directory, linked from the sweep's.
        element = f'/{SWEEP_ELEMENTS}/"$SLURM_ARRAY_TASK_ID"' if self.sweep else ""
        loop = heal_loop(
            srun_options=srun.removesuffix(command).rstrip(),
            command=command,
            hpc=f"{self.heal_python} -m mjlab_hpc.cli.hpc",
            run_dir=run_dir,
            logs=f"{run_dir}{element}/{LOGS_DIR}",
            max_restarts=self.max_restarts,
            heal_options=heal_options(self.step_nodes, self.min_nodes, self.tasks_per_node),
        )
        return f"{head}\n{loop}"

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        # submitit submits a job array through a plain SlurmExecutor of its own, whose script
        # has neither our heal loop nor the image's Python: ours is submitted instead, the
        # script the dry run prints. The rest as submitit does it.
        if len(delayed_submissions) == 1:
            return list(super()._internal_process_submissions(delayed_submissions))
        folder = submitit_utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            delayed.dump(pickles[-1])
        self.parameters["map_count"] = len(pickles)
        try:
            self._throttle()
            first = self._submit_command(self._submitit_command_str)
        finally:
            del self.parameters["map_count"]
        tasks = list(range(first.num_tasks))
        jobs = [
            SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=tasks)
            for i in range(len(pickles))
        ]
        for job, pickled in zip(jobs, pickles, strict=True):
            job.paths.move_temporary_file(pickled, "submitted_pickle")
        return jobs

    def _submit_command(self, command: str) -> Any:
        # submitit prints sbatch's refusal on stderr and raises it too: said once, by us.
        with contextlib.redirect_stderr(io.StringIO()):
            return super()._submit_command(command)

    def script(self) -> str:
        """The exact batch script this executor submits (what a dry run prints)."""
        return str(self._make_submission_file_text(self._submitit_command_str, "dry-run"))


class HealingController(Controller):  # type: ignore[misc]
    """submitit's local controller that ends a failed start at once and heals it.

    It runs as `python -m mjlab_hpc.launch.executors FOLDER MAX_RESTARTS`. The other ranks end
    shortly after one fails, a crash or hang is healed, a requeue starts again; after a stop
    signal to the controller (Ctrl-C of our launcher, `mjlab-hpc cancel`) nothing is healed.
    """

    def __init__(self, folder: Path, max_restarts: int) -> None:
        super().__init__(folder)
        self.run_dir = Path(folder).parent
        self.max_restarts = max_restarts
        self.signalled = False
        signal.signal(signal.SIGTERM, self._stop_signal)

    def _stop_signal(self, signum: int, frame: Any) -> None:
        # A stop by a person or our launcher: forwarded; nothing is healed after it.
        self.signalled = True
        self._forward_signal(signum)

    def _end_others(self) -> None:
        for task in self.tasks:
            if task.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped rank too
                    with contextlib.suppress(OSError):
                        task.send_signal(sig)

    def wait(self, freq: int = 24) -> Sequence[int | None]:
        """Wait for every rank and return their exit codes.

        The time-limit signal goes out as submitit sends it; the other ranks are ended shortly
        after one failed.
        """
        timeout = freq * self.timeout_s
        almost = freq * (self.timeout_s - self.signal_delay_s)
        failed_at: float | None = None
        for step in range(timeout):
            codes = [t.poll() for t in self.tasks]
            if all(c is not None for c in codes):
                return codes
            if failed_at is None and any(c is not None and c not in _ON_PURPOSE for c in codes):
                failed_at = time.monotonic()
            # After a hang the live ranks have written their stacks: the rest is frozen.
            grace = 0.0 if EXIT_HUNG in codes else _KILL_GRACE_S
            if failed_at is not None and time.monotonic() - failed_at > grace:
                self._end_others()
            if step == almost:
                self._time_limit_signal()
            time.sleep(1.0 / freq)
        return [t.poll() for t in self.tasks]

    def _time_limit_signal(self) -> None:
        self._forward_signal(LocalJobEnvironment._usr_sig())

    def run(self, max_retry: int = _MAX_STARTS) -> None:
        """Start the ranks; start them again after a requeue or a healed fault."""
        for _ in range(max_retry):
            began = time.time()
            try:
                self.start_tasks()
                codes = self.wait()
            finally:
                self.kill_tasks()
            if self.signalled:  # a stop by a person: not restarted, whatever the ranks say
                return
            if any(c == EXIT_LOCAL_REQUEUE for c in codes):
                continue
            if all(c == EXIT_OK for c in codes):
                return
            heal = decide(self.run_dir, self.max_restarts, job_id=self.pid, since=began)
            if heal.fault is None:
                return
            if heal.requeue:
                restart_here(heal)
            print(f"mjlab-hpc heal: {heal.describe()}", file=sys.stderr, flush=True)
            try:
                record_healing(self.run_dir, heal)
            except Exception as exc:  # the run matters more than its record: heal anyway
                print(f"mjlab-hpc heal: could not record the fault: {exc}", file=sys.stderr)
            if not heal.requeue or self.signalled:
                return


class LocalJobExecutor(submitit.LocalExecutor):  # type: ignore[misc]
    """submitit's LocalExecutor whose jobs run under `HealingController`."""

    def __init__(self, folder: Path, max_restarts: int, gpus: Sequence[str] = ()) -> None:
        super().__init__(folder=folder)
        self.max_restarts = max_restarts
        # CUDA_VISIBLE_DEVICES entries of the ranks: submitit's visible_gpus takes only
        # indices, not the UUIDs (GPU-..., MIG-...) some sites give.
        self.gpus = tuple(gpus)

    def _submit_command(self, command: str) -> LocalJob[Any]:
        ntasks = self.parameters.get("tasks_per_node", 1)
        env = dict(os.environ)
        # What submitit's start_controller sets, for its Controller and the tasks.
        env.update(
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout") else "",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(self.gpus),
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        env[RUN_ENV] = str(Path(self.folder).parent)  # the run its processes work for
        argv = [sys.executable, "-m", CONTROLLER_MODULE, str(self.folder), str(self.max_restarts)]
        process = subprocess.Popen(argv, env=env)  # outlives this call, as submitit's does
        record_controller(Path(self.folder), process.pid)  # how `mjlab-hpc cancel` knows it
        return LocalJob(
            folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks))
        )


if __name__ == "__main__":
    console.detach()  # it prints on the console of the command that started it
    assert len(sys.argv) == 3, f"usage: python -m {CONTROLLER_MODULE} FOLDER MAX_RESTARTS"
    HealingController(Path(sys.argv[1]), int(sys.argv[2])).run()

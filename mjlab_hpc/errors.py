"""Errors that the CLIs turn into one clear line, and the exit codes of every command."""

from __future__ import annotations

import errno

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_HUNG",
    "EXIT_INTERRUPTED",
    "EXIT_LOCAL_REQUEUE",
    "EXIT_OK",
    "EXIT_REQUEUE",
    "EXIT_RESTART",
    "EXIT_STOPPED",
    "DamagedRecord",
    "Diverged",
    "LaunchError",
    "SpecError",
    "SubmitError",
    "environment_problem",
    "job_exit_code",
]

#: Done.
EXIT_OK = 0
#: The work ran (or was submitted) and failed.
EXIT_FAILED = 1
#: Bad input: nothing was created, submitted or started.
EXIT_BAD_INPUT = 2
#: Training stopped with a checkpoint and nothing requeues it: Ctrl-C, SIGTERM outside
#: Slurm, a lost launcher, or a time limit where no scheduler restarts it (resume with
#: --resume).
EXIT_STOPPED = 3
#: A rank's hang watchdog ended it: no progress for --hang-timeout-s (its stacks are in its
#: log); the launcher ends the others and may requeue the job.
EXIT_HUNG = 4
#: A rank or the healer wants the Slurm job requeued but has no `scontrol` (a container image
#: without Slurm's client): the batch script, outside the image, requeues it (EX_TEMPFAIL).
EXIT_REQUEUE = 75
#: The healer asks the batch script for another srun step in the same allocation (a crash or
#: hang healed without the queue); it prints the nodes that step leaves out.
EXIT_RESTART = 76
#: Stopped at once by a second Ctrl-C, without a checkpoint (128 + SIGINT, as shells do).
EXIT_INTERRUPTED = 130
#: A rank asks submitit's local executor to start it again (submitit.local reads 144).
EXIT_LOCAL_REQUEUE = 144

# What a Slurm job may end with (sacct's ExitCode of the job): srun's code when it is ours.
_JOB_CODES = frozenset({EXIT_OK, EXIT_FAILED, EXIT_STOPPED, EXIT_HUNG, EXIT_REQUEUE})


def job_exit_code(code: int) -> int:
    """Return the exit code a batch script ends with after srun exited `code`.

    srun passes on its tasks' codes: ours, or a signal's number (or 128 + it) when Slurm or
    the kernel killed the ranks. Those are failures like any other: EXIT_FAILED, one code
    for one meaning in sacct.
    """
    return code if code in _JOB_CODES else EXIT_FAILED


class SpecError(ValueError):
    """A flag has a value that cannot work. Names the flag and how to fix it."""

    def __init__(self, flag: str, problem: str) -> None:
        self.flag = flag
        self.problem = problem
        super().__init__(f"{flag}: {problem}")


class LaunchError(RuntimeError):
    """The process was launched in a way we cannot make sense of (inconsistent variables)."""


class DamagedRecord(RuntimeError):
    """A record of a run (run.json, `.latest_run`, ...) exists but is not one.

    It is not JSON, or not the record's shape. The message names the file, what is wrong and
    what to do.
    """

    def __init__(self, path: object, problem: str, fix: str = "") -> None:
        self.path = path
        self.problem = problem
        fix = fix or "move it aside (or delete it) and retry"
        super().__init__(f"{path} is damaged ({problem}): {fix}")


class SubmitError(RuntimeError):
    """The scheduler refused the job (sbatch's own message is included)."""


# What an OSError of the filesystem means for a run, and what to do about it.
_ENVIRONMENT = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.ENAMETOOLONG: "a file name is too long",
}


def environment_problem(exc: BaseException, where: object) -> str | None:
    """Say in one line what a filesystem error means for a run, and the fix.

    The problems are a full disk, a quota, a read-only filesystem, permissions and a name
    too long, at the file the error names, else at `where`. None for any other error.
    """
    if not isinstance(exc, OSError) or exc.errno not in _ENVIRONMENT:
        return None
    what = _ENVIRONMENT[exc.errno]
    # The file the error names when it names one (it may lie outside the run directory).
    place = exc.filename or where
    fix = (
        "free space (or copy the run to a larger filesystem) and resume"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT)
        else "make it writable (or copy the run elsewhere) and resume"
    )
    return f"{what} at {place}: {fix}; the checkpoints written so far are intact"


class Diverged(ArithmeticError):
    """The training diverged: a loss, a parameter or the action noise is no longer finite.

    Raised after the update and before anything of that iteration is saved, on every rank
    alike (their parameters are the same), so the newest checkpoint is the last finite one.
    Nothing heals it: a restart from that checkpoint diverges again.
    """

    def __init__(self, iteration: int, what: str, learning_rate: float) -> None:
        super().__init__(
            f"training diverged at iteration {iteration}: {what}; the newest checkpoint is "
            f"the last finite one. Most often the learning rate is too high (now "
            f"{learning_rate:g}): lower --agent.learning-rate (or the algorithm's) and resume"
        )
        self.iteration = iteration

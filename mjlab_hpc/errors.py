"""Errors that the CLIs turn into a clear message and exit code 2, before anything runs."""

from __future__ import annotations


class SpecError(ValueError):
    """A flag has a value that cannot work. Names the flag and how to fix it."""

    def __init__(self, flag: str, problem: str) -> None:
        self.flag = flag
        self.problem = problem
        super().__init__(f"{flag}: {problem}")


class LaunchError(RuntimeError):
    """The process was launched in a way we cannot make sense of (inconsistent variables)."""


class SubmitError(RuntimeError):
    """The scheduler refused the job (sbatch's own message is included)."""

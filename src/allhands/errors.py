"""Errors a user can cause. Each message is one line naming the cause and the fix.

The CLI prints them without a traceback and exits non-zero; tracebacks are for our bugs.
"""

from pathlib import Path


class AllhandsError(Exception):
    """Base of user-facing errors."""

    exit_code = 1


class ConfigError(AllhandsError, ValueError):
    """Invalid configuration: detected before any worker starts (exit code 2)."""

    exit_code = 2


class DataError(AllhandsError, ValueError):
    """Missing, malformed or too little data that the user passed (exit code 2: invalid input)."""

    exit_code = 2


class CheckpointError(AllhandsError):
    """A checkpoint that cannot be written or read."""


class LaunchError(AllhandsError):
    """The job could not be started or a worker failed."""


class Interrupted(LaunchError):
    """The job stopped on a signal (SIGINT, SIGTERM, SIGUSR1): not a failure. The message is the
    one line that names the step, the checkpoint and how to resume; the exit code says which
    signal (130, 143, or 75 for a requeue)."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line)
        self.exit_code = exit_code


def first_line(e: BaseException) -> str:
    """'ExcType: first line of its message', short enough for a one-line error."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def cannot_write(path: object, e: BaseException) -> str:
    """Why ``path`` could not be written, for a one-line error: the regular file that stands
    where a directory is needed, else the OS's reason at the deepest part that exists."""
    p = Path(str(path))
    where = next((a for a in (p, *p.parents) if a.exists()), p)
    if where.is_file() and where != p:
        return f"cannot write {str(p)!r}: {str(where)!r} is a file, not a directory"
    reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return f"cannot write {str(p)!r}: {reason} at {str(where)!r}"

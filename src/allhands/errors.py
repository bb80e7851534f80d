"""Errors a user can cause. Each message is one line naming the cause and the fix.

The CLI prints them without a traceback and exits non-zero; tracebacks are for our bugs.
"""


class AllhandsError(Exception):
    """Base of user-facing errors."""

    exit_code = 1


class ConfigError(AllhandsError, ValueError):
    """Invalid configuration: detected before any worker starts (exit code 2)."""

    exit_code = 2


class DataError(AllhandsError, ValueError):
    """Missing or malformed token data."""


class CheckpointError(AllhandsError):
    """A checkpoint that cannot be written or read."""


class LaunchError(AllhandsError):
    """The job could not be started or a worker failed."""


def first_line(e: BaseException) -> str:
    """'ExcType: first line of its message', short enough for a one-line error."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]

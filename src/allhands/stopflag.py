"""A worker's side of a clean stop: SIGINT, SIGTERM and SIGUSR1 only set a flag, which the
training loop reads at a step boundary, agrees on with every rank and answers with a
checkpoint of the last completed step (trainer.py); the exit codes that say how it stopped.

The launcher forwards the signal it gets to its workers (launch/stop.py); a worker may also get it
directly (Ctrl-C reaches the whole foreground process group, Slurm signals every process of a
job step). Either way the flag is set at once and acted on at the next step boundary, so no rank
saves a step that another abandoned. A second signal is not deferred: the process goes at once
(SIGINT raises KeyboardInterrupt in-process), and the last committed checkpoint stays intact
because a checkpoint is committed by an atomic rename (checkpoint/checkpointer.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from allhands.env import worker_env

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL of sysexits.h ("a temporary failure: retry later"): the job checkpointed for a
# requeue (Slurm --signal=USR1@T), not the 128+10 of a process killed by an unhandled SIGUSR1.
REQUEUE_EXIT = 75


def exit_code(signum: int) -> int:
    """The exit code of a job stopped by ``signum``: 130 (SIGINT), 143 (SIGTERM) as a shell
    reports a process killed by them, and REQUEUE_EXIT for SIGUSR1."""
    return REQUEUE_EXIT if signum == signal.SIGUSR1 else 128 + signum


def signal_of(code: int) -> int | None:
    """The stop signal a worker's exit code says it stopped cleanly on, or None."""
    return next((s for s in STOP_SIGNALS if exit_code(s) == code), None)


class CleanStop(BaseException):
    """Raised by the training loop once every rank stopped at the same step and the checkpoint
    of that step is committed (or its save failed and the previous one is intact). A
    BaseException, like KeyboardInterrupt: a user's ``except Exception`` must not swallow it."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, run_dir: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.checkpoint, self.run_dir = signum, step, checkpoint, run_dir

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopFlag:
    """This process's stop request: the first stop signal's number, 0 while none came."""

    def __init__(self) -> None:
        self.signum = 0
        self._installed = 0

    def _on_signal(self, signum: int, frame) -> None:
        if not self.signum:
            self.signum = signum
            return
        # The second signal: go now. In-process (the Python API) SIGINT is Python's usual
        # KeyboardInterrupt; otherwise the signal's own default action ends the process.
        if signum == signal.SIGINT and not worker_env().launched:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def installed(self):
        """Handle the stop signals while training; the previous handlers come back afterwards.
        Only the main thread can install handlers: elsewhere signals keep their meaning."""
        if threading.current_thread() is not threading.main_thread() or self._installed:
            yield self
            return
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        self._installed, self.signum = 1, 0
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._installed = 0

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a stop signal (one this process sent to itself or its
        launcher is handled at the interpreter's next check). True once one came."""
        deadline = time.monotonic() + timeout_s
        while not self.signum and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self.signum)


FLAG = StopFlag()
"""The one flag of this process: signal handlers are per process too."""

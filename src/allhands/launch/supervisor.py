"""Supervision: the hang watchdog and the restart loop of a single-node job around torch's
elastic launcher, restarting per the job's restart policy (policy.py).

Single-node jobs run each attempt as one ``elastic_launch`` with ``max_restarts=0`` and restart
here, so that every failure is named in one line as it happens (which rank, which node, why),
restarts wait with exponential backoff, and every attempt gets a fresh rendezvous port and run id:
a restart that reuses the previous attempt's rendezvous has been seen to fail once in gloo's
connectFullMesh with torch 2.13; such a failure before any step completed is retried without counting
against ``fault.max_restarts``. Multi-node jobs pass ``max_restarts`` to torch's agent, which
re-rendezvouses all nodes together (and admits a smaller world between ``--nnodes MIN:MAX``); our
agent subclass there (elastic.py) judges, waits and reports through the same policy.py.

The hang watchdog is our own, not torch's ``FileTimerServer``: on an expired timer that server
SIGKILLs the worker and then its own process, which would be the ``allhands`` launcher itself
(``torch/distributed/elastic/timer/file_based_local_timer.py``, "Terminating the server
process"). Workers instead write a heartbeat file per rank at the top of every step; a thread in
the launcher kills the rank that stopped earliest once its heartbeat is ``hang_timeout_s`` old,
or ``first_step_timeout_s`` during the first step of an attempt, which may compile for minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from allhands.errors import LaunchError
from allhands.heartbeat import HANGS_FILE, Hang, find_hang, progressed, read_heartbeats
from allhands.launch.policy import RestartPolicy, WorkerFailure


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by the agent) is not hung
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Watchdog:
    """Launcher side: a daemon thread that SIGKILLs hung workers; torch's agent then sees a dead
    worker, stops the rest, and the supervisor restarts them. ``hangs`` records every kill."""

    def __init__(self, directory: Path, timeout_s: float, first_step_timeout_s: float | None = None):
        self.dir, self.timeout, self.first_step_timeout = directory, timeout_s, first_step_timeout_s
        self.hangs: list[Hang] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="allhands-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        if self.timeout > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = min(1.0, self.timeout / 5)
        holdoff_until = 0.0
        while not self._stop.wait(interval):
            now = time.time()
            if now < holdoff_until:
                continue
            hung = find_hang(read_heartbeats(self.dir), now, self.timeout, _alive, self.first_step_timeout)
            for h in hung:
                try:
                    os.kill(h.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.hangs.append(h)
                # For torch's agent (elastic.py), which restarts multi-node jobs and names
                # each failure: it runs in this process but does not see this object.
                with open(self.dir / HANGS_FILE, "a") as f:
                    f.write(h.describe(self.timeout) + "\n")
            if hung:
                # Its peers, blocked on it, go stale next; the agent stops them within a second.
                holdoff_until = now + max(10.0, self.timeout)

    def progressed(self) -> bool:
        return progressed(self.dir)


def supervise(attempt: Callable[[int, Path], None], policy: RestartPolicy, *,
              run_dir: Path | None, restart_here: bool = True,
              checkpoints: Path | None = None, resume_dir: Path | None = None) -> None:
    """Run ``attempt(n, heartbeat_dir)`` until it succeeds; on a ``WorkerFailure`` say who failed
    and why, then restart with backoff (``restart_here``), or stop with one line and
    ``LaunchError`` once ``policy.max_restarts`` are used up or the cause is fatal (policy.py).
    ``checkpoints``: where a restart resumes from, when not ``run_dir/checkpoints``;
    ``resume_dir``: what ``--resume`` takes, when not ``run_dir``."""
    job = policy.for_job(run_dir, checkpoints=checkpoints, resume_dir=resume_dir)
    root = Path(tempfile.mkdtemp(prefix="allhands-hb-"))
    n = 0
    try:
        while True:
            hb = root / f"attempt-{n}"
            hb.mkdir()
            with Watchdog(hb, policy.hang_timeout_s, policy.first_step_timeout_s) as dog:
                try:
                    attempt(n, hb)
                    return
                except WorkerFailure as f:
                    if not restart_here:  # torch's agent restarted, logged and gave up (elastic.py)
                        raise LaunchError(f.summary) from None
                    d = job.decide(f.summary, dog.progressed(),
                                   [h.describe(policy.hang_timeout_s) for h in dog.hangs])
            if d.stops:
                raise LaunchError(job.stop(d)) from None
            job.backoff(d)
            n += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)

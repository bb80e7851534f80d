"""Supervision: restart policy with backoff, the hang watchdog, and the failure-report loop
around torch's elastic launcher.

Single-node jobs run each attempt as one ``elastic_launch`` with ``max_restarts=0`` and restart
here, so that every failure is named in one line as it happens (which rank, which node, why),
restarts wait with exponential backoff, and every attempt gets a fresh rendezvous port and run id:
a restart that reuses the previous attempt's rendezvous has been seen to fail once in gloo's
connectFullMesh (FACTS.md); such a failure before any step completed is retried without counting
against ``fault.max_restarts``. Multi-node jobs pass ``max_restarts`` to torch's agent, which
re-rendezvouses all nodes together (and admits a smaller world between ``--nnodes MIN:MAX``); our
agent subclass there (elastic.py) applies the same policy and says the same lines.

The hang watchdog is our own, not torch's ``FileTimerServer``: on an expired timer that server
SIGKILLs the worker and then its own process, which would be the ``allhands`` launcher itself
(``torch/distributed/elastic/timer/file_based_local_timer.py``, "Terminating the server
process"). Workers instead write a heartbeat file per rank at the top of every step; a thread in
the launcher kills the rank that stopped earliest once its heartbeat is ``hang_timeout_s`` old.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from allhands.checkpoint import committed
from allhands.errors import LaunchError
from allhands.heartbeat import HANGS_FILE, Hang, find_hang, progressed, read_heartbeats

# Worker failures whose cause repeats on every restart: restarting would only burn the budget.
FATAL_CAUSES = ("ConfigError:", "CheckpointError:", "DataError:", "NonFiniteError:")
# Start-up failures of a fresh rendezvous that a second try clears (FACTS.md, "Launching").
TRANSIENT_CAUSES = ("connectFullMesh", "Connection refused", "RendezvousTimeoutError")
MAX_FLAKE_RETRIES = 2


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    hang_timeout_s: float = 0.0

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based): doubling, capped."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, restart - 1))

    def decide(self, summary: str, restarts_done: int, flakes: int, progressed: bool) -> str:
        """'fatal', 'flake' (retry, not counted), 'restart' or 'give_up'."""
        if any(c in summary for c in FATAL_CAUSES):
            return "fatal"
        if not progressed and flakes < MAX_FLAKE_RETRIES and any(c in summary for c in TRANSIENT_CAUSES):
            return "flake"
        return "restart" if restarts_done < self.max_restarts else "give_up"


class WorkerFailure(LaunchError):
    """One attempt of the job failed; ``summary`` names the ranks and causes in one line."""

    def __init__(self, summary: str):
        super().__init__(summary)
        self.summary = summary


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

    def __init__(self, directory: Path, timeout_s: float):
        self.dir, self.timeout = directory, timeout_s
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
            hung = find_hang(read_heartbeats(self.dir), now, self.timeout, _alive)
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


# --------------------------------------------------------------------------- the loop


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _restart_point(run_dir: Path | None) -> str:
    if run_dir is None:  # `allhands launch script.py`: the script owns its run directory
        return "the script's last committed checkpoint"
    found = committed(run_dir / "checkpoints")
    return f"checkpoint step {found[-1][0]}" if found else "the start (no committed checkpoint yet)"


def _log_event(run_dir: Path | None, record: dict) -> None:
    """One line per failure in RUN_DIR/logs/restarts.jsonl (read by ``allhands drill``)."""
    if run_dir is None:
        return
    path = run_dir / "logs" / "restarts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def supervise(attempt: Callable[[int, Path], None], policy: RestartPolicy, *,
              run_dir: Path | None, restart_here: bool = True) -> None:
    """Run ``attempt(n, heartbeat_dir)`` until it succeeds; on a ``WorkerFailure`` say who failed
    and why, then restart with backoff (``restart_here``), or stop with one line and
    ``LaunchError`` once ``policy.max_restarts`` are used up or the cause is fatal."""
    restarts = flakes = stalled = 0
    root = Path(tempfile.mkdtemp(prefix="allhands-hb-"))
    n = 0
    try:
        while True:
            hb = root / f"attempt-{n}"
            hb.mkdir()
            with Watchdog(hb, policy.hang_timeout_s) as dog:
                try:
                    attempt(n, hb)
                    return
                except WorkerFailure as f:
                    failed_at = time.time()
                    summary = f.summary
                    if not restart_here:  # torch's agent restarted, logged and gave up (elastic.py)
                        raise LaunchError(summary) from None
                    if dog.hangs:
                        summary = "; ".join([h.describe(policy.hang_timeout_s) for h in dog.hangs]
                                            + [summary])
                    progressed = dog.progressed()
            verdict = policy.decide(summary, restarts, flakes, progressed) if restart_here else "give_up"
            record = {"attempt": n, "failed_at": failed_at, "summary": summary, "verdict": verdict,
                      "hang": bool(dog.hangs)}
            if verdict in ("fatal", "give_up"):
                record["resume_from"] = _restart_point(run_dir)
                _log_event(run_dir, record)
                if verdict == "fatal" or not restart_here or policy.max_restarts == 0:
                    raise LaunchError(summary) from None
                raise LaunchError(f"{summary}; gave up after {restarts} restart(s) "
                                  f"(fault.max_restarts={policy.max_restarts}); the last committed "
                                  f"checkpoint is intact, continue with --resume") from None
            if verdict == "flake":
                flakes += 1
                delay = 1.0
                what = f"start-up flake, retry {flakes}/{MAX_FLAKE_RETRIES} (not counted)"
            else:
                # The backoff doubles while attempts fail before completing a step, and starts
                # over once one made progress: a fault every few hours is not a crash loop.
                restarts += 1
                flakes = 0
                stalled = 0 if progressed else stalled + 1
                delay = policy.delay(max(1, stalled))
                what = f"restart {restarts}/{policy.max_restarts}"
            time.sleep(delay)
            # Read after the backoff: a worker that raised gives its save in flight time to
            # commit (Checkpointer.drain), which may land just after the failure is reported.
            record["delay_s"], record["resume_from"] = delay, _restart_point(run_dir)
            _log_event(run_dir, record)
            _say(f"allhands: {summary}; {what} from {record['resume_from']} after {delay:.1f} s")
            n += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)

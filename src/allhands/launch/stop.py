"""The launcher's side of a clean stop on SIGINT, SIGTERM and SIGUSR1: the first signal is
forwarded to this node's workers, which finish the step, agree on it and commit its checkpoint
(stopflag.py, trainer.py); a second one kills them at once; either way the job ends with one
line naming the step, the checkpoint and the command that resumes it.

torch's agent would raise ``SignalException`` in its monitor loop and SIGTERM the workers
(``torch/distributed/elastic/agent/server/api.py``, ``SimpleElasticAgent.run``), which kills
them mid-step and prints the agent's traceback; so the launcher keeps these signals for itself
(launcher.py leaves torch only SIGHUP and SIGQUIT) and the agent's own stops use SIGKILL
(elastic.LocalAgent._shutdown), as SIGTERM's default action did before workers handled it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
from pathlib import Path
from typing import Any, Iterable

from allhands.checkpoint import committed
from allhands.stopflag import STOP_SIGNALS, exit_code, signal_of


class Stopped(BaseException):
    """The job stopped on a stop signal: ``clean`` when every worker finished its step and
    exited with the stop's code, not after a second signal or a worker that failed meanwhile."""

    def __init__(self, signum: int, clean: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.clean = signum, clean


class StopRequest:
    """This launcher's stop request, and the workers it forwards it to (``workers``: a callable
    returning their pids, set while an agent runs them)."""

    def __init__(self) -> None:
        self.signum = 0
        self.workers: Any = None

    def _pids(self) -> list[int]:
        try:
            return list(self.workers()) if self.workers is not None else []
        except Exception:  # the agent is between its worker groups: no workers now
            return []

    def on_signal(self, signum: int, frame: Any = None) -> None:
        pids = self._pids()
        if self.signum or not pids:
            # A second signal, or nothing running to finish a step (start-up, a restart's
            # backoff): stop now. The agent's shutdown (SIGKILL) ends the workers.
            first = self.signum or signum
            self.signum = first
            _signal_all(pids, signal.SIGKILL)
            raise Stopped(first, clean=False)
        self.signum = signum
        _signal_all(pids, signum)

    def outcome(self, failures: dict[int, Any]) -> Stopped | None:
        """What a finished or failed worker group means for the stop: Stopped when this launcher
        got a stop signal or every failed worker exited with a clean stop's code (a signal sent
        to the workers only), None otherwise (a failure for the restart policy)."""
        codes = [getattr(f, "exitcode", None) for f in failures.values()]
        signals = {signal_of(c) for c in codes if c is not None}
        worker_signal = signals.pop() if codes and len(signals) == 1 and None not in signals else None
        if worker_signal is not None:
            return Stopped(self.signum or worker_signal, clean=True)
        if self.signum:
            return Stopped(self.signum, clean=not failures)
        return None


CURRENT = StopRequest()
"""The request of this process: signal handlers are per process."""


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def handling():
    """Install the launcher's stop handlers for the duration of a job (main thread only; the
    previous handlers come back afterwards)."""
    global CURRENT
    CURRENT = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield CURRENT
        return
    previous = {s: signal.signal(s, CURRENT.on_signal) for s in STOP_SIGNALS}
    try:
        yield CURRENT
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def resume_command(spec: Any, run_dir: Path) -> str:
    """``allhands train`` with this node's launch flags and ``--resume RUN_DIR``: the run's
    resolved config already holds its CONFIG and every ``--set``."""
    args = ["allhands", "train"]
    if spec.nproc:
        args += ["--nproc", str(spec.nproc)]
    if spec.multi_node:
        nodes = f"{spec.min_nodes}:{spec.nnodes}" if spec.min_nodes else str(spec.nnodes)
        args += ["--nnodes", nodes, "--node-rank", str(spec.node_rank), "--rdzv-endpoint", spec.rdzv_endpoint]
    if spec.rdzv_store != "node0":
        args += ["--rdzv-store", spec.rdzv_store]
    for flag, value in (("--local-addr", spec.local_addr), ("--port", spec.port or ""),
                        ("--bind", spec.bind), ("--secret-file", spec.secret_file)):
        if value:
            args += [flag, str(value)]
    if spec.max_restarts >= 0:
        args += ["--max-restarts", str(spec.max_restarts)]
    if spec.insecure:
        args.append("--insecure")
    return shlex.join([*args, "--resume", str(run_dir)])


def final_line(s: Stopped, run_dir: Path | None, command: str | None) -> str:
    """The one line a stopped job ends with."""
    name = signal.Signals(s.signum).name
    found = committed(run_dir / "checkpoints") if run_dir is not None else []
    step, path = found[-1] if found else (0, None)
    again = f"resume with: {command}" if command else "run the same command to resume"
    if run_dir is None:
        ckpt = "the script's last committed checkpoint is intact"
    elif path is None:
        ckpt = "no checkpoint was committed yet"
    elif s.clean:
        ckpt = f"checkpoint {path} is committed"
    else:
        ckpt = f"the last committed checkpoint {path} (step {step}) is intact"
    if not s.clean:
        return f"allhands: stopped at once on {name}; {ckpt}; {again}"
    if s.signum == signal.SIGUSR1:
        return f"allhands: checkpointed at step {step} for requeue ({name}); {ckpt}; {again}"
    return f"allhands: stopped by {name} at step {step}; {ckpt}; {again}"


__all__ = ["CURRENT", "StopRequest", "Stopped", "exit_code", "final_line", "handling", "resume_command"]

"""Inside a worker process: the mode the job runs in, through one registry, and the worker's
failures recorded for the launcher's one-line summary.

Every mode takes the same common path (lockstep.py: mesh -> Trainer -> fit); a mode that needs
more owns its start-up in its own package (``allhands.ps``, ``allhands.replica``) and is found
here by name, so adding a mode adds one entry below and touches neither this path nor the loop."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import sys
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from allhands import lockstep
from allhands.config import Config
from allhands.env import WorkerEnv, replica_env, worker_env
from allhands.errors import AllhandsError
from allhands.metrics import slow_phase
from allhands.ps import start as ps_start
from allhands.replica import start as replica_start
from allhands.stopflag import FLAG, CleanStop
from allhands.trainer import Job

ModeRun = Callable[[Config, Job, WorkerEnv], "dict[str, Any]"]

#: Each mode's worker: ``(cfg, job, env) -> the last metrics``.
MODES: dict[str, ModeRun] = {"lockstep": lockstep.run, "ps": ps_start.run, "replica": replica_start.run}


def mode_of(cfg: Config) -> str:
    """The mode this worker runs: the parameter server, a replica group, or plain lock-step."""
    if cfg.parallel.sync == "ps":
        return "ps"  # with fault.mode = "replica" too: the ps worlds link through their own store
    return "replica" if replica_env() is not None else "lockstep"


def run_training(cfg: Config, job: Any = None) -> dict[str, Any]:
    """Train in this process as one worker of the job the environment describes."""
    env = worker_env()
    if env.started_at:  # the agent's rendezvous, starting this process (a fork of a preloaded server)
        lockstep.say(env.rank, slow_phase(f"starting {env.world_size} workers", time.time() - env.started_at))
    return MODES[mode_of(cfg)](cfg, job or Job(), env)


def worker_main(cfg_dict: dict, job: Any) -> None:
    """Entry point of each worker (module level so that multiprocessing can pickle it)."""
    try:
        with reported_failures():
            run_training(Config.from_dict(cfg_dict), job)
    finally:
        # However the worker leaves (done, a clean stop, a failure), everything is closed by now:
        # skip the interpreter's final collection of torch's whole heap, which took 4-9 s of
        # every exit under load here (a stop before a time limit cannot spare it).
        gc.freeze()


@contextlib.contextmanager
def reported_failures():
    """In a launched worker: write torch's error file for any exception, so the launcher's
    summary names the cause; user-caused errors then exit without a traceback. A stop signal
    ends training cleanly at a step boundary (stopflag.py), with the exit code that says so."""
    _worker_setup()
    try:
        with FLAG.installed():
            yield
    except CleanStop as e:
        if worker_env().launched:  # the launcher says the one line for the whole job
            sys.exit(e.exit_code)
        _say_stopped(e)
        raise KeyboardInterrupt if e.signum == signal.SIGINT else SystemExit(e.exit_code)
    except AllhandsError as e:
        if worker_env().launched:
            _record_error(e)
            sys.exit(e.exit_code)
        raise
    except Exception as e:
        if worker_env().launched:
            _record_error(e)
        raise


def _say_stopped(e: CleanStop) -> None:
    """In-process (the Python API without a launcher): the one line of a clean stop."""
    where = (f"checkpoint {e.checkpoint} is committed" if e.checkpoint
             else "no checkpoint was committed yet")
    print(f"allhands: {e}; {where}; continue with allhands.train(..., resume={str(e.run_dir)!r})",
          file=sys.stderr, flush=True)


def _worker_setup() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)


def _record_error(e: BaseException) -> None:
    ErrorHandler().record_exception(e)

"""Workers forked from one preloaded forkserver per launcher: torch and allhands are imported once
per launcher, not once per worker and again on every restart.

torch's agent starts workers with a multiprocessing start method; with ``forkserver`` (Python's
``multiprocessing.forkserver``), every worker is a fork of one server process that imported the
modules in :data:`PRELOAD` when it started. What a spawned worker got for free, a forked one is
given here:

- **The launcher's environment as it is at the start**, not as it was when the server started:
  torch's agent passes each worker only its own variables (RANK, MASTER_PORT, ...), so
  :func:`complete_envs` adds the launcher's whole current environment (the job secret, TMPDIR,
  GLOO_SOCKET_IFNAME, the attempt) and names what the launcher has unset since, which
  :func:`forked` removes in the worker; ``tempfile.tempdir`` is recomputed from it there.
- **Dying with the launcher.** A worker's parent is the server, which exits when its launcher does
  (its "alive" pipe reaches EOF); torch's workers then get SIGINT (``PR_SET_PDEATHSIG``, as they
  did from a spawning launcher). A forked worker inherits the write end of that pipe and would
  keep the server, hence itself, alive: :func:`forked` closes it.
- **Its stdout and stderr** as they are at the start, not the server's: :class:`Stdio`.
- **Signals.** A stop signal for the whole process group (Ctrl-C, Slurm's SIGTERM to every process
  of a step) reaches the server too; its end would report every worker as exited with code 255
  while they stop cleanly. The server starts with them blocked (a signal mask survives fork and
  exec) and each worker unblocks them first thing, so one pending for it is delivered then.

What the preload leaves in the server: no open file but its own socket and pipes, and one idle
native thread that ``import torch`` starts; a fork keeps only the forking thread, as it does for
every DataLoader worker forked from a process that imported torch (torch resets its thread pools
in the child with ``pthread_atfork``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
from multiprocessing import forkserver, reduction, resource_tracker
from typing import Any, Callable

import torch

# What the server imports once: the workers' entry point (launcher.worker_entry) and the worker
# (the trainer, torch, DCP).
PRELOAD = ["allhands.launch.launcher", "allhands.worker"]
# torch's agent forwards SIGHUP and SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE), the launcher SIGINT,
# SIGTERM and SIGUSR1 (stop.py); the server ignores SIGINT itself.
SHIELDED = {signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT}
UNSET_ENV = "ALLHANDS_FORKSERVER_UNSET"

_lock = threading.Lock()
_server: dict[str, Any] = {"pid": None, "environ": {}}  # ours, and the environment it started with


def ensure_server() -> str:
    """Start this process's forkserver (once) with :data:`PRELOAD`; the start method for torch's
    agent: ``forkserver``, or ``spawn`` where there is none (macOS, Windows) or another part of
    this process started one without our preload and environment record."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    fs = forkserver._forkserver
    with _lock:
        if fs._forkserver_pid is None or fs._forkserver_pid == _server["pid"]:
            forkserver.set_forkserver_preload(PRELOAD)
            environ = dict(os.environ)
            # First, unshielded: starting the tracker unblocks SIGINT and SIGTERM on its way out.
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
            try:
                forkserver.ensure_running()  # a no-op while ours runs; a new one if it died
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if fs._forkserver_pid != _server["pid"]:
                _server.update(pid=fs._forkserver_pid, environ=environ)
        return "forkserver" if fs._forkserver_pid == _server["pid"] else "spawn"


def complete_envs(envs: dict[int, dict[str, str]]) -> None:
    """Make each worker's environment dict (torch's, for its ``_wrap``) the launcher's current
    environment under torch's own variables, plus the list of what :func:`forked` must unset."""
    now = dict(os.environ)
    for env in envs.values():
        own = dict(env)
        env.clear()
        env.update(now)
        env.update(own)
        env[UNSET_ENV] = "\n".join(k for k in _server["environ"] if k not in env)


class Stdio:
    """The launcher's stdout and stderr as they are when a worker starts (a process running jobs
    one after another may have redirected them since the server started: pytest's capture, a
    notebook), sent along with the worker as multiprocessing's ``DupFd`` and made the worker's
    fds 1 and 2 as it is unpickled, before torch's ``_wrap`` redirects them to log files, if so."""

    def __reduce__(self):
        fds = [fd for fd in (1, 2) if _is_open(fd)]
        return _install_stdio, (fds, [reduction.DupFd(fd) for fd in fds])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _install_stdio(fds: list[int], dups: list[Any]) -> None:
    for fd, dup in zip(fds, dups):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


def forked(_stdio: Any, entrypoint: Callable, *args: Any) -> Any:
    """The workers' entry point under the forkserver: the environment, temporary directory, the
    server's lifetime and signal mask as described above, then ``entrypoint(*args)``. ``_stdio``
    (a :class:`Stdio` in the launcher) did its work as it was unpickled."""
    for key in os.environ.pop(UNSET_ENV, "").split("\n"):
        if key:
            os.environ.pop(key, None)
    tempfile.tempdir = None  # computed again from TMPDIR if the server's preload computed it
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it once, when the server imported it
        torch.set_num_threads(int(threads))
    fs = forkserver._forkserver
    if fs._forkserver_alive_fd is not None:
        os.close(fs._forkserver_alive_fd)
        fs._forkserver_alive_fd = None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    return entrypoint(*args)

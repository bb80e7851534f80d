"""Workers forked from one preloaded forkserver per launcher: torch and allhands are imported once
per launcher, not once per worker and again on every restart.

torch's agent starts workers with a multiprocessing start method; with ``forkserver`` (Python's
``multiprocessing.forkserver``), every worker is a fork of one server process that imported the
modules in :data:`PRELOAD` when it started. What a spawned worker got from its launcher at the
start, a forked one would take from the server as it was when *it* started; so it is given:

- **The launcher's environment, umask, stdout, stderr and ignored signals as they are at the
  start**: the job
  secret, TMPDIR, GLOO_SOCKET_IFNAME and the attempt are set after the server started, variables
  may have been unset since, the job runs under a private umask (safefs.py), and a process running
  jobs one after another may have redirected its output (pytest's capture, a notebook). An
  :class:`Inherited` in the worker's arguments captures them as torch pickles the worker for the
  server and applies them as the worker unpickles it, before torch's ``_wrap`` sets the worker's
  own variables (RANK, MASTER_PORT, ...) and redirects its output to log files, if so. The working
  directory and ``sys.path`` travel with multiprocessing's own preparation data;
  ``tempfile.tempdir`` and torch's thread count, read once by the server, are recomputed.
- **Dying with the launcher.** A worker's parent is the server, which exits when its launcher does
  (its "alive" pipe reaches EOF); torch's workers then get SIGINT (``PR_SET_PDEATHSIG``, as they
  did from a spawning launcher). A forked worker inherits the write end of that pipe and would
  keep the server, hence itself, alive: :func:`forked` closes it.
- **Signals.** A stop signal for the whole process group (Ctrl-C, Slurm's SIGTERM to every process
  of a step) reaches the server too; its end would report every worker as exited with code 255
  while they stop cleanly. The server starts with them blocked (a signal mask survives fork and
  exec) and each worker unblocks them first thing, so one pending for it is delivered then.

- **Its end.** The server holds the launcher's stdout and stderr, so whoever reads the launcher's
  output to its end (a pipe, ``| tee``, a test) waits for the server's exit too; that exit skips
  the interpreter's last collection of torch's whole heap, as the CLI's own exit does
  (:func:`_at_server_exit`). multiprocessing puts the server's socket in the launcher's ``pymp-*``
  directory, which a launcher killed by a signal leaves behind (mode 0700); the server, which
  outlives it, removes its socket and then the directory if that emptied it (a process spawned
  by the launcher inherits the same directory and may still hold files there).

What the preload leaves in the server: no open file but its own socket and pipes, and one idle
native thread that ``import torch`` starts; a fork keeps only the forking thread, as it does for
every DataLoader worker forked from a process that imported torch (torch resets its thread pools
in the child with ``pthread_atfork``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import signal
import tempfile
import threading
from multiprocessing import forkserver, reduction, resource_tracker
from typing import Any, Callable

import torch

# What the server imports once: the workers' entry point (launcher.worker_entry) and the worker
# (the trainer, torch, DCP), and torch._dynamo, which DDP's constructor, FSDP and torch.compile
# import on first use (about 1 s of CPU per worker here, every worker at once at start-up).
PRELOAD = ["allhands.launch.launcher", "allhands.worker", "torch._dynamo"]
# torch's agent forwards SIGHUP and SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE), the launcher SIGINT,
# SIGTERM and SIGUSR1 (stop.py); the server ignores SIGINT itself.
SHIELDED = {signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT}

# Set while ensure_server starts the server, which imports this module in its preload: the mark
# that this process is the server (its workers never see it: Inherited).
SERVER_ENV = "ALLHANDS_FORKSERVER"

_lock = threading.Lock()
_server_pid: list[int | None] = [None]  # the forkserver this module started


def ensure_server() -> str:
    """Start this process's forkserver (once) with :data:`PRELOAD`; the start method for torch's
    agent: ``forkserver``, or ``spawn`` where there is none (Windows) or another part of this
    process started one without our preload and signal mask."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    fs = forkserver._forkserver
    with _lock:
        if fs._forkserver_pid is None or fs._forkserver_pid == _server_pid[0]:
            forkserver.set_forkserver_preload(PRELOAD)
            # First, unshielded: starting the tracker unblocks SIGINT and SIGTERM on its way out.
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
            os.environ[SERVER_ENV] = "1"  # inherited by the server only
            try:
                forkserver.ensure_running()  # a no-op while ours runs; a new one if it died
            finally:
                os.environ.pop(SERVER_ENV, None)
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _server_pid[0] = fs._forkserver_pid
        return "forkserver" if fs._forkserver_pid == _server_pid[0] else "spawn"


def _at_server_exit(server: int, parent: int) -> None:
    """The server's end (see above): no collection of the heap at the interpreter's exit; and
    when its launcher died without a word (SIGKILL: the server was handed to another parent),
    its socket and, if nothing else is left in it, the launcher's ``pymp-*`` directory."""
    if os.getpid() != server:  # a forked worker ends by os._exit; this is for the server only
        return
    address = forkserver._forkserver._forkserver_address
    if os.getppid() != parent and isinstance(address, str) and \
            os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        with contextlib.suppress(OSError):  # its own socket; the directory only if that was all
            os.unlink(address)
            os.rmdir(os.path.dirname(address))
    gc.freeze()


if SERVER_ENV in os.environ:  # imported by the preload of a server ensure_server started
    os.environ.pop(SERVER_ENV)
    atexit.register(_at_server_exit, os.getpid(), os.getppid())


class Inherited:
    """The launcher's environment, umask, stdout and stderr at the start of a worker (see above):
    captured as torch pickles the worker, applied as the worker unpickles it."""

    def __reduce__(self):
        fds = [fd for fd in (1, 2) if _is_open(fd)]
        # exec keeps an ignored signal ignored and resets a handled one: what a spawned worker got
        ignored = [int(s) for s in (signal.SIGINT, *SHIELDED) if signal.getsignal(s) == signal.SIG_IGN]
        return _inherit, (dict(os.environ), _umask(), fds, [reduction.DupFd(fd) for fd in fds], ignored)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for a moment, for every
    thread of the launcher) where Linux shows it."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration):
        mask = os.umask(0o077)
        os.umask(mask)
        return mask


def _inherit(environ: dict[str, str], umask: int, fds: list[int], dups: list[Any], ignored: list[int]) -> None:
    for sig in (signal.SIGINT, *SHIELDED):  # not the server's: it may have started with SIGINT ignored
        signal.signal(sig, signal.SIG_IGN if sig in ignored else
                      signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environ)
    os.umask(umask)
    for fd, dup in zip(fds, dups):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


def forked(_inherited: Any, entrypoint: Callable, *args: Any) -> Any:
    """The workers' entry point under the forkserver: the temporary directory, thread count,
    server's lifetime and signal mask as described above, then ``entrypoint(*args)``.
    ``_inherited`` (an :class:`Inherited` in the launcher) did its work as it was unpickled."""
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

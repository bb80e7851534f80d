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

**Forked, not spawned, in allhands' own processes.** multiprocessing spawns the server: a new
interpreter that imports torch and the trainer again (about 3.5 s of CPU, most of a short job's
start-up, and once more in every replica group's launcher). A process that is allhands' own (the
``allhands`` command, a launcher this module started: launch/owner.py) forks the server from
itself instead, with what it already imported; the server then closes every descriptor but its
socket, its pipe and the standard three, and freezes the heap it was handed (``gc.freeze``: no
finalizer of the launcher's objects runs in it), so it holds what a spawned one holds. Anywhere
else (a notebook, a test runner, a user's script calling the API) the process's state is not
ours to copy (its logging, warnings, ``sys.stdout``, open sockets): the server is spawned. So it
is where CUDA was initialised: a forked child cannot use it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
from multiprocessing import connection, forkserver, reduction, resource_tracker, util
from typing import Any, Callable

import torch

from allhands.launch import owner
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
                if owner.is_own() and not torch.cuda.is_initialized() and not _running(fs):
                    _fork_server(fs)
                else:
                    forkserver.ensure_running()  # a no-op while ours runs; a new one if it died
            finally:
                os.environ.pop(SERVER_ENV, None)
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _server_pid[0] = fs._forkserver_pid
        return "forkserver" if fs._forkserver_pid == _server_pid[0] else "spawn"


def _running(fs: forkserver.ForkServer) -> bool:
    """``fs``'s server is running (what ``ForkServer.ensure_running`` checks first); a dead one's
    pipe is closed and its record cleared, as there."""
    if fs._forkserver_pid is None:
        return False
    if not os.waitpid(fs._forkserver_pid, os.WNOHANG)[0]:
        return True
    os.close(fs._forkserver_alive_fd)
    fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None
    return False


def _fork_server(fs: forkserver.ForkServer) -> None:
    """``ForkServer.ensure_running``'s work with the server forked from this process (see the
    module's docstring): the same socket, "alive" pipe and ``forkserver.main`` loop; the caller
    holds the signal mask the server starts with."""
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:
            _serve_forked(listener.fileno(), alive_r, parent)
        os.close(alive_r)
    fs._forkserver_address, fs._forkserver_alive_fd, fs._forkserver_pid = address, alive_w, pid


def _serve_forked(listener: int, alive_r: int, parent: int) -> None:
    """The forked server's life: only its own descriptors kept, the heap frozen, multiprocessing's
    server loop until the launcher is gone, then :func:`_at_server_exit` and ``os._exit``, never
    the launcher's exit handlers."""
    global _lock
    _lock = threading.Lock()  # the launcher held its copy when it forked: what this forks needs it free
    os.environ.pop(SERVER_ENV, None)
    code = 0
    try:
        keep = sorted({0, 1, 2, listener, alive_r})
        for lo, hi in zip([-1, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
            if hi > lo + 1:  # an empty range is not harmless: Linux's close_range would get (lo, lo - 1)
                os.closerange(lo + 1, hi)
        gc.freeze()
        forkserver.main(listener, alive_r, PRELOAD)
    except SystemExit:  # the loop's end: the launcher closed its end of the pipe
        pass
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            _at_server_exit(os.getpid(), parent)
        os._exit(code)


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
    owner.mark_own()  # what it forks runs our code alone


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


def process(target: Callable, args: tuple, name: str) -> multiprocessing.Process:
    """An unstarted process that runs ``target(*args)``: forked from this process's server with
    :func:`forked` and the launcher's state of the moment it starts (:class:`Inherited`), or
    spawned where there is no server (:func:`ensure_server`). For a launcher of launchers (each
    replica group's or parameter-server world's): a spawned one imports torch and the launcher
    before it starts anything, the start-up that dominated a short job on a loaded host."""
    method = ensure_server()
    if method == "forkserver":
        target, args = forked, (Inherited(), target, *args)
    return multiprocessing.get_context(method).Process(target=target, name=name, args=args)


"""``python -m allhands.cli ...`` and ``python script.py ...`` processes started by forking a
server that imported torch and allhands once, instead of a new interpreter importing them again
(about 2.5 s of CPU a job: torch in the command, the trainer's modules in its workers' server).

Each pytest process that starts such a command gets one server (started at its first). Every
command is still a process of its own, started as the test asked: its arguments, environment,
working directory, standard streams (the test's pipes or files, passed over a Unix socket),
umask, new session or not, ignored signals; it runs the command's module as ``python -m`` does (or
a script, ``python [-u] PATH.py``, as the interpreter runs one) and exits as the interpreter
would (threads joined, ``atexit`` handlers, streams flushed, the same exit codes, killed by
SIGINT after an uncaught KeyboardInterrupt). Its pid is real: the test signals it, reads its
/proc entry and its children as before. What differs is its parent: the server, which reaps it
and sends its wait status to the test's ``Popen``.

Only what a forked interpreter cannot reproduce falls back to a real ``Popen``: a different
interpreter, a shell, ``preexec_fn`` and other pre-exec options, a variable read when an
interpreter or a library starts (``PYTHON*``, ``LD_*``, ``OMP_*``, ``MALLOC_*``, ``TORCH*``, ...)
that differs from the server's, a ``PYTHONPATH`` entry or working directory holding a
``sitecustomize`` module, a variable others read from the process's /proc/PID/environ (which
shows the environment a process was exec'd with: a fork's is the server's). Installed by
conftest.py (``install``); ``ALLHANDS_TEST_ZYGOTE=0`` turns it off (every command a new
interpreter, as before).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from allhands.launch.forkstart import PRELOAD as SERVER_PRELOAD
from allhands.launch.forkstart import _umask  # read without setting it, where Linux shows it

_RealPopen = subprocess.Popen
COMMAND = [sys.executable, "-m", "allhands.cli"]


def what_runs(args) -> tuple[str, str, bool, list[str]] | None:
    """("module", "allhands.cli", unbuffered, its arguments) for ``python [-u] -m allhands.cli
    ...``, ("script", path, unbuffered, its arguments) for ``python [-u] PATH.py ...``; None for
    anything else."""
    if not isinstance(args, (list, tuple)) or not args or os.fspath(args[0]) != sys.executable:
        return None
    rest = [os.fspath(a) for a in args[1:]]
    unbuffered = bool(rest) and rest[0] == "-u"
    rest = rest[unbuffered:]
    if rest[:2] == COMMAND[1:]:
        return "module", rest[1], unbuffered, rest[2:]
    if rest and rest[0].endswith(".py") and not rest[0].startswith("-"):
        return "script", rest[0], unbuffered, rest[1:]
    return None


# Modules the server imports: torch, the command and what its workers' server preloads.
PRELOAD = ["torch", "torch.distributed", "allhands.cli", "allhands.cli.jobs", "allhands.cli.data",
           "allhands.cli.inspect", "allhands.launch.forkstart"]
# Variables an interpreter or a library reads once, as it starts: a command whose environment
# has other values than the server's starts a new interpreter instead.
AT_START = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "GLIBC_TUNABLES", "TORCH",
            "CUDA_", "JEMALLOC", "LC_", "LANG")
# ... except these: set in the command by the server (OMP_NUM_THREADS: torch's thread count), or
# read only when used (torch's elastic agent, inductor's cache, NCCL): the launcher of a job run
# in the test's process sets them there.
HANDLED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS",
           "TORCHINDUCTOR_CACHE_DIR"}
DYNAMIC = ("TORCHELASTIC_", "TORCH_NCCL_")
# Read by others from /proc/PID/environ, which shows what a process was exec'd with: a fork shows
# the server's (the chaos checker finds a job's processes by this tag).
EXEC_VISIBLE = {"ALLHANDS_CHAOS_TAG"}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
           signal.SIGQUIT, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ)
_HEAD = struct.Struct("q")
base_threads = 1


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return data
        data += part
    return data


# ---- the test's side ----------------------------------------------------------------------------

class _Server:
    """This process's server: started at the first command, stopped when the process exits."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)  # the environment it starts with: the session's
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.owner = 0  # the process that started it: only that one stops it (not a fork of it)
        self.path = ""
        self.failed = ""

    def _start(self) -> None:
        tmp = tempfile.mkdtemp(prefix="allhands-zygote-")
        self.path = os.path.join(tmp, "s")
        log = open(os.path.join(tmp, "log"), "wb")
        code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='zygote')['serve'](sys.argv[2])")
        self.proc = _RealPopen([sys.executable, "-c", code, __file__, self.path], stdin=subprocess.DEVNULL,
                               stdout=log, stderr=log, env=self.environ, cwd=tmp)
        log.close()
        self.owner = os.getpid()
        atexit.register(self._stop, tmp)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.failed = Path(tmp, "log").read_text(errors="replace")[-2000:] or "no output"
                return
            time.sleep(0.02)

    def _stop(self, tmp: str) -> None:
        if os.getpid() != self.owner:  # a fork of the test's process exiting: not its server
            return
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for name in ("s", "log"):
            try:
                os.unlink(os.path.join(tmp, name))
            except OSError:
                pass
        try:
            os.rmdir(tmp)
        except OSError:
            pass

    def connect(self) -> socket.socket | None:
        with self.lock:
            if self.proc is None:
                self._start()
            if self.failed or self.proc.poll() is not None:
                if not self.failed:
                    self.failed = f"the server exited with {self.proc.returncode}"
                return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        return conn

    def routable(self, args, kwargs: dict) -> bool:
        """Whether ``Popen(args, **kwargs)`` can be a fork of this server."""
        if os.environ.get("ALLHANDS_TEST_ZYGOTE", "1") == "0" or self.failed:
            return False
        if what_runs(args) is None:
            return False
        plain = dict(shell=False, executable=None, preexec_fn=None, pass_fds=(), user=None,
                     group=None, extra_groups=None, umask=-1, process_group=None, close_fds=True,
                     restore_signals=True)
        if any(k in kwargs and kwargs[k] != v and not (k == "pass_fds" and not kwargs[k])
               for k, v in plain.items()):
            return False
        env = kwargs.get("env")
        env = os.environ if env is None else env
        if EXEC_VISIBLE & set(env):
            return False
        if "OMP_NUM_THREADS" in self.environ and env.get("OMP_NUM_THREADS") != self.environ["OMP_NUM_THREADS"]:
            return False  # the server's torch counted its threads from it
        if any(k.startswith(AT_START) and not k.startswith(DYNAMIC) and k not in HANDLED
               and env.get(k) != self.environ.get(k)
               for k in set(env) | set(self.environ)):
            return False
        cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
        dirs = [cwd] + [p or cwd for p in env.get("PYTHONPATH", "").split(os.pathsep)]
        return os.path.isdir(cwd) and not any(
            os.path.exists(os.path.join(d, m)) for d in dirs for m in ("sitecustomize.py", "usercustomize.py"))


SERVER = _Server()


class Popen(_RealPopen):
    """``subprocess.Popen``, whose ``python -m allhands.cli`` and ``python SCRIPT.py`` children are
    forks of the server (where :meth:`_Server.routable` says a fork is the same process)."""

    def __init__(self, args, *more, **kwargs):
        self._zconn = None
        self._zygote = not more and SERVER.routable(args, kwargs)
        super().__init__(args, *more, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, *rest):
        conn = SERVER.connect() if self._zygote else None
        if conn is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite,
                                          c2pread, c2pwrite, errread, errwrite, *rest)
        start_new_session = rest[5]
        request = dict(
            run=what_runs(args), cwd=os.path.abspath(os.fspath(cwd or os.getcwd())),
            env={os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
            new_session=bool(start_new_session), umask=_umask(),
            ignored=[int(s) for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN])
        payload = pickle.dumps(request)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        try:
            socket.send_fds(conn, [_HEAD.pack(len(payload))], fds)
            conn.sendall(payload)
            reply = _recv_exact(conn, _HEAD.size)
            if len(reply) != _HEAD.size:
                raise OSError("the test zygote closed the connection")
            pid = _HEAD.unpack(reply)[0]
            if pid < 0:  # the child could not enter its working directory, as Popen raises it
                errno, _, text = conn.recv(4096).decode().partition(":")
                raise OSError(int(errno), text, request["cwd"])
        except OSError:
            conn.close()
            raise
        self.pid = pid
        self._child_created = True
        self._zconn = conn
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags):
        conn = self._zconn
        if conn is None:
            return super()._try_wait(wait_flags)
        if wait_flags & os.WNOHANG and not select.select([conn], [], [], 0)[0]:
            return (0, 0)
        data = _recv_exact(conn, _HEAD.size)
        conn.close()
        self._zconn = None
        # the server gone before the child: its status is lost (255, as a failed exec)
        return (self.pid, _HEAD.unpack(data)[0] if len(data) == _HEAD.size else 255 << 8)

    def _internal_poll(self, _deadstate=None, *args, **kwargs):
        if getattr(self, "_zconn", None) is None:
            return super()._internal_poll(_deadstate, *args, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install() -> None:
    """Route this process's ``subprocess.Popen`` (and so ``subprocess.run``) through :class:`Popen`."""
    subprocess.Popen = Popen


# ---- the server's side ------------------------------------------------------------------------

def serve(path: str) -> None:
    """Import PRELOAD, then fork a command for each request on the socket at ``path``, until the
    process that started this one is gone."""
    import importlib

    for name in (*PRELOAD, *SERVER_PRELOAD):
        importlib.import_module(name)
    parent = os.getppid()
    base = list(sys.path[1:])  # the interpreter's path after sys.path[0] (no PYTHONPATH here)
    global base_threads
    import torch
    base_threads = torch.get_num_threads()  # without OMP_NUM_THREADS (the server's environment)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # ready
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        try:
            ready = select.select([listener, wake_r], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap, and tell each command's Popen its wait status
            try:
                pid, sts = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_HEAD.pack(sts))
                except OSError:
                    pass
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                head, fds, _, _ = socket.recv_fds(conn, _HEAD.size, 3)
                request = pickle.loads(_recv_exact(conn, _HEAD.unpack(head)[0]))
            except (OSError, struct.error, pickle.UnpicklingError, EOFError):
                conn.close()
                continue
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                for fd in (wake_r, wake_w, ready_r):
                    os.close(fd)
                _child(request, fds, base, ready_w)  # does not return
            for fd in (*fds, ready_w):
                os.close(fd)
            # as Popen returns: the child is in its session, with its streams and directory
            with os.fdopen(ready_r, "rb") as f:
                failed = f.read()
            conn.settimeout(None)
            try:
                conn.sendall(_HEAD.pack(-1 if failed else pid) + failed)
                waiting[pid] = conn
            except OSError:
                conn.close()


def _print_uncaught(e: BaseException, kind: str) -> None:
    """The traceback the interpreter prints, from the frame it would start at: ``python -m``'s
    shows runpy's frames, a script's starts at the script."""
    ours = {__file__} | ({"<frozen runpy>", getattr(sys.modules.get("runpy"), "__file__", "")}
                        if kind == "script" else set())
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


def _child(request: dict, fds: list[int], base: list[str], ready: int) -> None:
    """In the forked process: become the command the request describes, run it, exit as
    ``python -m`` would."""
    import io
    import multiprocessing.process
    import runpy
    import traceback

    code, interrupted = 1, False
    try:
        signal.set_wakeup_fd(-1)
        for sig in SIGNALS + (signal.SIGCHLD,):
            if sig in request["ignored"]:
                signal.signal(sig, signal.SIG_IGN)
            elif sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            elif sig in (signal.SIGPIPE, signal.SIGXFSZ):  # what an interpreter sets at its start
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.SIG_DFL)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        try:
            os.chdir(request["cwd"])
        except OSError as e:
            os.write(ready, f"{e.errno}:{e.strerror}".encode())
            os._exit(255)
        os.close(ready)
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 4096)
        os.umask(request["umask"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        cwd = request["cwd"]
        extra = [os.path.abspath(p) if p else cwd for p in env.get("PYTHONPATH", "").split(os.pathsep)] \
            if env.get("PYTHONPATH") else []
        sys.path[:] = [cwd, *extra, *base]
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        tempfile.tempdir = None  # computed again from TMPDIR
        threads = env.get("OMP_NUM_THREADS", "")
        import torch
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else base_threads)
        multiprocessing.process.current_process().authkey = os.urandom(32)
        kind, target, unbuffered, argv = request["run"]
        unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
        if kind == "script":  # as the interpreter does: the script's own directory first
            sys.path[0] = os.path.dirname(os.path.realpath(target))
        enc = sys.__stdout__.encoding if sys.__stdout__ else "utf-8"

        def stream(fd: int, write: bool, errors: str):
            raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
            buf = raw if write and unbuffered else (io.BufferedWriter(raw) if write else io.BufferedReader(raw))
            return io.TextIOWrapper(buf, encoding=enc, errors=errors, write_through=write and unbuffered,
                                    line_buffering=write and not unbuffered and (fd == 2 or os.isatty(fd)))
        sys.stdin = sys.__stdin__ = stream(0, False, "strict")
        sys.stdout = sys.__stdout__ = stream(1, True, "strict")
        sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")
        code = 0
        try:
            if kind == "module":
                sys.argv = ["-m", *argv]
                runpy._run_module_as_main(target, alter_argv=True)
            else:
                sys.argv = [target, *argv]
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt as e:
            _print_uncaught(e, kind)
            interrupted = True
        except BaseException as e:
            _print_uncaught(e, kind)
            code = 1
        threading._shutdown()  # as the interpreter ends: threads joined, then atexit handlers
        atexit._run_exitfuncs()
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:
                pass
        if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)

"""The replica groups' quorum store and the parameter server's link store: a TCPStore served by
a process of its own, on a socket bound here to one address (loopback on one host), so that it
listens where the launcher's line says and nowhere else (listeners.py).

Why a process of its own: torch's store server answers every malformed frame (an oversized
length, a truncated key, a bad magic number) with a c10 warning and a stack trace, about 15
lines each (``TCPStoreLibUvBackend.cpp``, torch 2.13): a stranger who reaches the port floods
the job's log with them. c10 reads its log level (``TORCH_CPP_LOG_LEVEL``) once, when torch is
imported, long before the launcher knows its mode, and it would hide the warnings of every other
part of the launcher too. Here the store's process keeps c10's warnings and its stderr comes to
the launcher through a pipe: each of the store's malformed-frame warnings, trace included, is
dropped and counted, the first of each kind said in one allhands line, a count at the end.
The store cannot say which client sent a frame (its warning names none), so neither can the
line. Every other line passes through unchanged.

The process ends when its standard input closes: when the launcher ends it, or dies.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from allhands.errors import LaunchError
from allhands.launch.listeners import bind_socket

# c10's log line: "[W1204 22:54:54.894479212 TCPStoreLibUvBackend.cpp:126] [c10d] MESSAGE"
_C10 = re.compile(r"^\[[WEI]\d{4} [\d:.]+ (\S+):\d+\] (?:\[c10d\] )?(.*)$")
_FRAME = "Error processing client message: "
_START_S = 120.0  # the store's process imports torch: seconds on a loaded host


class HostedStore:
    """A TCPStore in a child process listening on ``addr:port`` (0: a free port) only; ``port``
    is where it listens, ``where`` how the intrusion lines name it."""

    def __init__(self, addr: str, port: int, what: str, timeout_s: float):
        sock = bind_socket(addr, port, what)
        sock.listen(512)  # clients may dial before the store serves: they wait in the backlog
        self.addr, self.port = sock.getsockname()[:2]
        self.where = f"{what} at {self.addr}:{self.port}"
        self.frames: dict[str, int] = {}
        code = ("import sys, torch.distributed as d; from datetime import timedelta as t; "
                "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False, "
                "timeout=t(seconds=float(sys.argv[3])), master_listen_fd=int(sys.argv[4])); "
                "print('ready', flush=True); sys.stdin.read()")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(self.addr), str(self.port), str(timeout_s),
                 str(sock.fileno())], pass_fds=(sock.fileno(),),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        finally:
            sock.close()  # the child holds it now
        self._reader = threading.Thread(target=self._read, name="allhands-store-log", daemon=True)
        self._reader.start()

    def ready(self) -> None:
        """Wait until the store serves; LaunchError with its last lines when it could not."""
        line, deadline = b"", time.monotonic() + _START_S
        while not line and self.proc.poll() is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise LaunchError(f"the {self.where} did not start (exit {self.proc.poll()}); see the "
                              f"lines above")

    def _read(self) -> None:
        trace = False
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            m = _C10.match(line)
            if m and m.group(2).startswith(_FRAME):
                trace = True
                kind = re.sub(r"\d+", "N", m.group(2)[len(_FRAME):])
                self.frames[kind] = self.frames.get(kind, 0) + 1
                if self.frames[kind] == 1:
                    print(f"allhands: intrusion: the {self.where} dropped a malformed frame "
                          f"({m.group(2)[len(_FRAME):]}): a process outside the job sent it (the "
                          f"store does not say who); it changed nothing", file=sys.stderr, flush=True)
                continue
            if trace and (not line or line.startswith(("Exception raised from", "frame #"))):
                trace = bool(line)  # its stack trace, up to the blank line that ends it
                continue
            trace = False
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the store's process and say how many malformed frames it dropped."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        total = sum(self.frames.values())
        if total > 1:
            print(f"allhands: intrusion: the {self.where} dropped {total} malformed frames in all "
                  f"({len(self.frames)} kind(s)); the job's values were not changed by them",
                  file=sys.stderr, flush=True)


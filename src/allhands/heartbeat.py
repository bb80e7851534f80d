"""The heartbeat files between a worker and its supervisor's hang watchdog.

Each worker records ``rank-R`` in the launcher's heartbeat directory at the top of every step
('pid step time host done first'); the launcher reads them to find a hung rank and to tell
whether an attempt completed a step before it failed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

WAIT_BEAT_S = 1.0  # how often a rank waiting on another world's process beats

# A beat costs the loop an assignment; a thread writes the newest one at most this often. The
# file is then at most this much older than the beat, far below any sensible hang timeout.
WRITE_EVERY_S = 0.2


class Heartbeat:
    """Worker side: ``rank-R`` in the launcher's heartbeat directory holds 'pid step time host'.

    Written by rename, so the watchdog never reads half a line. The first three beats (a
    completed step shows as the first + 2, ``progressed``) and the last are written at once;
    the others by a background thread within WRITE_EVERY_S, off the training loop's path (a
    file write and rename a step was a measurable share of a small step). The time written is
    the beat's own, so a rank that stopped beating goes stale as before. A no-op outside a
    supervised job.
    """

    def __init__(self, directory: str, rank: int):
        self.path = Path(directory) / f"rank-{rank}" if directory else None
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.first: int | None = None
        self._latest: tuple[int, float, bool] | None = None  # (step, time, done) of the last beat
        self._written: tuple[int, float, bool] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._waits = 0  # callers inside ``waiting()``
        self._wait_thread: threading.Thread | None = None
        self._thread: threading.Thread | None = None

    def beat(self, step: int, done: bool = False) -> None:
        if self.path is None:
            return
        self.first = step if self.first is None else self.first
        self._latest = (step, time.time(), done)  # one assignment: the thread reads it whole
        if done or step <= self.first + 2:
            self.close()
            self._write()
        elif self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="allhands-heartbeat", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the writer thread (the next throttled beat starts it again)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(WRITE_EVERY_S):
            self._write()

    def _write(self) -> None:
        with self._lock:
            latest = self._latest
            if latest is None or latest == self._written:
                return
            step, t, done = latest
            tmp = self.path.with_name(f".{self.path.name}.{self.pid}")
            tmp.write_text(f"{self.pid} {step} {t!r} {self.host} {int(done)} {self.first}\n")
            os.replace(tmp, self.path)
            self._written = latest

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Beat the last step again about once a second while the caller waits on a process of
        another world (a parameter server, launch/psgroups.py), whose own watchdog judges it:
        the wait is that process's, so this rank must not be the one blamed for a hang. A rank
        that is itself stopped (SIGSTOP) or hung outside such a wait stops beating all the same."""
        if self.path is None:
            yield
            return
        with self._lock:
            self._waits += 1
            if self._wait_thread is None:
                self._wait_thread = threading.Thread(target=self._beat_while_waiting, daemon=True,
                                                     name="allhands-heartbeat-wait")
                self._wait_thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._waits -= 1

    def _beat_while_waiting(self) -> None:
        while True:
            time.sleep(WAIT_BEAT_S)
            latest = self._latest
            if self._waits and latest is not None and not latest[2]:
                self._latest = (latest[0], time.time(), False)
                self._write()


@dataclass
class Hang:
    rank: int
    pid: int
    step: int
    stale_s: float
    host: str
    detected_at: float
    first_step_timeout: float = 0.0  # > 0: judged in its first step, by this limit

    def describe(self, timeout: float) -> str:
        limit = (f"the first step; fault.first_step_timeout_s={self.first_step_timeout:g}"
                 if self.first_step_timeout else f"fault.hang_timeout_s={timeout:g}")
        return (f"worker rank {self.rank} (pid {self.pid}) on node {self.host} hung: no progress for "
                f"{self.stale_s:.1f} s after step {self.step} ({limit}); the watchdog killed it")


def read_heartbeats(directory: Path) -> dict[int, tuple[int, int, float, str, bool, int]]:
    """``{rank: (pid, step, time, host, done, first step)}`` for every readable heartbeat file."""
    out = {}
    for p in directory.glob("rank-*"):
        try:
            pid, step, t, host, done, first = p.read_text().split()
            out[int(p.name[5:])] = (int(pid), int(step), float(t), host, done == "1", int(first))
        except (OSError, ValueError):
            continue
    return out


def find_hang(beats: dict[int, tuple], now: float, timeout: float,
              alive: Callable[[int], bool], first_step_timeout: float | None = None) -> list[Hang]:
    """The hung ranks: of the live, unfinished ranks, those at the lowest step, if the oldest of
    them has not beaten for ``timeout`` s. Ranks blocked in a collective waiting for a hung peer
    stop beating too, but they got one step further, so they are not blamed.

    Given ``first_step_timeout``, ranks that have not completed a step of this attempt yet (at
    the resumed step S or 'working on S+1': the beat's sixth field is S, see :func:`progressed`)
    are judged by it instead, or by ``timeout`` if that is longer; 0: not at all. The first step
    builds caches and buckets and, under torch.compile, compiles every graph, which takes minutes
    for a large model on a GPU."""
    live = {r: b for r, b in beats.items() if not b[4] and alive(b[0])}
    if not live:
        return []
    low = min(b[1] for b in live.values())
    cands = {r: b for r, b in live.items() if b[1] == low}
    first = 0.0
    if first_step_timeout is not None and any(b[1] < b[5] + 2 for b in cands.values()):
        if first_step_timeout <= 0:
            return []
        first = max(first_step_timeout, timeout)
    if now - min(b[2] for b in cands.values()) < (first or timeout):
        return []
    return [Hang(r, b[0], b[1], now - b[2], b[3], now, first if first > timeout else 0.0)
            for r, b in sorted(cands.items())]


HANGS_FILE = "hangs.log"


def progressed(directory: Path) -> bool:
    """Did the workers beating into ``directory`` complete a step? The first beat is the resumed
    step S, the next 'working on S+1', so a completed step shows as S+2."""
    return any(b[1] >= b[5] + 2 for b in read_heartbeats(directory).values())


def take_hangs(directory: Path) -> list[str]:
    """The watchdog's descriptions of the workers it killed since the last call."""
    path = directory / HANGS_FILE
    try:
        lines = path.read_text().splitlines()
        path.unlink()
    except OSError:
        return []
    return [line for line in lines if line]


def clear_heartbeats(directory: Path) -> None:
    """Forget the beats of stopped workers before torch's agent starts new ones (their ranks
    may differ after a re-rendezvous, and a stale beat would count as progress)."""
    for p in directory.glob("rank-*"):
        p.unlink(missing_ok=True)

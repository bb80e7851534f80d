"""A job for tests/test_cli.py: rank 0 raises at once; rank 1 ignores SIGTERM (as a worker
blocked in C++ never reaches its clean-stop handler) and sleeps. The launcher must stop rank 1
at once, not after torch's 30 s grace for a SIGTERM. With STUCK_PEER_RECORD=PATH, rank 1 writes
"ready" there once it ignores SIGTERM (rank 0 raises only then) and "SIGTERM" for every SIGTERM
it gets.

    allhands launch --nproc 2 tests/scripts/stuck_peer_job.py
"""

import os
import signal
import time

from allhands.env import worker_env
from allhands.worker import reported_failures

RECORD = os.environ.get("STUCK_PEER_RECORD")


def note(line: str) -> None:
    if RECORD:
        with open(RECORD, "a") as f:
            f.write(line + "\n")


with reported_failures():
    if worker_env().rank == 0:
        deadline = time.monotonic() + (60 if RECORD else 0.5)  # rank 1 has its handler by then
        while not (RECORD and os.path.exists(RECORD)) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("boom in rank 0")
    signal.signal(signal.SIGTERM, lambda *_: note("SIGTERM"))  # and sleeps on
    note("ready")
    time.sleep(120)

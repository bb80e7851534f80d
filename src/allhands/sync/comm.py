"""Counting what a sync strategy communicates, from the sizes of the collectives it launches.

Each strategy owns one :class:`CommMeter` and records every collective it starts: the payload
(bytes of the tensor handed to the collective on this rank) and the ring lower bound on the bytes
this rank must send for it. The trainer takes the totals once per logged step and folds them into
the metrics all_gather it already does, so measuring adds no collective.

Lower bounds per rank for a payload of S bytes over N ranks (Patarasuk & Yuan 2009, and the
NCCL performance notes' "bus bandwidth"):
- all_reduce: 2 (N-1)/N x S (reduce-scatter then all-gather, each moving (N-1)/N of S);
- all_gather of S bytes per rank: (N-1) x S (every rank must receive every other rank's S).
"""

from __future__ import annotations

import threading
import time


def ring_allreduce_bytes(payload: float, n: int) -> float:
    return 2.0 * (n - 1) / n * payload if n > 1 else 0.0


def ring_allgather_bytes(payload: float, n: int) -> float:
    return float(n - 1) * payload


class CommMeter:
    """Accumulates bytes and seconds between two :meth:`take` calls.

    ``time`` is the wall time during which at least one of this rank's collectives was in
    flight; ``exposed`` is the part of it the loop waited for (not hidden behind compute).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # DDP hook callbacks complete on the backend's thread
        self.reset()
        self._pending: list[tuple[float, float]] = []

    def reset(self) -> None:
        self.payload = 0.0
        self.wire = 0.0
        self.time = 0.0
        self.exposed = 0.0

    def collective(self, kind: str, payload: float, n: int) -> None:
        """Record one collective of ``payload`` bytes on this rank over ``n`` ranks."""
        bound = ring_allreduce_bytes(payload, n) if kind == "all_reduce" else ring_allgather_bytes(payload, n)
        with self._lock:
            self.payload += payload
            self.wire += bound

    def blocking(self, seconds: float) -> None:
        """A collective the loop waited for from start to end: all of it is exposed."""
        with self._lock:
            self.time += seconds
            self.exposed += seconds

    # -- asynchronous collectives (DDP buckets): intervals [launched, done] per step
    def launched(self) -> int:
        with self._lock:
            self._pending.append((time.perf_counter(), float("nan")))
            return len(self._pending) - 1

    def done(self, i: int) -> None:
        t = time.perf_counter()
        with self._lock:
            self._pending[i] = (self._pending[i][0], t)

    def close_step(self) -> None:
        """Fold this step's bucket intervals into time and exposed time.

        The last bucket is launched when backward produced the last gradient, so compute is over
        then; whatever communication is still in flight after that moment is what backward's
        end (DDP waits for every bucket there) had to wait for: exposed = last done - last launch.
        """
        with self._lock:
            spans = sorted(p for p in self._pending if p[1] == p[1])
            self._pending = []
        if not spans:
            return
        busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        exposed = max(0.0, max(e for _, e in spans) - max(s for s, _ in spans))
        with self._lock:
            self.time += busy
            self.exposed += exposed

    def take(self) -> tuple[float, float, float, float]:
        """(payload bytes, ring lower-bound bytes, comm seconds, exposed seconds) since last take."""
        with self._lock:
            out = (self.payload, self.wire, self.time, self.exposed)
            self.reset()
        return out

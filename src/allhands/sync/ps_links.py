"""How requests reach a parameter server: over the job's one cross-role group, or (replica mode,
launch/psgroups.py) over links that outlive a worker, a 2-rank gloo group per (worker, server,
worker incarnation), so a dead worker's replacement links to the live servers again.

The job's process groups cannot grow a rank back; a new small group can, made the way
sync/quorum.py makes one per quorum id: a ``ProcessGroupGloo`` over a ``PrefixStore`` of the
job's MAC'd store, admitted like every other group of the job (mesh.py). Keys:
- ``life/K``: worker K's incarnation, bumped by each process of it as it starts;
- ``pid/K/N``: the process id of incarnation N (the servers' statistics list the joins);
- ``link/K/S/N/``: the prefix of the group of worker K (its rank 0) and server S (rank 1).

A server listens to every linked worker at once: a thread per link waits for the next request
header and queues it for the server's loop (gloo's ``recv_anysource`` spans one group only);
it posts the next receive only once the loop has handled the request, so a link carries one
request at a time, as the single group does. A link whose worker died fails its pending
operations at once (gloo: "Connection closed by peer"); the server then drops that worker, and
a push cut short is never applied, since a server steps only once the whole push arrived.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from allhands.mesh import Mesh
from allhands.sync import ps_wire as w


def _life(store: dist.Store, worker: int) -> int:
    key = f"life/{worker}"
    return int(store.get(key)) if store.check([key]) else 0


def _link(roles: w.Roles, mesh: Mesh, worker: int, server: int, life: int, rank: int,
          timeout_s: float) -> dist.ProcessGroup:
    """Admitted under the link store's secret: each world's launcher made its own job secret."""
    return mesh.cross_role_group(dist.PrefixStore(f"link/{worker}/{server}/{life}/", roles.links), rank, 2,
                                 timeout_s, secret=roles.link_secret)


def join(roles: w.Roles, mesh: Mesh, timeout_s: float) -> tuple[w.Wire, int]:
    """A worker's links to every server, as a new incarnation; returns them and its number."""
    store, k = roles.links, roles.index
    life = store.add(f"life/{k}", 1)
    store.set(f"pid/{k}/{life}", str(os.getpid()))
    return w.Wire({s: (_link(roles, mesh, k, s, life, 0, timeout_s), 1)
                   for s in range(roles.n_servers)}), life


class AnySource:
    """Requests over the job's one cross-role group: a worker's death stops the job (restart
    mode), so none is ever lost here."""

    rejoins = False
    fresh: set[int] = set()  # never a new incarnation here

    def __init__(self, pg: dist.ProcessGroup, roles: w.Roles):
        self.pg = pg
        self.wire = w.Wire({k: (pg, k) for k in range(roles.n_workers)})  # workers come first
        self.joins: list[list[int]] = []

    def next(self, done: set[int]) -> tuple[int, torch.Tensor | None] | None:
        hdr = torch.empty(w.REQ_LEN, dtype=torch.float64)
        work = self.pg.recv_anysource([hdr], w.TAG_REQ)
        work.wait()
        return work.source_rank(), hdr

    def handled(self, worker: int, last: bool = False) -> None:
        pass

    def lost(self, worker: int) -> None:
        raise RuntimeError(f"worker {worker}'s link failed")


class Hub:
    """Requests over per-incarnation links (replica mode): ``next`` links any worker that
    (re)started, then returns the next request, ``(worker, None)`` when a worker's link failed,
    or None after ``poll_s`` with neither."""

    rejoins = True

    def __init__(self, roles: w.Roles, mesh: Mesh, timeout_s: float, poll_s: float = 0.05):
        self.store, self.mesh, self.roles, self.timeout_s, self.poll_s = roles.links, mesh, roles, timeout_s, poll_s
        self.wire = w.Wire()
        self.life = [0] * roles.n_workers  # the incarnation linked, per worker
        self.turn: dict[int, threading.Semaphore] = {}
        self.closing: set[int] = set()
        self.fresh: set[int] = set()  # newly linked incarnations, until the server saw a request
        self.queue: queue.Queue = queue.Queue()
        self.joins: list[list[int]] = []  # [worker, incarnation, pid, seconds since start]
        self.t0, self._polled = time.perf_counter(), 0.0

    def _accept(self, done: set[int]) -> None:
        for k in range(self.roles.n_workers):
            if k in done:
                continue
            life = _life(self.store, k)
            if life <= self.life[k]:
                continue
            # A newer incarnation: its process is making its side of this group now.
            pg = _link(self.roles, self.mesh, k, self.roles.index, life, 1, self.timeout_s)
            self.life[k] = life
            self.wire.links[k] = (pg, 0)
            self.turn[k] = threading.Semaphore(0)
            self.closing.discard(k)
            self.fresh.add(k)
            pid = int(self.store.get(f"pid/{k}/{life}"))
            self.joins.append([k, life, pid, round(time.perf_counter() - self.t0, 3)])
            threading.Thread(target=self._listen, args=(k, life, pg, self.turn[k]), daemon=True,
                             name=f"ps-link-{k}-{life}").start()

    def _listen(self, k: int, life: int, pg: dist.ProcessGroup, turn: threading.Semaphore) -> None:
        while True:
            hdr = torch.empty(w.REQ_LEN, dtype=torch.float64)
            try:
                pg.recv([hdr], 0, w.TAG_REQ).wait()
            except RuntimeError:  # the worker died (or finished and closed its side)
                self.queue.put((k, life, None))
                return
            self.queue.put((k, life, hdr))
            turn.acquire()  # until the loop handled it
            if k in self.closing and self.life[k] == life:
                return

    def next(self, done: set[int]) -> tuple[int, torch.Tensor | None] | None:
        now = time.perf_counter()
        if now - self._polled >= self.poll_s:
            self._polled = now
            self._accept(done)
        try:
            k, life, hdr = self.queue.get(timeout=self.poll_s)
        except queue.Empty:
            return None
        if life != self.life[k]:  # from an incarnation already replaced: ignore
            return None
        return k, hdr

    def handled(self, worker: int, last: bool = False) -> None:
        """The loop handled ``worker``'s request; ``last``: it was its DONE, so stop listening."""
        if last:
            self.closing.add(worker)
        self.turn[worker].release()

    def lost(self, worker: int) -> None:
        self.closing.add(worker)
        self.turn[worker].release()  # a listener blocked there ends


class Share:
    """A one-process worker world's share of each global batch: worker ``index`` of ``workers``
    (the trainer's sampler sees a world of one)."""

    def __init__(self, sampler: Any, index: int, workers: int):
        self.sampler, self.index, self.workers = sampler, index, workers

    def local_micro_batches(self, step: int, rank: int, world: int, micro_batches: int) -> list[list[int]]:
        return self.sampler.local_micro_batches(step, self.index, self.workers, micro_batches)

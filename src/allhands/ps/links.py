"""How requests reach a parameter server: over the job's one cross-role group, or (replica mode,
launch/psgroups.py) over links that outlive a process, a 2-rank gloo group per (worker, server,
worker incarnation, server incarnation), so a dead worker's replacement links to the live
servers again, and a restarted server to the live workers.

The job's process groups cannot grow a rank back; a new small group can, made the way
replica/quorum.py makes one per quorum id: a ``ProcessGroupGloo`` over a ``PrefixStore`` of the
job's MAC'd store, admitted like every other group of the job (mesh.py). Keys:
- ``life/K``, ``slife/S``: worker K's, server S's incarnation, bumped by each process as it starts;
- ``pid/K/N``, ``spid/S/M``: the process id of incarnation N (M) (the servers' statistics);
- ``link/K/S/N/M/``: the prefix of the group of worker K (its rank 0) and server S (rank 1);
- ``done/K``: worker K delivered its DONE to every server (a restarted server waits for no
  worker that finished before it came back).

A server listens to every linked worker at once: a thread per link makes the group, then waits
for the next request header and queues it for the server's loop (gloo's ``recv_anysource``
spans one group only); it posts the next receive only once the loop has handled the request, so
a link carries one request at a time, as the single group does. A link whose peer died fails its
pending operations at once (gloo: "Connection closed by peer"); a server then drops that worker,
and a push cut short is never applied, since a server steps only once the whole push arrived; a
worker waits for the server's next incarnation and links to it (``relink``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from allhands import collective
from allhands.mesh import Mesh
from allhands.ps import wire as w


def _life(store: dist.Store, key: str) -> int:
    return int(store.get(key)) if store.check([key]) else 0


def _link(roles: w.Roles, mesh: Mesh, worker: int, server: int, life: int, slife: int, rank: int,
          timeout_s: float, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Admitted under the link store's secret: each world's launcher made its own job secret.
    ``store``: the link store's client to make it through (default ``roles.links``)."""
    store = roles.links if store is None else store
    return mesh.cross_role_group(dist.PrefixStore(f"link/{worker}/{server}/{life}/{slife}/", store),
                                 rank, 2, timeout_s, secret=roles.link_secret)


def join(roles: w.Roles, mesh: Mesh, timeout_s: float) -> tuple[w.Wire, int, list[int]]:
    """A worker's links to every server, as a new incarnation; returns them, its number and the
    servers' incarnations linked."""
    store, k = roles.links, roles.index
    life = store.add(f"life/{k}", 1)
    store.set(f"pid/{k}/{life}", str(os.getpid()))
    wire, slives = w.Wire(), [0] * roles.n_servers
    for s in range(roles.n_servers):
        slives[s] = relink(roles, mesh, wire, life, s, 0, timeout_s)
    return wire, life, slives


def relink(roles: w.Roles, mesh: Mesh, wire: w.Wire, life: int, server: int, after: int,
           timeout_s: float) -> int:
    """Link this worker (incarnation ``life``) to the first incarnation of ``server`` newer than
    ``after``, waiting for it to start (torch's agent restarts a dead server world); returns it."""
    key, deadline = f"slife/{server}", time.monotonic() + timeout_s
    while (slife := _life(roles.links, key)) <= after:
        if time.monotonic() > deadline:
            raise RuntimeError(f"parameter server {server} did not come back within "
                               f"parallel.timeout_s={timeout_s:g} s")
        time.sleep(0.05)
    wire.links[server] = (_link(roles, mesh, roles.index, server, life, slife, 0, timeout_s), 1)
    return slife


def finished(roles: w.Roles) -> None:
    """This worker's DONE reached every server: a server restarted later need not wait for it."""
    roles.links.set(f"done/{roles.index}", "1")


class AnySource:
    """Requests over the job's one cross-role group: a worker's death stops the job (restart
    mode), so none is ever lost here."""

    rejoins = False
    incarnation = 1  # a restart restarts every process (restart mode)
    fresh: set[int] = set()  # never a new incarnation here
    finished: set[int] = set()  # a DONE always comes over the group

    def __init__(self, pg: dist.ProcessGroup, roles: w.Roles):
        self.pg = pg
        self.wire = w.Wire({k: (pg, k) for k in range(roles.n_workers)})  # workers come first
        self.joins: list[list[int]] = []

    def next(self, done: set[int]) -> tuple[int, torch.Tensor | None] | None:
        hdr = torch.empty(w.REQ_LEN, dtype=torch.float64)
        work = collective.recv(hdr, None, call="parameter server", group=self.pg, tag=w.TAG_REQ)
        work.wait()
        return work.source_rank(), hdr

    def handled(self, worker: int, last: bool = False) -> None:
        pass

    def lost(self, worker: int) -> None:
        raise RuntimeError(f"worker {worker}'s link failed")


class Hub:
    """Requests over per-incarnation links (replica mode): ``next`` links any worker that
    (re)started, then returns the next request, ``(worker, None)`` when a worker's link failed,
    or None after ``poll_s`` with neither. ``incarnation``: this server process's number (above
    1: the servers restarted, and every live worker links to it again)."""

    rejoins = True

    def __init__(self, roles: w.Roles, mesh: Mesh, timeout_s: float, poll_s: float = 0.05):
        self.store, self.mesh, self.roles, self.timeout_s, self.poll_s = roles.links, mesh, roles, timeout_s, poll_s
        self.incarnation = self.store.add(f"slife/{roles.index}", 1)
        self.store.set(f"spid/{roles.index}/{self.incarnation}", str(os.getpid()))
        self.wire = w.Wire()
        self.life = [0] * roles.n_workers  # the incarnation linked, per worker
        self.turn: dict[int, threading.Semaphore] = {}
        self.closing: set[int] = set()
        self.fresh: set[int] = set()  # newly linked incarnations, until the server saw a request
        self.finished: set[int] = set()  # workers whose DONE reached every server (``done/K``)
        self.queue: queue.Queue = queue.Queue()
        self.joins: list[list[int]] = []  # [worker, incarnation, pid, seconds since start]
        self.t0, self._polled = time.perf_counter(), 0.0

    def incarnations(self) -> list[list[int]]:
        """[incarnation, pid] of this server, earlier ones first (pids from the store)."""
        i = self.roles.index
        return [[m, int(self.store.get(f"spid/{i}/{m}"))] for m in range(1, self.incarnation + 1)
                if self.store.check([f"spid/{i}/{m}"])]

    def _accept(self, done: set[int]) -> None:
        for k in range(self.roles.n_workers):
            if k in done:
                continue
            if self.incarnation > 1 and self.store.check([f"done/{k}"]):
                self.finished.add(k)  # it finished while the servers restarted
                continue
            life = _life(self.store, f"life/{k}")
            if life <= self.life[k]:
                continue
            # A newer incarnation (or, this server being new, the live one): it makes its side of
            # the group now, or once it notices that this server restarted. A thread makes ours,
            # so a worker that is slow to notice (or died meanwhile) holds up no other.
            self.life[k] = life
            self.turn[k] = threading.Semaphore(0)
            pid = int(self.store.get(f"pid/{k}/{life}"))
            self.joins.append([k, life, pid, round(time.perf_counter() - self.t0, 3)])
            threading.Thread(target=self._listen, args=(k, life, self.turn[k]), daemon=True,
                             name=f"ps-link-{k}-{life}").start()

    def _listen(self, k: int, life: int, turn: threading.Semaphore) -> None:
        try:
            # Through a client of its own: a TCPStore client runs one request at a time, and gloo
            # waits in it for the worker's records (up to timeout_s, for an incarnation that died
            # before linking), which held up the loop's own store reads and with them the
            # server's heartbeat: its watchdog took it for hung, again at every restart
            pg = _link(self.roles, self.mesh, k, self.roles.index, life, self.incarnation, 1, self.timeout_s,
                       store=self.store.clone())
        except RuntimeError:  # the worker died or finished before linking (the store timed out)
            self.queue.put((k, life, None, None))
            return
        self.queue.put((k, life, pg, None))  # the loop installs it between requests
        while True:
            hdr = torch.empty(w.REQ_LEN, dtype=torch.float64)
            try:
                collective.recv(hdr, 0, call="parameter server", group=pg, tag=w.TAG_REQ).wait()
            except RuntimeError:  # the worker died (or finished and closed its side)
                self.queue.put((k, life, None, None))
                return
            self.queue.put((k, life, None, hdr))
            turn.acquire()  # until the loop handled it
            if k in self.closing and self.life[k] == life:
                return

    def next(self, done: set[int]) -> tuple[int, torch.Tensor | None] | None:
        now = time.perf_counter()
        if now - self._polled >= self.poll_s:
            self._polled = now
            self._accept(done)
        try:
            k, life, pg, hdr = self.queue.get(timeout=self.poll_s)
        except queue.Empty:
            return None
        if life != self.life[k]:  # from an incarnation already replaced: ignore
            return None
        if pg is not None:  # linked: its requests follow in the queue
            self.wire.links[k] = (pg, 0)
            self.closing.discard(k)
            self.fresh.add(k)
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

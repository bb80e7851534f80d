"""The parameter server's shared vocabulary: who is a server, which server owns which piece of
which parameter, and the fixed-size tensor messages the roles exchange.

Roles: the job's last ``ps.servers`` ranks are servers, the others workers, so worker ranks
equal their global ranks (rank 0, a worker, writes the metrics as in every other layout). Each
role has a default process group of its own (a prefix of the launcher's store, so the
trainer's collectives span the workers only and the servers' checkpoint collectives the servers
only), and one gloo group over every rank carries the point-to-point traffic between them. In
replica mode (launch/psgroups.py) every worker is a world of its own and the traffic goes over
a group per worker and server instead (ps/links.py); a ``Wire`` hides which.

Messages are plain tensors sent with gloo's ``send``/``recv`` (nothing is pickled): a request
header of 8 float64 from a worker, then its payload (a push: the dense gradient pieces, then
for embedding tables (ps/rows.py) the row count per table piece, the row ids and the
gradient rows; a ROWS fetch: the ids, answered with the rows); a reply header of 4 float64 from a server,
then the parameters. Float64 holds every clock, version and count exactly (below 2**53).
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from allhands import collective
from allhands.authstore import sealed
from allhands.env import ps_env

# Request flags (a worker's header[0]); several may be set in one request.
PUSH, PULL, INIT, DONE, SAVE, TICK, ROWS = 1, 2, 4, 8, 16, 32, 64
# Tags keep the streams of one pair of ranks apart.
TAG_REQ, TAG_GRAD, TAG_REP, TAG_PARAM, TAG_INIT, TAG_COUNTS, TAG_IDS, TAG_ROWS = 1, 2, 3, 4, 5, 6, 7, 8
REQ_LEN, REP_LEN = 8, 4


@dataclass(frozen=True)
class Roles:
    server: bool
    index: int        # rank within this role's default group
    size: int         # ranks of this role
    n_workers: int
    n_servers: int
    rank: int         # rank in the whole job (= in the cross-role group)
    world: int
    role_store: dist.Store | None
    cross_store: dist.Store | None
    links: dist.Store | None = None  # replica mode: the job's MAC'd link store (links.py)
    link_secret: str | None = None  # and the secret its links are admitted under

    def server_rank(self, s: int) -> int:
        return self.n_workers + s


@functools.lru_cache(maxsize=None)
def ps_roles(servers: int, rank: int, world: int, timeout_s: float) -> Roles:
    """This rank's role, from the launcher's env:// store (the same one, with torchelastic's
    per-attempt prefix, that ``init_process_group`` would use). Cached: worker.py and
    build_sync ask alike, and one store client per process suffices. In replica mode the role
    comes from the environment (launch/psgroups.py) and ``rank`` is this process's rank in
    its own world (a worker's is 0)."""
    group = ps_env()
    if group is not None:
        n_workers = group.groups - 1
        server = group.group == n_workers
        index = rank if server else group.group
        store = sealed(dist.TCPStore(group.host, group.port, is_master=False,
                                     timeout=datetime.timedelta(seconds=timeout_s)), group.secret,
                       f"parameter-server link store at {group.host}:{group.port}", tolerant=True)
        return Roles(server, index, servers if server else 1, n_workers, servers,
                     n_workers + index if server else index, n_workers + servers, None, None, store,
                     group.secret)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world,
                                       timeout=datetime.timedelta(seconds=timeout_s)))
    n_workers = world - servers
    server = rank >= n_workers
    role = "servers" if server else "workers"
    return Roles(server, rank - n_workers if server else rank, servers if server else n_workers,
                 n_workers, servers, rank, world, dist.PrefixStore(f"ps-{role}/", store),
                 dist.PrefixStore("ps-cross/", store))


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened trainable parameter ``param``, on ``server``
    (for an embedding table: rows ``[start, stop)``)."""

    param: int
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_shards(numels: list[int], elem_bytes: list[int], servers: int) -> list[Piece]:
    """Cut the concatenation of the flattened parameters into ``servers`` contiguous ranges of
    equal bytes (to one element): a tensor larger than a share is split across servers, small
    ones stay whole unless they straddle a boundary. Deterministic: every rank computes it alike."""
    total = sum(n * b for n, b in zip(numels, elem_bytes))
    bounds = [total * (s + 1) / servers for s in range(servers)]
    pieces: list[Piece] = []
    s, offset = 0, 0  # current server; bytes before the current parameter
    for i, (n, b) in enumerate(zip(numels, elem_bytes)):
        start = 0
        while start < n:
            # elements of this parameter that fit before server s's upper bound
            fit = n if s == servers - 1 else min(n, max(start, int(-(-(bounds[s] - offset) // b))))
            if fit > start:
                pieces.append(Piece(i, start, fit, s))
                start = fit
            if start < n:
                s += 1
        offset += n * b
    return pieces


def server_pieces(plan: list[Piece], server: int) -> list[Piece]:
    return [p for p in plan if p.server == server]


def request(flags: int, clock: int, lr: float = 0.0, norm: float = 0.0, version: int = 0,
            count: int = 0, rows: int = 0) -> torch.Tensor:
    """``count``: INIT's pieces, or the table a ROWS fetch reads; ``rows``: the ids that follow."""
    return torch.tensor([flags, clock, lr, norm, version, count, rows, 0], dtype=torch.float64)


def link_failed(e: Exception) -> bool:
    """A gloo point-to-point operation failed because its peer went away (gloo's transport
    errors name their source file, or torch raises its network error, as for a reset connection),
    not a bug of this process."""
    return isinstance(e, dist.DistNetworkError) or isinstance(e, RuntimeError) and "/gloo/" in str(e)


class Wire:
    """Point-to-point tensors to the other role, by the peer's index (a server's, or a worker's):
    ``links[peer] = (group, the peer's rank in it)``. The groups are gloo's, for host tensors:
    a GPU worker's tensor is sent from a pinned host copy, which the work holds until it is
    done; receives are into host buffers, copied to the device by their reader."""

    def __init__(self, links: dict[int, tuple[Any, int]] | None = None):
        self.links = dict(links or {})

    def send(self, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        pg, rank = self.links[peer]
        return collective.send(collective.to_host(t), rank, call="parameter server", group=pg, tag=tag)

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        pg, rank = self.links[peer]
        return collective.recv(t, rank, call="parameter server", group=pg, tag=tag)


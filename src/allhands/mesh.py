"""The one owner of the process group and the named device mesh.

Built once per worker and passed explicitly to every strategy; nothing else creates process
groups. Its five named dimensions are ``pp``, ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``;
every strategy asks this object for the group of the dimension it works over.

Expert parallelism adds a second view of the same ranks (TorchTitan's ``ParallelDims``): the
data-parallel ranks split into ``ep`` consecutive ranks that share out the experts and
``edp = dp / ep`` groups of them that hold the same experts, the mesh ``(pp, edp, ep, tp)``.
Consecutive ranks of dp are consecutive ranks of dp_shard, so an ep group lies inside a
dp_shard group whenever ep divides dp_shard.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from allhands import collective
from allhands.admission import admit_peers
from allhands.config import MESH_DIMS, ParallelConfig, mesh_sizes
from allhands.authstore import sealed
from allhands.env import worker_admission_env, worker_env, worker_store_env
from allhands.errors import ConfigError


#: Flattened dims: the mesh dims each spans.
FLAT = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        "dp_shard_cp": ("dp_shard", "cp")}


def pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device: 'cuda' but no CUDA device is visible; use cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Mesh:
    """The job's ranks as a named 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)``.

    Dims of size 1 are kept, so every strategy can ask for any dim by name; their groups have
    one member and cost nothing in a collective. ``dp`` (dp_replicate x dp_shard flattened) is
    the set of ranks that see different data: the sampler, eval and metrics use it. The ranks of
    a ``cp`` group see the same sequences, each a part of every one (parallel/context.py), so
    gradients are reduced over ``dp_cp`` (dp x cp) and FSDP shards over ``dp_shard_cp``
    (torchtitan's ``dp_shard_cp``); without context parallelism these are ``dp`` and ``dp_shard``.
    """

    rank: int
    world_size: int
    node_local_rank: int  # this worker's index on its node (picks the GPU)
    device: torch.device
    backend: str
    device_mesh: DeviceMesh
    sizes: dict[str, int] = field(default_factory=dict)
    dp_mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp); None when ep = 1
    _ckpt_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _admit: bool = field(default=False, repr=False)
    _timeout: datetime.timedelta | None = field(default=None, repr=False)  # every group's
    _cpu_group: dist.ProcessGroup | None = field(default=None, repr=False)

    DIMS = MESH_DIMS

    @classmethod
    def build(cls, *, rank: int, world_size: int, local_rank: int, device: str, backend: str,
              dp_replicate: int = -1, dp_shard: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
              timeout_s: float = 300.0, store: dist.Store | None = None) -> "Mesh":
        """Initialise the default process group (env:// from the launcher, or ``store`` for the
        ranks of one role of a larger job: the parameter server's workers) and the mesh."""
        dev = pick_device(device, local_rank)
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        sizes = {"cp": 1, **mesh_sizes(ParallelConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                                                       pp=pp, cp=cp), world_size)}
        timeout = datetime.timedelta(seconds=timeout_s)
        # A CUDA device bound at init: NCCL connects eagerly, and the mesh's groups are split
        # from the default communicator (ncclCommSplit) instead of each made from scratch.
        bound = {"device_id": dev} if dev.type == "cuda" else {}
        admit = False  # launched workers prove the job secret on every group they will use
        if not dist.is_initialized():
            if store is not None:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                        timeout=timeout, **bound)
                admit_peers(dev)
                admit = True
            elif world_size == 1 and rank == 0 and not _has_rendezvous_env():
                # In-process single worker (Python API without a launcher): a private store.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=timeout, **bound)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                        **bound, **_worker_store(rank, world_size, timeout))
                admit_peers(dev)  # before any collective: every peer proves the job secret
                admit = True
        collective.register(dist.group.WORLD, dev)
        shape = tuple(sizes[d] for d in cls.DIMS)
        dmesh = init_device_mesh(dev.type, shape, mesh_dim_names=cls.DIMS,
                                 backend_override=_timed(timeout, dict(zip(cls.DIMS, shape))))
        dp_mesh = _flatten(dmesh, ("dp_replicate", "dp_shard"), "dp", timeout)
        if sizes["cp"] > 1:
            _flatten(dmesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp", timeout)
            _flatten(dmesh, ("dp_shard", "cp"), "dp_shard_cp", timeout)
        emesh = None
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        if ep > 1:
            if dp % ep or sizes["cp"] > 1:
                raise ConfigError(f"parallel.ep: {ep} must divide the {dp} data-parallel ranks "
                                  f"and parallel.cp must be 1")
            grid = dmesh.mesh.reshape(sizes["pp"], dp // ep, ep, sizes["tp"])
            names = ("pp", "edp", "ep", "tp")
            timed = _timed(timeout, dict(zip(names, grid.shape))) or {}
            emesh = DeviceMesh(dev.type, grid, mesh_dim_names=names,
                               backend_override=tuple((None, timed.get(n)) for n in names))
        sizes = {**sizes, "ep": ep, "edp": dp // ep}
        mesh = cls(rank, world_size, local_rank, dev, backend, dmesh, sizes, dp_mesh, emesh,
                   _admit=admit, _timeout=timeout)
        # Each dim's group has connections of its own, set up through the store: a stranger
        # could pose as a member there, so it is admitted like the default group.
        for dim in (*cls.DIMS, "dp", *(("dp_cp", "dp_shard_cp") if sizes["cp"] > 1 else ()),
                    *(("ep", "edp") if ep > 1 else ())):
            collective.register(mesh.group(dim), dev)
            if mesh.size(dim) > 1:
                mesh._admitted(mesh.group(dim))
        return mesh

    def _admitted(self, group: dist.ProcessGroup | None,
                  device: torch.device | None = None) -> dist.ProcessGroup | None:
        if self._admit and group is not None:
            admit_peers(device or self.device, group)
        return group

    # -- any named dim
    def get(self, dim: str) -> DeviceMesh | None:
        """The 1-D submesh of ``dim`` (one of DIMS or "dp"); None when the dim has size 1."""
        if self.size(dim) == 1:
            return None
        return self.submesh(dim)

    def submesh(self, *dims: str) -> DeviceMesh:
        """The submesh over ``dims`` (in mesh order), kept even where a size is 1 (FSDP's HSDP
        takes the 2-D ``("dp_replicate", "dp_shard")``, or ``("dp_replicate", "dp_shard_cp")``)."""
        if dims == ("dp",):
            return self.dp_mesh
        if dims in (("ep",), ("edp",)):
            if self.expert_mesh is None:  # ep = 1: every rank holds every expert
                if dims == ("ep",):
                    raise ValueError("the mesh has no ep dim: parallel.ep is 1")
                return self.dp_mesh
            return self.expert_mesh[dims[0]]
        return self.device_mesh[dims if len(dims) > 1 else dims[0]]

    def group(self, dim: str) -> dist.ProcessGroup:
        if dim in FLAT or dim in ("ep", "edp"):
            return self.submesh(dim).get_group()
        return self.device_mesh.get_group(dim)

    def size(self, dim: str) -> int:
        if dim in FLAT:
            return math.prod(self.sizes[d] for d in FLAT[dim])
        return self.sizes[dim]

    def grad_dim(self, replicate: bool = True) -> str:
        """The dim whose ranks reduce one gradient: the data-parallel ranks (``dp``, or only
        ``dp_shard`` when a sync strategy reconciles the replicas itself) and, under context
        parallelism, their cp ranks with them."""
        if self.sizes["cp"] == 1:
            return "dp" if replicate else "dp_shard"
        return "dp_cp" if replicate else "dp_shard_cp"

    def local_rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (or in the flattened ``dp``)."""
        if dim in ("ep", "edp") and self.size(dim) == 1:
            return 0
        if dim in FLAT or dim in ("ep", "edp"):
            return self.submesh(dim).get_local_rank()
        return self.device_mesh.get_local_rank(dim)

    # -- the data-parallel view used by the sampler, eval and the sync strategies
    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Ranks that see different data: dp_replicate x dp_shard."""
        return self.group("dp")

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def pp_ends_group(self) -> dist.ProcessGroup | None:
        """The two ranks holding the first and the last pipeline stage with this rank's other
        coordinates, where tied embedding gradients are summed (Megatron-LM's embedding group);
        None on a middle stage. Collective: every rank calls it, once."""
        grid = self.device_mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
        pairs = [[int(a), int(b)] for a, b in zip(grid[0].flatten(), grid[-1].flatten())]
        mine, _ = dist.new_subgroups_by_enumeration(pairs, timeout=self._timeout)
        return self._admitted(collective.register(mine, self.device))

    def describe(self) -> str:
        return " x ".join(f"{d}={self.sizes[d]}" for d in self.DIMS if d != "cp" or self.sizes[d] > 1)

    def model_group(self, replicate: bool = True) -> dist.ProcessGroup | None:
        """The group of every rank training this rank's copy of its pipeline stage: the data,
        context and tensor-parallel ranks, without ``dp_replicate`` when a sync strategy
        reconciles the replicas itself (their copies differ). None where that is this rank
        alone. Built on the first call, which every rank makes (Muon's world, allhands.muon)."""
        dims = tuple(d for d in ("dp_replicate", "dp_shard", "cp", "tp")
                     if self.sizes[d] > 1 and (replicate or d != "dp_replicate"))
        if not dims:
            return None
        if len(dims) == 1:
            return self.group(dims[0])
        name = "model_" + "_".join(dims)
        flat = _flatten(self.device_mesh, dims, name, self._timeout)
        return self._admitted(collective.register(flat.get_group(), self.device))

    def checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank for DCP's asynchronous saves, whose collectives run in a
        writer thread: on a group of their own they never interleave with the training
        collectives of the main thread. Collective on first call: every rank calls it alike."""
        if self._ckpt_group is None:
            group = collective.register(dist.new_group(backend="gloo", timeout=self._timeout), "cpu")
            self._ckpt_group = self._admitted(group, torch.device("cpu"))
        return self._ckpt_group

    def cpu_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank for small CPU-side agreements on the main thread (replica
        mode's quorum, replica/quorum.py): the default group on a CPU mesh, a new one (made once)
        on a GPU's. Collective on first call there: every rank calls it alike."""
        if self.device.type == "cpu":
            return dist.group.WORLD
        if self._cpu_group is None:
            group = collective.register(dist.new_group(backend="gloo", timeout=self._timeout), "cpu")
            self._cpu_group = self._admitted(group, torch.device("cpu"))
        return self._cpu_group

    def cross_role_group(self, store: dist.Store, rank: int, size: int, timeout_s: float,
                         secret: str | None = None) -> dist.ProcessGroup:
        """A gloo group over every rank of a job whose roles each have a default group of their
        own (parameter servers and their workers, ps/client.py), for point-to-point traffic between
        the roles. Not registered with the default group (whose world is one role); admitted,
        under ``secret`` when it spans worlds of their own (admission.admit_peers)."""
        pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))
        collective.register(pg, "cpu")
        if self._admit:
            admit_peers(torch.device("cpu"), pg, secret=secret)
        return pg

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _group_options(timeout: datetime.timedelta) -> Any:
    """Fresh options naming ``timeout`` for a group of the default group's backend (None for a
    backend whose options are not known here: its groups keep torch's default). Fresh for every
    dim: NCCL keeps the options object it is given and torch writes each group's ranks into it."""
    backend = dist.get_backend()
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False  # what torch's own default options say
    else:
        return None
    opts._timeout = timeout
    return opts


def _timed(timeout: datetime.timedelta, sizes: dict[str, int]) -> dict[str, Any] | None:
    """``backend_override`` for a DeviceMesh whose dims have ``sizes``: the job's timeout for
    every group it makes. torch 2.13 makes a mesh's groups with its default timeout (30 min
    gloo, 10 min NCCL), not the default group's, unless their options name one
    (device_mesh.py ``_init_one_process_group``). A dim over every rank is left without: torch
    reuses the default group for it, which has the timeout already (options would make it a
    group of its own), except under gloo on a machine with CUDA, where torch makes a new one."""
    world = dist.get_world_size()
    new = torch.cuda.is_available() and dist.get_backend() == "gloo"
    out = {d: _group_options(timeout) for d, n in sizes.items() if n != world or new}
    return out if out and None not in out.values() else None


def _flatten(dmesh: DeviceMesh, dims: tuple[str, ...], name: str,
             timeout: datetime.timedelta) -> DeviceMesh:
    """``dmesh[dims]`` flattened into one dim ``name``, its group under the job's timeout."""
    timed = _timed(timeout, {name: math.prod(dmesh[d].size() for d in dims)})
    return dmesh[dims]._flatten(name, backend_override=timed[name] if timed else None)


def _has_rendezvous_env() -> bool:
    return worker_env().launched


def _worker_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """How the default process group meets its peers: torch's ``env://`` store, behind a
    :class:`~allhands.authstore.MACStore` under the job secret, so that gloo's connection
    records (and every other value) are the job's own; plain ``env://`` with --insecure.

    The same client torch's ``env://`` rendezvous builds (``_create_c10d_store``): a TCPStore
    client of the agent's store (a fresh one every round), or, without the agent's store, one
    hosted by rank 0."""
    secret, _, _ = worker_admission_env()
    if not secret:
        return {"init_method": "env://"}
    addr, port, agent_store, _ = worker_store_env()
    where = f"worker store at {addr}:{port}"
    if agent_store:
        tcp = dist.TCPStore(addr, port, world_size, False, timeout=timeout)
        # No per-attempt prefix, as torch's own env:// client: every round has a store of its
        # own, and a node that rejoins has another restart count than the nodes that stayed.
        return {"store": sealed(tcp, secret, where)}
    tcp = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout)
    return {"store": sealed(tcp, secret, where)}

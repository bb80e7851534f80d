"""The one owner of the process group and the named device mesh.

Built once per worker and passed explicitly to every strategy; nothing else creates process
groups. Today the mesh has one dimension, ``dp_replicate``; the sharding issue adds ``dp_shard``,
``tp`` and ``pp`` here, and every strategy keeps asking this object for its group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from allhands.errors import ConfigError


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
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    device_mesh: DeviceMesh
    _ckpt_group: dist.ProcessGroup | None = field(default=None, repr=False)

    DIMS = ("dp_replicate",)

    @classmethod
    def build(cls, *, rank: int, world_size: int, local_rank: int, device: str, backend: str,
              dp_replicate: int, timeout_s: float) -> "Mesh":
        """Initialise the default process group (env:// from the launcher) and the mesh."""
        dev = pick_device(device, local_rank)
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        dp = world_size if dp_replicate == -1 else dp_replicate
        if dp != world_size:
            raise ConfigError(f"parallel.dp_replicate={dp_replicate} does not multiply to the "
                              f"world size {world_size}; use -1 or {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if world_size == 1 and rank == 0 and not _has_rendezvous_env():
                # In-process single worker (Python API without a launcher): a private store.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=timeout)
            else:
                dist.init_process_group(backend, init_method="env://", rank=rank,
                                        world_size=world_size, timeout=timeout)
        dmesh = init_device_mesh(dev.type, (dp,), mesh_dim_names=cls.DIMS)
        return cls(rank, world_size, local_rank, dev, backend, dmesh)

    # -- the data-parallel view used by the sampler and the sync strategies
    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp_replicate")

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank("dp_replicate")

    @property
    def dp_size(self) -> int:
        return self.device_mesh.size(0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank for DCP's asynchronous saves, whose collectives run in a
        writer thread: on a group of their own they never interleave with the training
        collectives of the main thread. Collective on first call: every rank calls it alike."""
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _has_rendezvous_env() -> bool:
    from allhands.launch import worker_env  # launch.py is the one reader of the launcher's env

    return worker_env().launched

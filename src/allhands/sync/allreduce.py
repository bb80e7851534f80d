"""Synchronous data parallelism: every step's gradients are averaged over all data-parallel
ranks, by the wrapper ``parallelize`` applied (DDP's all-reduce, or FSDP's reduce-scatter and,
for hybrid sharding, all-reduce across replicas).

With DDP, accumulation micro-steps run under ``no_sync`` so only the last one communicates; DDP
overlaps the bucketed all-reduce with the rest of that backward pass. FSDP reduce-scatters every
micro-step: that keeps gradients sharded (ZeRO-2/3's memory saving) at the cost of more traffic.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands.mesh import Mesh
from allhands.sync.base import SyncStrategy


class AllReduceSync(SyncStrategy):
    name = "allreduce"

    def __init__(self, bucket_mb: float = 25.0):
        self.bucket_mb = bucket_mb

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        return model  # parallelize() already reconciles replicas (reconciles_replicas is False)

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()

"""Synchronous data parallelism: every micro-step's gradients are averaged by DDP's all-reduce.

Accumulation micro-steps run under ``no_sync`` so only the last one communicates; DDP
overlaps the bucketed all-reduce with the rest of that backward pass.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from allhands.mesh import Mesh
from allhands.parallel.ddp import apply_ddp
from allhands.sync.base import SyncStrategy


class AllReduceSync(SyncStrategy):
    name = "allreduce"

    def __init__(self, bucket_mb: float = 25.0):
        self.bucket_mb = bucket_mb

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        return apply_ddp(model, mesh, bucket_mb=self.bucket_mb)

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else model.no_sync()

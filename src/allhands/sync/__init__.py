"""How data-parallel replicas reconcile their updates: all-reduce (with compression or PowerSGD),
DiLoCo and local SGD, and ``auto`` choosing between them. One module per strategy; the loop sees
only ``base.SyncStrategy``. The parameter server (``allhands.ps``) is a strategy of its own mode and
brings its own builder to the trainer; nothing here imports it."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from allhands.config import Config
from allhands.mesh import Mesh
from allhands.sync.allreduce import AllReduceSync
from allhands.sync.auto import choose
from allhands.sync.base import SyncStrategy
from allhands.sync.diloco import DiLoCoSync, LocalSGDSync, replicate_group

STRATEGIES = {"allreduce": AllReduceSync, "diloco": DiLoCoSync, "local_sgd": LocalSGDSync}

#: What builds a run's strategy: ``(cfg, mesh, model) -> (strategy, line for the log)``.
SyncBuilder = Callable[[Config, Mesh, nn.Module], "tuple[SyncStrategy, str]"]


def build_sync(cfg: Config, mesh: Mesh, model: nn.Module) -> tuple[SyncStrategy, str]:
    """The data-parallel strategy ``parallel.sync`` names (``auto`` measured here), and a line for
    the log. ``ps`` is built by its own mode (ps/start.py)."""
    s, name, note = cfg.sync, cfg.parallel.sync, ""
    if name == "auto":
        name, note = choose(model, replicate_group(mesh), mesh.device, s.auto_max_comm_s)
    if name == "allreduce":
        strategy: SyncStrategy = AllReduceSync(
            bucket_mb=cfg.parallel.bucket_mb, compress=s.compress, powersgd_rank=s.powersgd_rank,
            powersgd_start_step=s.powersgd_start_step, reducer=reducer(cfg, mesh))
    elif name == "diloco":
        strategy = DiLoCoSync(inner_steps=s.inner_steps, total_steps=cfg.run.steps,
                              outer_lr=s.outer_lr, outer_momentum=s.outer_momentum,
                              outer_nesterov=s.outer_nesterov, compress=s.outer_compress,
                              warmup_steps=s.sync_warmup_steps)
    else:
        strategy = LocalSGDSync(inner_steps=s.inner_steps, total_steps=cfg.run.steps,
                                compress=s.outer_compress, warmup_steps=s.sync_warmup_steps)
    return strategy, note or f"sync: {strategy.describe()}"


def reducer(cfg: Config, mesh: Mesh) -> str:
    """What reconciles the gradients every step under the layout parallelize() applies (see
    parallel/parallelize.py): DDP, FSDP2 (ZeRO-2/3, hybrid over dp_replicate) or, for pipeline
    stages, composable replicate; nothing when there is one data-parallel replica."""
    zero = cfg.parallel.zero
    if mesh.dp_size == 1:
        return "no data-parallel peers (one replica)"
    if zero >= 2:
        hsdp = " + all-reduce across dp_replicate (HSDP)" if mesh.size("dp_replicate") > 1 else ""
        return f"FSDP reduce-scatter{hsdp} every step (ZeRO-{zero})"
    how = "replicate all-reduce" if mesh.size("pp") > 1 else "DDP all-reduce"
    return f"{how} every step" + (" (ZeRO-1: optimizer state sharded)" if zero == 1 else "")


__all__ = ["AllReduceSync", "DiLoCoSync", "LocalSGDSync", "SyncBuilder", "SyncStrategy", "build_sync",
           "STRATEGIES"]

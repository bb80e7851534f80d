"""How workers reconcile their updates. One module per strategy; the loop sees only this API."""

from __future__ import annotations

import torch.nn as nn

from allhands.config import Config
from allhands.mesh import Mesh
from allhands.sync.allreduce import AllReduceSync
from allhands.sync.auto import choose
from allhands.sync.base import SyncStrategy
from allhands.sync.diloco import DiLoCoSync, LocalSGDSync, replicate_group
from allhands.sync.ps import PSSync
from allhands.sync.ps_wire import ps_roles

STRATEGIES = {"allreduce": AllReduceSync, "diloco": DiLoCoSync, "local_sgd": LocalSGDSync,
              "ps": PSSync}


def build_sync(cfg: Config, mesh: Mesh, model: nn.Module) -> tuple[SyncStrategy, str]:
    """The strategy ``parallel.sync`` names (``auto`` measured here), and a line for the log."""
    s, name, note = cfg.sync, cfg.parallel.sync, ""
    if name == "auto":
        name, note = choose(model, replicate_group(mesh), mesh.device, s.auto_max_comm_s)
    if name == "allreduce":
        strategy: SyncStrategy = AllReduceSync(
            bucket_mb=cfg.parallel.bucket_mb, compress=s.compress, powersgd_rank=s.powersgd_rank,
            powersgd_start_step=s.powersgd_start_step, reducer=reducer(cfg, mesh))
    elif name == "ps":  # this rank is a worker (servers never build a strategy: worker.py)
        roles = ps_roles(cfg.ps.servers, mesh.rank, mesh.world_size + cfg.ps.servers,
                         cfg.parallel.timeout_s)
        strategy = PSSync(cfg.ps, roles, total_steps=cfg.run.steps, timeout_s=cfg.parallel.timeout_s)
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


__all__ = ["AllReduceSync", "DiLoCoSync", "LocalSGDSync", "PSSync", "SyncStrategy", "build_sync", "STRATEGIES"]

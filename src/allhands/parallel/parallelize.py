"""The one place that decides the order in which strategies cut a model.

Order (torchtitan's ``parallelize_llama``): tensor parallel -> activation checkpointing ->
data parallel (FSDP2 for ZeRO-2/3 and hybrid sharding, else DDP). TP first because it replaces
parameters with DTensors on the ``tp`` mesh that FSDP then shards again over ``dp_shard``; AC
before FSDP so that FSDP's all-gather hooks wrap the checkpointed block and are re-run on
recompute; DDP last because it must see the final parameters. The pipeline split (issue 3, pp)
happens before all of them, on the stage's module.
"""

from __future__ import annotations

import torch.nn as nn

from allhands.mesh import Mesh
from allhands.parallel.ddp import apply_ddp
from allhands.parallel.tensor import PlanFn, TPPlan, apply_tp


def parallelize(model: nn.Module, mesh: Mesh, *, bucket_mb: float = 25.0,
                replicate: bool = True, sequence_parallel: bool = True,
                tp_plan: TPPlan | PlanFn | None = None) -> nn.Module:
    """Apply every configured strategy to ``model`` (already on ``mesh.device``) in order.

    ``replicate``: reconcile the data-parallel replicas every step here (DDP's all-reduce).
    A sync strategy that reconciles replicas itself (DiLoCo) passes False.
    ``tp_plan``: the tensor-parallel plan when the model has no ``tp_plan`` method of its own.
    Under pipeline parallelism ``model`` is one stage's module.
    """
    if mesh.size("tp") > 1:
        apply_tp(model, mesh.get("tp"), sequence_parallel=sequence_parallel, plan=tp_plan)
    if replicate and mesh.dp_size > 1:
        model = apply_ddp(model, mesh, bucket_mb=bucket_mb)
    return model

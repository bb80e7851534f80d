"""The one place that decides the order in which strategies cut a model.

Order (torchtitan's ``parallelize_llama``): tensor parallel -> activation checkpointing ->
``torch.compile`` per block -> data parallel (FSDP2 for ZeRO-2/3 and hybrid sharding, else
DDP). TP first because it replaces
parameters with DTensors on the ``tp`` mesh that FSDP then shards again over ``dp_shard``; AC
before FSDP so that each FSDP unit is a checkpointed block and its all-gather runs again on
recompute; DDP last because it must see the final parameters. The pipeline split (pp) happens
before all of them, on each stage's module. ZeRO-1 is an optimizer wrapper
(``parallel/zero1.py``), applied by ``layout.py`` after the optimizer exists.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands.mesh import Mesh
from allhands.parallel.ac import apply_ac
from allhands.parallel.ddp import apply_ddp, apply_replicate
from allhands.parallel.expert import apply_ep, ddp_ignored, expert_params, shard_experts
from allhands.parallel.fsdp import apply_fsdp
from allhands.parallel.tensor import PlanFn, TPPlan, apply_tp


def transformer_blocks(model: nn.Module) -> nn.ModuleList | nn.ModuleDict | None:
    """The repeated blocks of a model: its first ``nn.ModuleList`` or ``nn.ModuleDict`` in
    module order (GPT.blocks, a Hugging Face ``layers``/``h``). They are the units of activation
    checkpointing and of FSDP's all-gathers; a model without one is checkpointed/sharded as a
    whole. A pipeline stage holds the subset of entries of its stage, under their original keys."""
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0:
            return module
    return None


def parallelize(model: nn.Module, mesh: Mesh, *, zero: int = 0, ac: str = "none",
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                bucket_mb: float = 25.0, replicate: bool = True, sequence_parallel: bool = True,
                tp_plan: TPPlan | PlanFn | None = None, loss_parallel: bool = False,
                pipeline_stage: bool = False, compile: bool = False, compile_backend: str = "inductor",
                materialize: Callable[[nn.Module], Any] | None = None) -> nn.Module:
    """Apply every configured strategy to ``model`` (already on ``mesh.device``) in order and
    return the module the loop runs forward/backward on.

    ``zero``: 0/1 replicate parameters and gradients (DDP); 2/3 shard them with FSDP2 over
    ``dp_shard`` (see fsdp.py). ``param_dtype``/``reduce_dtype``: FSDP2's mixed-precision policy
    (zero 2/3 only; replicated layouts use autocast). ``replicate``: reconcile the data-parallel
    replicas every step here (DDP's all-reduce, FSDP's hybrid all-reduce); a sync strategy that
    reconciles replicas itself (DiLoCo) passes False and only dp_shard is covered here.
    ``sequence_parallel``/``tp_plan``: tensor parallelism over ``tp`` (see tensor.py; the plan
    defaults to the model's ``tp_plan`` method); ``loss_parallel``: a shipped family's head hands
    the loss vocabulary-sharded logits. ``pipeline_stage``: ``model`` is one pipeline
    stage, replicated with composable ``replicate`` instead of DDP (see ddp.py). ``compile``:
    ``torch.compile`` each block in place (run.compile) with ``compile_backend``. ``materialize(model)``: allocates and
    fills a model built on the meta device (or fills a real one in place) once it is cut: after
    FSDP has sharded it, so a rank allocates its shards only; before DDP, whose construction
    broadcasts rank 0's weights and keeps views of them.
    """
    fill = materialize or (lambda m: m)
    if mesh.size("tp") > 1:
        apply_tp(model, mesh.get("tp"), sequence_parallel=sequence_parallel, plan=tp_plan,
                 loss_parallel=loss_parallel)
    if mesh.size("ep") > 1:  # after TP, before AC and FSDP, as torchtitan's parallelize_deepseekv3
        apply_ep(model, mesh)
    blocks = transformer_blocks(model)
    if ac != "none":
        if blocks is None:
            raise ValueError("parallel.ac needs a model with an nn.ModuleList of blocks")
        apply_ac(model, blocks=blocks, mode=ac)
    if compile:
        if blocks is None:
            raise ValueError("run.compile needs a model with an nn.ModuleList of blocks")
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
            # In place (nn.Module.compile), so parameter FQNs and checkpoints do not change;
            # torchtitan compiles each block the same way, between AC and FSDP: a block's graph
            # then holds its checkpointed region and FSDP's hooks stay outside it.
            block.compile(backend=compile_backend)
    if zero >= 2:
        units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or ())
        if mesh.size("ep") > 1:  # experts first: a unit of their own over edp
            shard_experts(model, mesh, reshard_after_forward=zero == 3,
                          mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                         reduce_dtype=reduce_dtype))
        apply_fsdp(model, mesh, blocks=units, reshard_after_forward=zero == 3,
                   hybrid=replicate, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        fill(model)
        return model
    fill(model)
    over = mesh.grad_dim(replicate)  # dp (or dp_shard), with the cp ranks under context parallel
    if mesh.size(over) > 1:
        if pipeline_stage:
            return apply_replicate(model, mesh, over=over, ignored=expert_params(model))
        DDP._set_params_and_buffers_to_ignore_for_model(model, ddp_ignored(model))
        return apply_ddp(model, mesh, bucket_mb=bucket_mb, over=over)
    return model


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm over plain tensors and DTensors (FSDP shards, TP).

    torch's clip_grad_norm_ handles DTensor gradients (torch 2.13: the per-shard partial norms
    are reduced over the shard group, checked against the single-process reference by the
    parity tests) and returns the norm as a replicated DTensor; this returns a plain tensor so
    the loop can log it. ``max_norm`` 0 or inf only measures.
    """
    total = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm if max_norm else math.inf)
    return total.full_tensor() if isinstance(total, DTensor) else total

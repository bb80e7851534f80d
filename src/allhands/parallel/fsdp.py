"""Sharded data parallelism (ZeRO-2 and ZeRO-3, plain or hybrid) on FSDP2 ``fully_shard``.

ZeRO stages (Rajbhandari et al. 2020) map onto FSDP2 like this:

- stage 3 (parameters, gradients and optimizer state sharded): ``reshard_after_forward=True``.
  Each block's parameters are all-gathered before its forward, freed after it, all-gathered again
  for its backward; gradients are reduce-scattered, so every rank keeps 1/N of each.
- stage 2 (gradients and optimizer state sharded): ``reshard_after_forward=False``. The full
  parameters gathered in forward stay until backward, so there is one all-gather per step, not
  two. Unlike the paper's stage 2, FSDP2 frees them again after backward: between steps a rank
  holds only its parameter shard (stage 3's at-rest memory), and within a step all blocks' full
  parameters are live from the end of forward to their backward (the paper's 4*Psi term).
- hybrid sharding (HSDP): a 2-D mesh ``(dp_replicate, dp_shard)``; shards inside a dp_shard
  group, all-reduces the shards across dp_replicate groups.

Each block is its own FSDP unit (one all-gather per block, so only one block's full parameters
are live at a time under stage 3), then the root takes what is left (embeddings, final norm,
the tied head).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from allhands.mesh import Mesh


def apply_fsdp(model: nn.Module, mesh: Mesh, *, blocks: list[nn.Module], reshard_after_forward: bool,
               hybrid: bool = True, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` in place over ``dp_shard`` (with the cp ranks under context parallelism:
    they hold the same parameters) (and replicate over ``dp_replicate`` when
    ``hybrid`` and that dim is > 1); returns the same module, now an ``FSDPModule``.

    ``param_dtype``/``reduce_dtype``: FSDP2's MixedPrecisionPolicy. The sharded parameters and
    the optimizer state stay fp32; forward/backward run in ``param_dtype`` and gradients are
    reduced in ``reduce_dtype`` (fp32 keeps the sum of N bf16 gradients from losing bits).
    """
    shard = mesh.grad_dim(replicate=False)  # dp_shard, or dp_shard x cp under context parallel
    if hybrid and mesh.size("dp_replicate") > 1:
        dmesh = mesh.submesh("dp_replicate", shard)
    else:
        dmesh = mesh.submesh(shard)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # The root follows the stage too (an explicit bool turns off FSDP2's keep-the-root-unsharded
    # heuristic): under ZeRO-3 the embedding/tied head is gathered again for backward, which
    # costs one all-gather of it per step and keeps the stage's memory at 16 Psi / N.
    fully_shard(model, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)

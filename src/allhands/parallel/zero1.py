"""ZeRO stage 1: optimizer state sharded, gradients and parameters replicated.

FSDP2 has no stage 1 (it always shards gradients with the optimizer state), so stage 1 is
torch's ``ZeroRedundancyOptimizer`` over DDP: DDP all-reduces full gradients as usual, each rank
of a ``dp_shard`` group steps only the parameters it owns (whole parameters, assigned greedily by
size, so the split is only as even as the parameter sizes allow) and then broadcasts them to the
others. Memory saved: the AdamW moments (8 bytes per parameter in fp32) drop to 1/N; parameters
and gradients stay 4 + 4 bytes each.

Checkpoints: ``ZeroRedundancyOptimizer.state_dict()`` consolidates the whole state onto one rank
as a pickled object, which DCP can neither shard nor reshard. ``optimizer_for_checkpoint``
instead hands DCP the rank's *local* optimizer; with flat optimizer keys
(``state.<fqn>.exp_avg``) each rank writes exactly the entries of the parameters it owns, under
the same keys a replicated or FSDP optimizer uses, so the layouts load each other's checkpoints.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from allhands.mesh import Mesh


def apply_zero1(optimizer: torch.optim.Optimizer, mesh: Mesh) -> ZeroRedundancyOptimizer:
    """Rebuild ``optimizer`` (same class, param groups and hyper-parameters, no state yet) as a
    ZeroRedundancyOptimizer sharding its state over ``dp_shard``."""
    if optimizer.state:
        raise ValueError("apply_zero1 needs a fresh optimizer (its state would be dropped)")
    cls = type(optimizer)
    # ZeRO builds the local optimizer as cls(params, **defaults); defaults may hold keys the
    # constructor does not take (AdamW's 'decoupled_weight_decay' in torch >= 2.8).
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k == "params" or k in accepted}
              for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=mesh.group("dp_shard"),
                                   parameters_as_bucket_view=False, **defaults)


def optimizer_for_checkpoint(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank checkpoints: ZeRO's local shard, else itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer

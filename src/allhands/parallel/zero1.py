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
from collections import OrderedDict

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
    """The optimizer whose state this rank checkpoints: a view of ZeRO's local shard (see
    ``_local_view``), else the optimizer itself."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    # ZeRO copies its global groups' hyper-parameters into the local optimizer only at the start
    # of step(), so after scheduler.step() the local learning rate is one step stale; a
    # replicated optimizer would save the new one. Copy it now, before DCP reads it.
    for glob, loc in zip(optimizer.param_groups, optimizer.optim.param_groups):
        loc.update({k: v for k, v in glob.items() if k != "params"})
    view = getattr(optimizer, "_allhands_checkpoint_view", None)
    if view is None:
        view = optimizer._allhands_checkpoint_view = _local_view(optimizer)
    return view


def _local_view(zero: ZeroRedundancyOptimizer) -> torch.optim.Optimizer:
    """ZeRO's local optimizer without its empty param groups, for DCP's state-dict helpers.

    Two things need fixing on the way: ZeRO gives a rank an empty group when the group has
    fewer parameters than ranks (e.g. the no-decay group of a model with few norms), and DCP's
    flat-key loader indexes the first parameter of every group (torch 2.13
    ``_unflatten_optim_state_dict``: IndexError); and ZeRO copies its own (global) groups'
    hyper-parameters into the local optimizer before every step, so a loaded learning rate
    must reach the global groups too or the first resumed step runs with the initial one.

    The view shares the local optimizer's group dicts, state dict and step(); after DCP loads
    into it, the state and hyper-parameters are copied back into the local and global groups.
    """
    local = zero.optim
    kept = [i for i, g in enumerate(local.param_groups) if g["params"]]
    groups = [local.param_groups[i] for i in kept]
    view = object.__new__(type(local))
    view.__dict__.update(local.__dict__)
    view.param_groups = groups
    view.state = local.state
    view._optimizer_load_state_dict_pre_hooks = OrderedDict()
    view._optimizer_load_state_dict_post_hooks = OrderedDict()

    def copy_back(loaded: torch.optim.Optimizer) -> None:
        # Optimizer.load_state_dict built new group dicts and a new state dict on the view.
        local.state.clear()
        local.state.update(loaded.state)
        for i, new in zip(kept, loaded.param_groups):
            hyper = {k: v for k, v in new.items() if k != "params"}
            local.param_groups[i].update(hyper)
            zero.param_groups[i].update(hyper)
        loaded.state, loaded.param_groups = local.state, groups

    view.register_load_state_dict_post_hook(copy_back)
    return view

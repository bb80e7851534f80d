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

Units, as torchtitan's ``apply_fsdp`` cuts them (``distributed/fsdp.py``): each block is one
(one all-gather per block, so under stage 3 only one block's full parameters are live at a
time); the input embeddings are one, resharded like the blocks; the final norm with the output
head is one that stays gathered from its forward to its backward under every stage, because
backward starts there at once and FSDP would gather it again right away; tied embeddings and
head are one unit (one parameter, one all-gather), kept gathered for the same reason. The root
takes what is left (a user's model without these names: its embeddings and head) and is not
resharded after forward either (FSDP2's own default for a root): backward ends in it.

Gradient accumulation (:func:`no_gradient_sync`): the micro-batches before the last one skip
the reduce-scatter (and HSDP's all-reduce), so a step reduces each unit once, not once per
micro-batch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from allhands.mesh import Mesh

# The children around the blocks that become units of their own (the shipped families' names:
# models/gpt.py, models/llama.py); a pipeline stage may lack some (None).
EMBEDDINGS = ("tok_emb", "pos_emb")
HEAD = ("ln_f", "norm", "lm_head")


def edge_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """``(modules, reshard_after_forward_allowed)`` for each unit outside the blocks: the
    embeddings (as the stage says), the final norm with the head (kept gathered), or both as
    one kept-gathered unit when they share a parameter (tied weights)."""
    def present(names: tuple[str, ...]) -> list[nn.Module]:
        found = (getattr(model, n, None) for n in names)
        return [m for m in found
                if isinstance(m, nn.Module) and next(m.parameters(), None) is not None]

    emb = present(EMBEDDINGS)
    head = present(HEAD) if present(("lm_head",)) else []  # a norm without a head: the root's

    def ids(modules: list[nn.Module]) -> set[int]:
        return {id(p) for m in modules for p in m.parameters()}

    if ids(emb) & ids(head):
        return [(emb + head, False)]
    return [(units, allowed) for units, allowed in ((emb, True), (head, False)) if units]


def apply_fsdp(model: nn.Module, mesh: Mesh, *, blocks: list[nn.Module], reshard_after_forward: bool,
               hybrid: bool = True, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` in place over ``dp_shard`` (with the cp ranks under context parallelism:
    they hold the same parameters) (and replicate over ``dp_replicate`` when
    ``hybrid`` and that dim is > 1); returns the same module, now an ``FSDPModule``.

    ``param_dtype``/``reduce_dtype``: FSDP2's MixedPrecisionPolicy. The sharded parameters and
    the optimizer state stay fp32; forward/backward run in ``param_dtype`` and gradients are
    reduced in ``reduce_dtype`` (fp32 keeps the sum of N bf16 gradients from losing bits).
    ``reshard_after_forward``: the stage's choice (True: ZeRO-3) for the blocks and embeddings;
    the head, a tied embedding and the root keep theirs until backward (module doc).
    """
    shard = mesh.grad_dim(replicate=False)  # dp_shard, or dp_shard x cp under context parallel
    if hybrid and mesh.size("dp_replicate") > 1:
        dmesh = mesh.submesh("dp_replicate", shard)
    else:
        dmesh = mesh.submesh(shard)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for modules, allowed in edge_units(model):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=dmesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward and allowed)
    for block in blocks:
        fully_shard(block, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # At rest (between steps) every unit is resharded all the same: FSDP2 reshards each after
    # its backward, so the stage's memory formula (16 Psi / N) holds for what is kept gathered.
    fully_shard(model, mesh=dmesh, reshard_after_forward=False, mp_policy=mp)
    return model


@contextlib.contextmanager
def no_gradient_sync(modules: list[nn.Module]) -> Iterator[None]:
    """Backward inside accumulates unreduced gradients in every FSDP unit of ``modules``: FSDP2's
    ``set_requires_gradient_sync(False)``, the equivalent of DDP's ``no_sync`` (torch's
    docs for it: gradient accumulation without communication). The next backward outside it
    reduce-scatters the sum of all. The cost: each rank holds its units' whole (unsharded)
    gradients, in ``reduce_dtype``, from the first micro-batch to the last one's backward."""
    roots = [m for m in modules if isinstance(m, FSDPModule)]
    for m in roots:
        m.set_requires_gradient_sync(False)  # recursive: blocks, edge units, expert units
    try:
        yield
    finally:
        for m in roots:
            m.set_requires_gradient_sync(True)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)

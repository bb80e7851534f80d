"""Activation checkpointing: trade recomputation for activation memory, per block.

- ``block``: each block keeps only its input; its whole forward is recomputed in backward
  (Chen et al. 2016). Activation memory per block drops from all intermediates to ``(B, T, C)``.
- ``selective``: each block keeps the outputs of matmuls and attention and recomputes the cheap
  element-wise ops (norms, GELU, dropout, residual adds) in backward, the trade torchtitan's
  "selective op" policy makes; in the spirit of Korthikanti et al. 2022, who recompute what is
  memory-heavy but cheap. Saves less memory than ``block``, costs far less recompute.

Both use torch's non-reentrant checkpoint (``checkpoint_wrapper``), which restores the RNG state
before recomputing, so dropout masks in the recomputed forward equal the original ones.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Compute-heavy ops whose outputs selective AC keeps (names vary by device and torch version).
_SAVE_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu")
_SAVE = {getattr(_aten, n).default for n in _SAVE_NAMES if hasattr(_aten, n)}


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, *, blocks: nn.ModuleList | nn.ModuleDict, mode: str) -> nn.Module:
    """Wrap each module of ``blocks`` (a ModuleList or ModuleDict inside ``model``) in place; ``mode`` is
    none, block or selective. Parameter names gain a ``_checkpoint_wrapped_module`` segment that
    DCP's state-dict helpers remove, so checkpoints stay layout independent."""
    if mode == "none":
        return model
    if mode not in ("block", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}; expected none, block or selective")
    for key, block in list(blocks.named_children()):  # ModuleList "0".. or ModuleDict keys
        if mode == "block":
            setattr(blocks, key, checkpoint_wrapper(block, preserve_rng_state=True))
        else:
            setattr(blocks, key, checkpoint_wrapper(
                block, preserve_rng_state=True,
                context_fn=partial(create_selective_checkpoint_contexts, _selective_policy)))
    return model

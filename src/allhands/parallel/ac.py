"""Activation checkpointing: trade recomputation for activation memory, per block.

- ``block``: each block keeps only its input; its whole forward is recomputed in backward
  (Chen et al. 2016). Activation memory per block drops from all intermediates to ``(B, T, C)``.
- ``selective``: torchtitan's op-level policy (``_apply_op_sac`` and its ``_save_list``, now
  ``SelectiveAC`` in torchtitan/distributed/activation_checkpoint.py). Inside a block's forward
  it keeps the output of every other linear-layer matmul (the 1st, 3rd, ...; the others are
  recomputed), every attention output, the outputs of collectives (so backward does not talk to
  other ranks twice), ``max`` (the scale of low-precision recipes) and the routing ``topk``; it
  recomputes the cheap element-wise ops (norms, SiLU, residual adds, RoPE). Korthikanti et
  al. 2022 make the same trade: recompute what is memory-heavy but cheap. MoE expert GEMMs
  (``_grouped_mm``, the padded path's ``bmm``) are always kept: recomputing them repeats the
  largest matmuls of an MoE block.

Both use torch's non-reentrant checkpoint (``checkpoint_wrapper``), which restores the RNG state
before recomputing, so dropout masks in the recomputed forward equal the original ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._higher_order_ops  # flex_attention and inductor_compiled_code, looked up below
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(root, *names: str) -> set:
    """The ops ``root.<name>`` this torch build has; names vary by device backend and version."""
    found = set()
    for name in names:
        obj = root
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        found.add(obj)
    return found


# The matmuls of linear layers, counted per block forward: every other one is kept. ``linear``
# reaches dispatch as one op on backends that register it as a leaf (torchtitan handles both);
# ``addmm`` is a linear with a bias (Qwen2's q, k, v), counted like ``mm``.
MM_OPS = frozenset(_ops(torch.ops.aten, "mm.default", "addmm.default", "linear.default"))

SAVE_OPS = frozenset(
    # attention: SDPA's kernels (CUDA flash / memory-efficient / cuDNN, CPU flash, math) and
    # FlexAttention, eager (its higher-order op) or compiled (inductor_compiled_code, visible
    # because models/layers.py compiles it with wrap_inductor_compiled_regions)
    _ops(torch.ops.aten, "_scaled_dot_product_flash_attention.default",
         "_scaled_dot_product_efficient_attention.default",
         "_scaled_dot_product_cudnn_attention.default",
         "_scaled_dot_product_flash_attention_for_cpu.default",
         "_scaled_dot_product_attention_math.default",
         "_scaled_dot_product_fused_attention_overrideable.default",
         # low-precision recipes compute their scale from the absolute maximum (torchtitan)
         "max.default",
         # routing: recomputing topk could pick other experts on ties (torchtitan)
         "topk.default",
         # MoE experts: the grouped GEMM and the padded fallback's batched GEMM (models/moe.py)
         "_grouped_mm.default", "bmm.default")
    | _ops(torch._higher_order_ops, "flex_attention", "inductor_compiled_code")
    # collectives: recomputing them would repeat the exchange in backward
    | _ops(torch.ops._c10d_functional, "reduce_scatter_tensor.default",
           "all_to_all_single.default"))


def _device_to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator to the CPU (e.g. MoE split sizes): kept, as torchtitan does,
    so the recompute does not add a host sync."""
    return (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu" and str(kwargs.get("device", "")) == "cpu")


def op_sac_policy() -> Callable[..., CheckpointPolicy]:
    """The policy of one block's forward and its recompute. Each counts its own matmuls, so the
    recompute keeps and recomputes the same ones the forward did; a fresh policy per forward
    (``context_fn`` runs once per call) starts both counts at zero."""
    count = {False: 0, True: 0}  # ctx.is_recompute -> matmuls seen

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MM_OPS:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if func in SAVE_OPS or _device_to_host(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_contexts():
    return create_selective_checkpoint_contexts(op_sac_policy())


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
            setattr(blocks, key, checkpoint_wrapper(block, preserve_rng_state=True,
                                                    context_fn=_op_sac_contexts))
    return model

"""Selective activation checkpointing (parallel/ac.py): torchtitan's op-level policy keeps every
other matmul, attention, collectives and the MoE expert GEMMs; gradients equal those without
checkpointing; and the activation memory one forward leaves for backward orders
none > selective > block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from allhands.models.llama import Llama, LlamaConfig
from allhands.models.moe import MoEArgs
from allhands.parallel.ac import SAVE_OPS, apply_ac, op_sac_policy

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
FWD, RE = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)


def test_every_other_matmul_is_kept_and_the_recompute_agrees():
    policy = op_sac_policy()
    fwd = [policy(FWD, op) for op in (aten.mm.default, aten.add.Tensor, aten.mm.default,
                                      aten.addmm.default, aten.mm.default)]
    assert fwd == [SAVE, RECOMPUTE, RECOMPUTE, SAVE, RECOMPUTE]
    # the recompute counts on its own, so it makes the same choices in the same order
    assert [policy(RE, aten.mm.default) for _ in range(4)] == [SAVE, RECOMPUTE, SAVE, RECOMPUTE]
    assert policy(FWD, aten.mm.default) == SAVE  # the forward's own count goes on: its 5th
    assert op_sac_policy()(FWD, aten.mm.default) == SAVE  # a fresh policy per forward


def test_attention_collectives_max_and_expert_gemms_are_kept():
    policy = op_sac_policy()
    kept = [aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.higher_order.flex_attention,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default,
            aten.max.default, aten.topk.default, aten.bmm.default]
    if hasattr(aten, "_grouped_mm"):
        kept.append(aten._grouped_mm.default)
    assert all(op in SAVE_OPS for op in kept)
    assert all(policy(FWD, op) == SAVE for op in kept)
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.silu.default, aten._softmax.default,
               aten.rsqrt.default):
        assert policy(FWD, op) == RECOMPUTE


def _model(moe: bool = False) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             seq_len=64, doc_token=9,
                             moe=MoEArgs(n_experts=4, top_k=2, hidden=32) if moe else MoEArgs()))


def _grads(mode: str, moe: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(moe)
    apply_ac(model, blocks=model.blocks, mode=mode)
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = model(idx).float().logsumexp(-1).mean()
    loss.backward()
    names = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), names


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gradients_equal_those_without_checkpointing(moe):
    loss, want = _grads("none", moe)
    for mode in ("selective", "block"):
        got_loss, got = _grads(mode, moe)
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


class _LiveActivations(TorchDispatchMode):
    """Records the storage of every op output; after the forward, the bytes of those still alive
    are what the autograd graph (and selective checkpointing's cache) keeps for backward."""

    def __init__(self):
        super().__init__()
        self.outputs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                self.outputs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(n for ptr, (ref, n) in self.outputs.items()
                   if not ref.expired() and ptr not in exclude)


def activation_bytes(mode: str, moe: bool = False) -> int:
    """Bytes one training forward of a small Llama leaves alive for backward under ``mode``
    (parameters, the input and the logits themselves not counted)."""
    model = _model(moe)
    apply_ac(model, blocks=model.blocks, mode=mode)
    idx = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    with _LiveActivations() as live:
        logits = model(idx)
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(),
                                                        idx, logits)}
    return live.live_bytes(exclude)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_memory_orders_none_selective_block(moe):
    held = {mode: activation_bytes(mode, moe) for mode in ("none", "selective", "block")}
    print(f"activation bytes after one forward ({'moe' if moe else 'dense'}): {held}")
    assert held["none"] > held["selective"] > held["block"] > 0

"""The MoE feed-forward (models/moe.py): grouped GEMMs against one expert at a time, dropless
routing under any imbalance, the auxiliary loss reaching the gradient, and the bias update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from allhands.config import Config, ConfigError, validate
from allhands.job import build_reference_model
from allhands.models.llama import Llama, LlamaConfig
from allhands.models.moe import (GroupedExperts, MoE, MoEArgs, grouped_mm, moe_layers,
                                 padded_mm, update_expert_bias)


def _experts(n=4, dim=16, hidden=24, seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(n, dim, hidden)
    ex.reset_parameters(0.3, 0.3)
    return ex


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [10, 0, 0, 0], [0, 0, 0, 7], [1, 1, 1, 1]])
def test_grouped_gemm_equals_one_expert_at_a_time(counts):
    ex = _experts()
    c = torch.tensor(counts)
    x = torch.randn(int(c.sum()), 16, requires_grad=True)
    got = ex(x, c)
    ref = ex.reference(x, c)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # and their gradients, into the inputs and every expert's weights
    g1 = torch.autograd.grad(got.square().sum(), [x, *ex.parameters()])
    g2 = torch.autograd.grad(ref.square().sum(), [x, *ex.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_grouped_mm_entry_point_matches_padded_on_cpu():
    w = torch.randn(3, 8, 16)
    c = torch.tensor([2, 0, 4])
    x = torch.randn(6, 16)
    torch.testing.assert_close(grouped_mm(x, w, c), padded_mm(x, w, c))
    torch.testing.assert_close(padded_mm(x, w, c)[:2], x[:2] @ w[0].T)


def _moe(**kw):
    torch.manual_seed(1)
    a = MoEArgs(**{"n_experts": 4, "top_k": 2, "hidden": 24, **kw})
    m = MoE(16, 32, a)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def _dense_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through every one of its k experts, token by token."""
    flat = x.reshape(-1, x.shape[-1])
    w, idx, _ = m.router(flat)
    g, u, d = m.experts.local_weights()
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.silu(flat[t] @ g[e].T) * (flat[t] @ u[e].T)
            out[t] += w[t, j] * (h @ d[e].T)
    if m.shared is not None:
        s = m.shared(flat)
        out = out + (torch.sigmoid(m.shared_gate(flat)) * s if m.shared_gate is not None else s)
    return out.view_as(x)


@pytest.mark.parametrize("kw", [{}, {"score": "sigmoid", "n_shared": 1},
                                {"norm_topk": False, "shared_hidden": 20, "shared_gate": True}])
def test_moe_layer_equals_token_by_token_reference(kw):
    m = _moe(balance="none", **kw).eval()
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x), _dense_reference(m, x), rtol=1e-5, atol=1e-6)


def test_uneven_routing_all_tokens_to_one_expert():
    m = _moe(top_k=1, balance="bias")
    with torch.no_grad():
        m.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))  # everyone picks 2
    x = torch.randn(3, 7, 16, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, _dense_reference(m, x), rtol=1e-5, atol=1e-6)
    assert m.load.tolist() == [0, 0, 21, 0]  # dropless: all 21 tokens computed
    y.sum().backward()
    assert m.experts.gate_proj.grad[2].abs().sum() > 0
    assert m.experts.gate_proj.grad[[0, 1, 3]].abs().sum() == 0
    update_expert_bias(m)  # the overloaded expert's bias goes down, the idle ones' up
    assert m.router.expert_bias.tolist() == pytest.approx([1e-3, 1e-3, 100 - 1e-3, 1e-3])
    assert m.load.sum() == 0


def test_aux_loss_reaches_the_gradient_as_if_added_to_the_loss():
    m = _moe(balance="aux", aux_coef=0.5)
    x = torch.randn(2, 6, 16)
    m.aux_scale = 0.25
    (m(x).sum() * 0.25).backward()
    got = [p.grad.clone() for p in m.parameters()]
    aux = m.last_aux
    m.zero_grad()
    # the same objective written out: 0.25 * (sum(out) + aux)
    m2 = _moe(balance="none")
    m2.load_state_dict(m.state_dict())
    flat = x.reshape(-1, 16)
    w, idx, scores = m2.router(flat)
    counts = torch.bincount(idx.reshape(-1), minlength=4).float()
    aux2 = 0.5 * 4 * (counts / idx.numel() * scores.mean(0)).sum()
    torch.testing.assert_close(aux2.detach(), aux)
    ((m2(x).sum() + aux2) * 0.25).backward()
    for a, p in zip(got, m2.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
    assert got[0].abs().sum() > 0  # the router learns from both


def test_llama_with_moe_layers_builds_trains_and_checks():
    a = MoEArgs(n_experts=4, top_k=2, hidden=32, every=2)
    model = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=4, n_heads=4, seq_len=16, moe=a))
    assert [type(b.mlp).__name__ for b in model.blocks.values()] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    assert len(moe_layers(model)) == 2
    idx = torch.randint(0, 50, (2, 16))
    model(idx).float().logsumexp(-1).mean().backward()
    assert model.blocks["1"].mlp.experts.down_proj.grad.abs().sum() > 0
    cfg = Config()
    cfg.model.family = "llama"
    cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.ffn_hidden = 4, 2, 32
    m = build_reference_model(cfg, 50)
    assert len(moe_layers(m)) == cfg.model.n_layer
    cfg.moe.top_k = 5
    with pytest.raises(ConfigError, match="moe.top_k"):
        validate(cfg, need_data=False)
    cfg.moe.top_k, cfg.model.family = 2, "gpt"
    with pytest.raises(ConfigError, match="moe.n_experts"):
        validate(cfg, need_data=False)


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_counts_each_routed_pair_once(mode):
    """The recompute in backward repeats the MoE forward: its pairs are not counted again, so the
    logged tokens per expert and the balancing bias's load are per real forward."""
    from allhands.parallel.ac import apply_ac

    a = MoEArgs(n_experts=4, top_k=2, hidden=32, balance="bias")
    model = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, seq_len=16, moe=a))
    apply_ac(model, blocks=model.blocks, mode=mode)
    idx = torch.randint(0, 50, (3, 16))
    model(idx).float().logsumexp(-1).mean().backward()
    for m in moe_layers(model):
        assert int(m.tokens.sum()) == int(m.load.sum()) == 3 * 16 * 2
        assert m.experts.down_proj.grad.abs().sum() > 0

"""The MoE feed-forward (models/moe.py): grouped GEMMs against one expert at a time, the router's
scores, choice and weights and the balancing bias's update against hand computations, dropless
routing under any imbalance, and the auxiliary loss reaching the gradient."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("counts", [[2, 0, 4], [0, 5, 0], [1, 0, 0, 3, 2], [0, 0, 0]])
def test_grouped_mm_and_padded_mm_equal_a_loop_over_groups(counts):
    """Both entry points against rows ``x[rows of g] @ w[g].T`` one group at a time, with groups
    of no rows among uneven ones (on CPU grouped_mm takes padded_mm: both are checked anyway)."""
    g = len(counts)
    w = torch.randn(g, 8, 16)
    c = torch.tensor(counts)
    x = torch.randn(sum(counts), 16)
    want, start = torch.zeros(sum(counts), 8), 0
    for e, n in enumerate(counts):
        want[start:start + n] = x[start:start + n] @ w[e].T
        start += n
    for mm in (grouped_mm, padded_mm):
        got = mm(x, w, c)
        assert got.shape == (sum(counts), 8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _moe(**kw):
    torch.manual_seed(1)
    a = MoEArgs(**{"n_experts": 4, "top_k": 2, "hidden": 24, **kw})
    m = MoE(16, 32, a)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("score,norm_topk,balance", [("sigmoid", True, "bias"), ("sigmoid", False, "none"),
                                                    ("softmax", True, "none"), ("softmax", False, "bias")])
def test_router_scores_choice_and_weights_by_hand(score, norm_topk, balance):
    """From the gate's weight W alone: scores sigmoid(x W^T) (DeepSeek-V3) or softmax(x W^T); the
    k experts of a token are the k largest of score + balancing bias (bias only for choosing),
    largest first; their weights are the raw scores, divided by their sum under norm_topk."""
    m = _moe(score=score, norm_topk=norm_topk, balance=balance)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.25])
    with torch.no_grad():
        m.router.expert_bias.copy_(bias)
    x = torch.randn(40, 16)
    with torch.no_grad():
        weights, idx, scores = m.router(x)
    W = m.router.gate.weight.detach().double()
    want_scores = []
    rebiased = 0
    for t in range(x.shape[0]):
        logits = [float(sum(x[t, i].double() * W[e, i] for i in range(16))) for e in range(4)]
        if score == "sigmoid":
            s = [1 / (1 + math.exp(-z)) for z in logits]
        else:
            s = [math.exp(z) / sum(math.exp(v) for v in logits) for z in logits]
        want_scores.append(s)
        choose = [s[e] + (float(bias[e]) if balance == "bias" else 0.0) for e in range(4)]
        chosen = sorted(range(4), key=lambda e: -choose[e])[:2]
        assert idx[t].tolist() == chosen, t
        rebiased += chosen != sorted(range(4), key=lambda e: -s[e])[:2]
        w = [s[e] for e in chosen]
        if norm_topk:
            w = [v / sum(w) for v in w]
        assert weights[t].tolist() == pytest.approx(w, rel=1e-5, abs=1e-6), t
    torch.testing.assert_close(scores.double(), torch.tensor(want_scores, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert (rebiased > 0) == (balance == "bias")  # the bias really steered some choices


def test_bias_update_is_rate_times_sign_of_mean_load_minus_load():
    """DeepSeek-V3's auxiliary-loss-free step from known loads, per layer: an expert above its
    layer's mean load loses bias_rate, one below gains it, one at the mean keeps its bias; the
    loads restart from zero; a layer balanced otherwise is left alone."""
    layers = torch.nn.ModuleList([_moe(balance="bias", bias_rate=0.05),
                                  _moe(balance="bias", bias_rate=0.25), _moe(balance="aux")])
    start = [[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    loads = [[5, 1, 3, 3], [0, 0, 12, 0], [9, 0, 0, 3]]  # means 3, 3 and 3
    with torch.no_grad():
        for m, b, n in zip(layers, start, loads):
            m.router.expert_bias.copy_(torch.tensor(b))
            m.load.copy_(torch.tensor(n))
    update_expert_bias(layers)
    assert layers[0].router.expert_bias.tolist() == pytest.approx([0.05, -0.15, 0.0, 0.3])
    assert layers[1].router.expert_bias.tolist() == pytest.approx([0.25, 0.25, 0.75, 0.25])
    assert layers[2].router.expert_bias.tolist() == [0.0] * 4
    assert layers[0].load.tolist() == layers[1].load.tolist() == [0] * 4
    assert layers[2].load.tolist() == [9, 0, 0, 3]


def _dense_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through every one of its k experts, token by token; the routing is the
    router's own (test_router_scores_choice_and_weights_by_hand checks it by hand)."""
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
    logged tokens per expert and the balancing bias's load are per real forward. (With the
    auxiliary loss and a shared expert the recompute runs past the counting: torch stops it early
    only once every saved tensor is back.)"""
    from allhands.parallel.ac import apply_ac

    a = MoEArgs(n_experts=4, top_k=2, hidden=32, balance="aux", n_shared=1)
    model = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, seq_len=16, moe=a))
    apply_ac(model, blocks=model.blocks, mode=mode)
    idx = torch.randint(0, 50, (3, 16))
    model(idx).float().logsumexp(-1).mean().backward()
    for m in moe_layers(model):
        assert int(m.tokens.sum()) == int(m.load.sum()) == 3 * 16 * 2
        assert m.experts.down_proj.grad.abs().sum() > 0

"""The planner prices a mixture of experts: total and active parameters against the published
models and the built module, FLOPs against torch's counter on the per-expert reference, the
routed experts' state split by ep, the all_to_all it adds, and layouts ranked with ``ep``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from allhands.config import Config, apply_override, validate
from allhands.errors import ConfigError
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from allhands.job import build_reference_model, lm_loss
from allhands.models.build import moe_preset, with_preset
from allhands.models.moe import GroupedExperts
from allhands.models.presets import PUBLISHED_ACTIVE
from allhands.plan import Layout, estimate, parse_cluster, plan
from allhands.plan.decoder import Decoder, flops_per_sample
from allhands.plan.estimate import _bw
from allhands.plan.experts import a2a_bytes
from allhands.plan.search import layouts, with_layout

from conftest import cli

TINY = ["model.family=llama", "model.n_embd=32", "model.n_layer=3", "model.n_head=4", "model.n_kv_head=2",
        "model.ffn_hidden=48", "model.seq_len=16", "model.vocab_size=64", "moe.n_experts=4", "moe.top_k=2",
        "moe.ffn_hidden=24"]
SHAPES = {
    "mixtral": [],
    "shared-gated-every-2": ["moe.n_shared_experts=1", "moe.shared_gate=true", "moe.every=2"],
    "qwen3-first-dense": ["model.qk_norm=true", "model.head_dim=16", "moe.first_dense=1",
                          "moe.shared_ffn_hidden=40", "moe.top_k=3"],
}


def _cfg(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    cfg.moe, cfg.model = moe_preset(cfg.model, cfg.moe), with_preset(cfg.model)
    return cfg


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_parameters_are_the_model_cards(name):
    d = Decoder.of(*(lambda c: (c.model, c.moe))(_cfg(f"model.preset={name}")))
    assert d.active_params() == pytest.approx(PUBLISHED_ACTIVE[name], rel=0.02)
    assert d.active_params() < d.params() / 3


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_planned_parameters_are_the_built_models(shape):
    cfg = _cfg(*TINY, *SHAPES[shape])
    model, d = build_reference_model(cfg, 64), Decoder.of(cfg.model, cfg.moe)
    assert d.params() == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    assert routed == len(d.moe_layers) * d.expert_params() > 0
    idle = routed * (d.n_experts - d.top_k) / d.n_experts  # the experts a token skips
    assert d.active_params() == d.params() - idle


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_formula_is_what_torch_counts_on_the_per_expert_reference(shape, monkeypatch):
    """One expert at a time (the oracle of the grouped GEMM), each token's k rows are k x 3
    matmuls of an expert's width: FLOPs counted exactly, without the batched fallback's padding,
    on real tensors (routing needs them: the trainer's meta count takes the formula instead)."""
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts.reference)
    cfg = _cfg(*TINY, *SHAPES[shape], "moe.balance=none")
    model, x = build_reference_model(cfg, 64), torch.randint(0, 64, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as
        lm_loss(model(x), x).backward()  # matmuls the counter sees (CPU's fused kernel it does not)
    assert counter.get_total_flops() == Decoder.of(cfg.model, cfg.moe).flops_per_token() * 2 * 16
    assert flops_per_sample(cfg.model, cfg.moe, 64) == Decoder.of(cfg.model, cfg.moe).flops_per_token() * 16


def test_ep_splits_the_routed_experts_state_and_adds_all_to_all():
    cfg = _cfg("model.preset=mixtral-8x7b", "model.n_layer=3", "model.seq_len=1024", "run.global_batch=16")
    cluster, d = parse_cluster("h100:8", 1), Decoder.of(cfg.model, cfg.moe)
    est = {ep: estimate(cfg, Layout(8, 1, 1, 1, 0, ep=ep), cluster, True) for ep in (1, 2, 8)}
    experts = 3 * d.expert_params() * 4 * (1 + 1 + 2)  # fp32 parameters, gradients, AdamW's two
    state = {ep: sum(e.memory[k] for k in ("params", "grads", "optim")) for ep, e in est.items()}
    assert state[1] - state[2] == pytest.approx(experts / 2, rel=1e-6)
    assert state[1] - state[8] == pytest.approx(experts * 7 / 8, rel=1e-6)
    # dispatch and combine, forward and backward: 4 exchanges a layer of each rank's tokens x k rows
    tokens = 16 / 8 * 1024
    sent = a2a_bytes(d, tokens, 2, 2)
    assert sent == tokens * 2 * 4096 * 2 / 2
    a2a = 3 * 4 * (2 * cluster.latency + sent / _bw(cluster, est[2].layout, "ep"))
    assert est[1].time["all_to_all"] == 0 and est[2].time["all_to_all"] == pytest.approx(a2a)
    # ZeRO-3 over 8 ranks shards the experts 8 ways at any ep: the same state
    z3 = [estimate(cfg, Layout(1, 8, 1, 1, 3, ep=ep), cluster, True) for ep in (1, 4)]
    assert z3[0].state_rank == pytest.approx(z3[1].state_rank)
    # active FLOPs: MFU counts top-2 of 8 experts, not all of them
    assert est[1].mfu < 1 and est[1].params > 3 * est[1].active


def test_layouts_try_every_valid_ep_and_a_dense_model_none():
    cfg = _cfg(*TINY, "model.n_layer=2", "run.global_batch=32")
    found = list(layouts(cfg, 4, 4))
    assert {lay.ep for lay in found} == {1, 2, 4}
    for lay in found:
        if lay.ep > 1:
            assert lay.zero != 1 and (lay.zero < 2 or lay.dp_shard % lay.ep == 0)
            try:  # the validator may refuse it for another reason (DDP under tp), not for ep
                validate(with_layout(cfg, lay), world_size=4, need_data=False)
            except ConfigError as e:
                assert not str(e).startswith("parallel.ep"), (lay, e)
    dense = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=0))
    assert {lay.ep for lay in layouts(dense, 4, 4)} == {1}
    ranked = plan(cfg, parse_cluster("h100:4", 1))
    assert any(e.layout.ep == 4 and e.feasible for e in ranked)


def test_cli_plans_mixtral_with_ep(capfd):
    args = ["plan", "--set", "model.preset=mixtral-8x7b", "--set", "model.seq_len=4096",
            "--set", "run.global_batch=64", "--cluster", "h100:8,nodes=4"]
    out = cli(args, capfd)
    assert out.returncode == 0, out.stderr
    assert "mixture of experts: 46.70B parameters, 12.88B active" in out.stdout.splitlines()[1]
    rows = json.loads(cli([*args, "--json"], capfd).stdout)["layouts"]
    ep = [r for r in rows if r["feasible"] and "parallel.ep=8" in r["set"]]
    assert ep and ep[0]["active_params"] == 12_879_925_248 and ep[0]["time"]["all_to_all"] > 0


def test_cli_check_refuses_a_mixture_of_experts(capfd):
    out = cli(["plan", "--check", "--set", "model.preset=mixtral-8x7b"], capfd)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith(
        "allhands: error: --check trains dense models' layouts")

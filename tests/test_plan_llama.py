"""The planner prices the Llama family from its own shapes: FLOPs per token against PaLM's
``6 N + 12 L H T`` and torch's own counter, parameters per rank against the published counts,
grouped-query tp limits, and `allhands plan` on a preset."""

from __future__ import annotations

import subprocess

import pytest
import torch

from allhands.config import Config, apply_override
from allhands.flops import count_flops, decoder_flops_per_token
from allhands.job import build_reference_model, lm_loss
from allhands.models.build import moe_preset, with_preset
from allhands.models.presets import PUBLISHED_PARAMS
from allhands.plan import parse_cluster
from allhands.plan.decoder import Decoder
from allhands.plan.estimate import Layout, _stage_layers, estimate, stage_params
from allhands.plan.experts import stage_experts
from allhands.plan.search import layouts

from conftest import ALLHANDS


def _preset(name: str, *extra: str) -> Config:
    cfg = Config()
    for item in (f"model.preset={name}", *extra):
        apply_override(cfg, item)
    cfg.moe, cfg.model = moe_preset(cfg.model, cfg.moe), with_preset(cfg.model)
    return cfg


def test_llama3_8b_flops_per_token_is_6n_plus_attention():
    """PaLM (Chowdhery et al. 2022, appendix B): 6 N + 12 L H Q T per token, N the parameters
    without the input embedding (the untied head's V x C counts: it is a matmul). The 65 norm
    vectors of 4096 are parameters but no matmul: 1.6e6 FLOPs of 4.7e10, inside the tolerance."""
    cfg = _preset("llama3-8b", "model.seq_len=8192")
    n = PUBLISHED_PARAMS["llama3-8b"] - 128256 * 4096
    palm = 6 * n + 12 * 32 * 32 * 128 * 8192
    got = Decoder.of(cfg.model).flops_per_token()
    assert got == pytest.approx(palm, rel=1e-4)
    # k and v are 8 x 128 wide, SwiGLU's three matrices 14336 wide: not the GPT's 12 C^2 a block
    assert got != decoder_flops_per_token(n_layer=32, n_embd=4096, seq_len=8192, vocab_size=128256)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_the_formula_is_what_torch_counts(name):
    cfg = _preset(name, "model.vocab_size=300", "model.seq_len=24", "model.n_layer=3")
    x = torch.randint(0, 300, (2, 24))
    counted = count_flops(lambda: build_reference_model(cfg, 300), x, x, lm_loss)
    assert counted == Decoder.of(cfg.model).flops_per_token() * 2 * 24


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_planned_parameters_of_each_preset_are_the_published_count(name):
    cfg = _preset(name)
    d = Decoder.of(cfg.model, cfg.moe)
    experts = stage_experts(d, range(d.n_layer))[0]  # a mixture of experts' routed experts
    assert stage_params(cfg, 1, 1, 0)[0] + experts == PUBLISHED_PARAMS[name] == d.params()
    # split 2 x 2 (pp x tp): the stages' rank shares add up to the model, the tied head counted on
    # both ends and the replicated norms on every tp rank (an MoE layer's router whole on each,
    # and its routed experts: split by ep, not tp)
    shards = sum(stage_params(cfg, 2, 2, s)[0] + stage_experts(d, _stage_layers(d.n_layer, 2)[s])[0]
                 for s in (0, 1)) * 2
    moe = bool(d.moe_layers)
    replicated = (2 * d.block_params(2, moe)[0] - d.block_params(1, moe)[0]) * d.n_layer + d.c + experts
    tied = d.v * d.c if d.tie else 0
    assert shards == PUBLISHED_PARAMS[name] + replicated + tied


def test_zero3_state_of_llama3_8b_is_16_bytes_a_parameter_over_the_ranks():
    cfg = _preset("llama3-8b", "model.seq_len=2048", "run.global_batch=8", "run.precision=bf16")
    est = estimate(cfg, Layout(1, 8, 1, 1, 3), parse_cluster("h100:1", 1), True)
    state = sum(est.memory[k] for k in ("params", "grads", "optim"))
    assert state == pytest.approx(16 * PUBLISHED_PARAMS["llama3-8b"] / 8, rel=1e-6)
    assert est.feasible and 0.05 < est.mfu < 0.8


def test_tp_candidates_divide_the_key_value_heads():
    cfg = _preset("llama3-8b")  # 32 query heads, 8 key/value heads
    assert {lay.tp for lay in layouts(cfg, 16, 16)} == {1, 2, 4, 8}


def test_cli_plans_a_preset(cli_env):
    out = subprocess.run([*ALLHANDS, "plan", "--set", "model.preset=llama3-8b", "--cluster", "h100:8"],
                         capture_output=True, text=True, env=cli_env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("allhands plan: ") and "MFU" in lines[1]
    assert lines[3].lstrip().startswith("1 ") and "tp" in "".join(lines[3:13])

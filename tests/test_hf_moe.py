"""The MoE families against transformers' own (MixtralForCausalLM, Qwen3MoeForCausalLM,
Qwen2MoeForCausalLM) on tiny random models built offline: logits equal in fp32, import then
export gives back every per-expert tensor bit for bit, transformers loads what we write, and an
MoE shape with no transformers architecture is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from allhands.errors import ConfigError  # noqa: E402
from allhands.models.hf import from_hf, hf_config_json, to_hf  # noqa: E402
from allhands.models.moe import MoE  # noqa: E402
from test_hf_families import _logits, _saved as saved_hf  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe_unnormed_sparse2": lambda: transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_experts=4, num_experts_per_tok=3,
        moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[]),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _saved(tmp_path, name: str):
    # routers and norms away from their init, so each one counts
    return saved_hf(tmp_path, name, FAMILIES, noise=0.1)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_moe_logits_equal_transformers_and_tensors_round_trip(tmp_path, name):
    hf, src = _saved(tmp_path, name)
    ours = from_hf(src)
    n_moe = sum(isinstance(m, MoE) for m in ours.modules())
    assert n_moe == (2 if name == "qwen3_moe_unnormed_sparse2" else ours.cfg.n_layers)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    want = _logits(hf, ids)
    assert (_logits(ours, ids) - want).abs().max() <= 1e-5
    to_hf(ours, tmp_path / "back")
    a = load_file(str(src / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    assert type(again).__name__ == type(hf).__name__
    assert (_logits(again.eval(), ids) - want).abs().max() <= 1e-5


def test_moe_shapes_without_an_architecture_are_refused(tmp_path):
    _, src = _saved(tmp_path, "mixtral")
    fc = from_hf(src).cfg
    for change, field in ((dict(score="sigmoid"), "sigmoid"), (dict(balance="bias"), "bias"),
                          (dict(first_dense=1), "first_dense")):
        bad = dataclasses.replace(fc, moe=dataclasses.replace(fc.moe, **change))
        with pytest.raises(ConfigError, match=field):
            hf_config_json(bad)


def test_init_from_a_mixtral_directory_sets_the_moe_section(tmp_path):
    from allhands.checkpoint import load_weights
    from allhands.config import Config
    from allhands.job import build_reference_model
    from allhands.models.resolve import resolve_model

    hf, src = _saved(tmp_path, "mixtral")
    cfg = Config()
    cfg.checkpoint.init_from = str(src)
    cfg.model.seq_len = 40
    cfg = resolve_model(cfg)
    assert (cfg.model.family, cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.norm_topk) == ("llama", 4, 2, True)
    model = load_weights(build_reference_model(cfg, 0), src).eval()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    assert (_logits(model, ids) - _logits(hf, ids)).abs().max() <= 1e-5

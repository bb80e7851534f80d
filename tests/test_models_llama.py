"""The Llama family without transformers' weights: presets have the published parameter counts
(built on the meta device), the model is cuttable like the GPT (a stage without the embedding
takes hidden states; explicit positions equal the default ones), the config refuses impossible
shapes in one line naming the field, and `allhands train` trains the family."""

from __future__ import annotations

import copy

import pytest
import torch

from allhands.config import Config, ConfigError, ModelConfig, MoEConfig, apply_override, validate
from allhands.models import Llama, LlamaConfig
from allhands.models.build import build_model, family_config, moe_preset, with_preset
from allhands.models.resolve import resolve_model
from allhands.models.presets import PRESETS, PUBLISHED_PARAMS


def _meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        m = ModelConfig(preset=name)
        return build_model(family_config(with_preset(m), 1000, moe_preset(m, MoEConfig())))


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_has_the_published_parameter_count(name):
    assert _meta_model(name).num_params() == PUBLISHED_PARAMS[name]


def test_every_preset_builds():
    for name in PRESETS:
        assert _meta_model(name).num_params() > 0, name


def _tiny(**kw) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                             seq_len=16, **kw)).eval()


def test_stages_compose_to_the_whole_model():
    m = _tiny(qk_norm=True, qkv_bias=True)
    ids = torch.randint(0, 50, (2, 12))
    first, last = copy.deepcopy(m), copy.deepcopy(m)
    del first.blocks["2"]
    first.norm = first.lm_head = None
    last.tok_emb = None
    del last.blocks["0"], last.blocks["1"]
    with torch.no_grad():
        assert torch.equal(last(first(ids)), m(ids))


def test_explicit_positions_equal_the_default_and_restart_per_document():
    m = _tiny(rope_scaling="llama3", rope_original_seq_len=8)
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        assert torch.equal(m(ids, torch.arange(10).expand(2, 10)), m(ids))
        # two documents packed in one row: the second, restarted at 0, sees what it sees alone
        packed = torch.cat([ids[:1, :4], ids[1:, :6]], dim=1)
        pos = torch.cat([torch.arange(4), torch.arange(6)])[None]
        alone = m(ids[1:, :6])
        full = m(packed, pos)
    assert not torch.allclose(full[:, 4:], alone)  # causal: the first document is still visible
    assert torch.allclose(m(packed[:, 4:], pos[:, 4:]), alone, atol=1e-6)


def _cfg(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


@pytest.mark.parametrize("items, field", [
    (("model.family=llama", "model.n_kv_head=3"), "model.n_kv_head"),
    (("model.family=mamba",), "model.family"),
    (("model.family=llama", "model.rope_scaling=yarn"), "model.rope_scaling"),
    (("model.n_kv_head=2",), "model.n_kv_head"),  # a llama field on the gpt family
])
def test_impossible_model_fields_name_the_field(items, field):
    with pytest.raises(ConfigError) as e:
        validate(resolve_model(_cfg(*items)), need_data=False)
    assert str(e.value).startswith(field + ":") and "\n" not in str(e.value)


def test_unknown_preset_names_the_field():
    with pytest.raises(ConfigError, match=r"^model\.preset: 'llama9-1t' is not a preset; known: "):
        resolve_model(_cfg("model.preset=llama9-1t"))


def test_preset_fills_only_fields_left_at_their_default():
    m = resolve_model(_cfg("model.preset=llama3-8b", "model.n_layer=2")).model
    assert (m.family, m.n_layer, m.n_embd, m.n_kv_head, m.rope_theta) == ("llama", 2, 4096, 8, 500000.0)
    assert resolve_model(Config(model=m)).model == m  # resolving again (a resume) changes nothing


def test_train_trains_the_family_on_two_workers(tmp_path, token_dir):
    from allhands.launch.launcher import LaunchSpec, train_job
    from conftest import tiny_config

    cfg = tiny_config(token_dir, tmp_path / "run", "model.family=llama", "model.n_kv_head=1",
                      "model.preset=qwen2-tiny", "model.n_layer=1")
    done = train_job(cfg, LaunchSpec(nproc=2))
    resolved = (tmp_path / "run" / "config.resolved.toml").read_text()
    assert 'family = "llama"' in resolved and "qkv_bias = true" in resolved
    # the tiny job's own n_embd=32 and this n_layer=1 are kept; the preset's bias and theta come in
    assert (done.model.n_layer, done.model.n_embd, done.model.rope_theta) == (1, 32, 1e6)
    import json
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
              if x and '"loss"' in x]
    assert len(losses) >= 4 and losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_transformers_counts_the_same_parameters(name):
    """transformers' own model, built on the meta device from the config.json we would write."""
    transformers = pytest.importorskip("transformers")
    from allhands.models.hf import hf_config_json

    m = ModelConfig(preset=name)
    fc = family_config(with_preset(m), 0, moe_preset(m, MoEConfig()))
    c = hf_config_json(fc)  # a mixture of experts' is a Mixtral or Qwen3-MoE config.json
    config = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in hf.parameters()) == PUBLISHED_PARAMS[name]

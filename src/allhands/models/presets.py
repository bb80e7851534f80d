"""Named model shapes (``model.preset``): the published shapes of the models people train, as
``model.*`` field values, copied from each model's transformers config.json, plus tiny ones for
tests. tests/test_models_llama.py checks each against transformers' own model built from the
same numbers and against the published parameter count.

A preset fills the ``model`` fields the user did not set (models/build.py), so
``model.preset=llama3-8b`` with ``model.n_layer=2`` is an 8B-wide model two blocks deep, and with
``model.n_layer=4`` (the default) four. A mixture of experts' preset fills the
``moe`` section's fields the same way (``moe.n_experts=4`` keeps Mixtral's shape with 4 experts). ``seq_len`` stays the run's (the
training sample length); ``max_positions`` records the context the model was published for.
"""

from __future__ import annotations

from allhands.errors import ConfigError

_LLAMA3 = {"family": "llama", "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5,
           "tie_embeddings": False}
_LLAMA31_ROPE = {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
                 "rope_high_freq_factor": 4.0, "rope_original_seq_len": 8192, "max_positions": 131072}
_QWEN = {"family": "llama", "rope_theta": 1000000.0, "norm_eps": 1e-6}

PRESETS: dict[str, dict] = {
    "llama2-7b": {"family": "llama", "vocab_size": 32000, "n_embd": 4096, "n_layer": 32, "n_head": 32,
                  "n_kv_head": 32, "ffn_hidden": 11008, "norm_eps": 1e-5, "tie_embeddings": False,
                  "max_positions": 4096},
    "llama3-8b": {**_LLAMA3, "n_embd": 4096, "n_layer": 32, "n_head": 32, "n_kv_head": 8,
                  "ffn_hidden": 14336, "max_positions": 8192},
    "llama3-70b": {**_LLAMA3, "n_embd": 8192, "n_layer": 80, "n_head": 64, "n_kv_head": 8,
                   "ffn_hidden": 28672, "max_positions": 8192},
    "llama3.1-8b": {**_LLAMA3, **_LLAMA31_ROPE, "n_embd": 4096, "n_layer": 32, "n_head": 32,
                    "n_kv_head": 8, "ffn_hidden": 14336},
    "llama3.2-1b": {**_LLAMA3, **_LLAMA31_ROPE, "rope_factor": 32.0, "n_embd": 2048, "n_layer": 16,
                    "n_head": 32, "n_kv_head": 8, "head_dim": 64, "ffn_hidden": 8192,
                    "tie_embeddings": True},
    "llama3.2-3b": {**_LLAMA3, **_LLAMA31_ROPE, "rope_factor": 32.0, "n_embd": 3072, "n_layer": 28,
                    "n_head": 24, "n_kv_head": 8, "head_dim": 128, "ffn_hidden": 8192,
                    "tie_embeddings": True},
    "mistral-7b": {"family": "llama", "vocab_size": 32000, "n_embd": 4096, "n_layer": 32, "n_head": 32,
                   "n_kv_head": 8, "ffn_hidden": 14336, "norm_eps": 1e-5, "tie_embeddings": False,
                   "max_positions": 32768},
    "qwen2.5-0.5b": {**_QWEN, "vocab_size": 151936, "n_embd": 896, "n_layer": 24, "n_head": 14,
                     "n_kv_head": 2, "ffn_hidden": 4864, "qkv_bias": True, "tie_embeddings": True,
                     "max_positions": 32768},
    "qwen2.5-7b": {**_QWEN, "vocab_size": 152064, "n_embd": 3584, "n_layer": 28, "n_head": 28,
                   "n_kv_head": 4, "ffn_hidden": 18944, "qkv_bias": True, "tie_embeddings": False,
                   "max_positions": 131072},
    "qwen3-0.6b": {**_QWEN, "vocab_size": 151936, "n_embd": 1024, "n_layer": 28, "n_head": 16,
                   "n_kv_head": 8, "head_dim": 128, "ffn_hidden": 3072, "qk_norm": True,
                   "tie_embeddings": True, "max_positions": 40960},
    "qwen3-8b": {**_QWEN, "vocab_size": 151936, "n_embd": 4096, "n_layer": 36, "n_head": 32,
                 "n_kv_head": 8, "head_dim": 128, "ffn_hidden": 12288, "qk_norm": True,
                 "tie_embeddings": False, "max_positions": 40960},
    # mixtures of experts: the ``moe`` section's values too (docs/models.md)
    "mixtral-8x7b": {"family": "llama", "vocab_size": 32000, "n_embd": 4096, "n_layer": 32, "n_head": 32,
                     "n_kv_head": 8, "ffn_hidden": 14336, "norm_eps": 1e-5, "rope_theta": 1000000.0,
                     "tie_embeddings": False, "max_positions": 32768,
                     "moe": {"n_experts": 8, "top_k": 2, "aux_coef": 0.02}},
    "qwen3-30b-a3b": {**_QWEN, "vocab_size": 151936, "n_embd": 2048, "n_layer": 48, "n_head": 32,
                      "n_kv_head": 4, "head_dim": 128, "ffn_hidden": 6144, "qk_norm": True,
                      "tie_embeddings": False, "max_positions": 40960,
                      "moe": {"n_experts": 128, "top_k": 8, "ffn_hidden": 768, "aux_coef": 0.001}},
    # tiny shapes for tests and the CPU; vocab_size 0 takes the data's
    "llama-tiny": {"family": "llama", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                   "ffn_hidden": 160, "rope_theta": 500000.0, "rope_scaling": "llama3",
                   "rope_factor": 8.0, "rope_original_seq_len": 64, "tie_embeddings": False},
    "qwen2-tiny": {**_QWEN, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 1,
                   "ffn_hidden": 128, "qkv_bias": True, "tie_embeddings": True},
    "qwen3-tiny": {**_QWEN, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "head_dim": 32,
                   "ffn_hidden": 128, "qk_norm": True, "tie_embeddings": True},
}

# The parameter counts of the published models (sum over the tensors of their safetensors
# files, which equals transformers' count of the model built from config.json).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248, "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624,
}
# The parameters a token passes through, as the model cards round them (Mixtral's "12.9B active",
# Qwen3's "3.3B activated"): attention, the router and top_k of the experts, embedding and head.
PUBLISHED_ACTIVE = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9}


def preset(name: str) -> dict:
    """The ``model.*`` values of preset ``name``; ConfigError naming the field if unknown."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: {name!r} is not a preset; known: {', '.join(PRESETS)}")
    return dict(PRESETS[name])

"""Checks of the ``model`` section: the shape every family shares and the fields of each family.
Preset names and transformers directories are resolved above this layer (models/resolve.py)."""

from __future__ import annotations

from allhands.config.check import check as _check
from allhands.config.tree import ModelConfig

FAMILIES = ("gpt", "llama")
ACTIVATIONS = ("gelu", "gelu_new")
ROPE_SCALINGS = ("", "llama3")


def validate_model(m: ModelConfig) -> None:
    """Raise ConfigError naming the first impossible ``model.*`` value."""
    _check(m.family in FAMILIES, "model.family", "allowed: " + ", ".join(FAMILIES), m.family)
    for name in ("n_layer", "n_head", "n_embd", "seq_len"):
        _check(getattr(m, name) >= 1, f"model.{name}", "must be >= 1", getattr(m, name))
    for name in ("n_kv_head", "head_dim", "ffn_hidden", "max_positions"):
        _check(getattr(m, name) >= 0, f"model.{name}", "must be >= 0 (0 = the default)", getattr(m, name))
    if not (m.family == "llama" and m.head_dim):
        _check(m.n_embd % m.n_head == 0, "model.n_embd",
               f"must be divisible by model.n_head={m.n_head}", m.n_embd)
    _check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = from the tokenizer)", m.vocab_size)
    _check(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)", m.dropout)
    _check(m.norm_eps > 0, "model.norm_eps", "must be > 0", m.norm_eps)
    _check(m.activation in ACTIVATIONS, "model.activation", "allowed: " + ", ".join(ACTIVATIONS),
           m.activation)
    if m.family == "gpt":
        for name in ("n_kv_head", "head_dim"):
            _check(getattr(m, name) == 0, f"model.{name}", "is a llama field; leave it 0 with "
                   "model.family=gpt", getattr(m, name))
        _check(not (m.qkv_bias or m.qk_norm), "model.qkv_bias" if m.qkv_bias else "model.qk_norm",
               "is a llama field; leave it false with model.family=gpt (gpt has model.bias)", True)
        return
    _check(m.activation == "gelu", "model.activation", "llama's feed-forward is SwiGLU; leave the "
           "default with model.family=llama", m.activation)
    _check(m.dropout == 0.0, "model.dropout", "the llama family has no dropout; leave it 0", m.dropout)
    kv = m.n_kv_head or m.n_head
    _check(m.n_head % kv == 0, "model.n_kv_head",
           f"must divide model.n_head={m.n_head} (each kv head serves n_head / n_kv_head query heads)",
           m.n_kv_head)
    _check((m.head_dim or m.n_embd // m.n_head) % 2 == 0, "model.head_dim",
           "must be even (RoPE rotates pairs)", m.head_dim or m.n_embd // m.n_head)
    _check(m.rope_theta > 0, "model.rope_theta", "must be > 0", m.rope_theta)
    _check(m.rope_scaling in ROPE_SCALINGS, "model.rope_scaling",
           "allowed: empty (none), llama3", m.rope_scaling)
    if m.rope_scaling == "llama3":
        _check(m.rope_factor > 0, "model.rope_factor", "must be > 0", m.rope_factor)
        _check(m.rope_low_freq_factor > 0, "model.rope_low_freq_factor", "must be > 0",
               m.rope_low_freq_factor)
        _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
               f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}", m.rope_high_freq_factor)
        _check(m.rope_original_seq_len >= 1, "model.rope_original_seq_len", "must be >= 1",
               m.rope_original_seq_len)

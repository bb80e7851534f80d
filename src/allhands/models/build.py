"""From the ``model`` config section to a module: the family's own config dataclass
(``GPTConfig`` or ``LlamaConfig``) and the plain single-device model, and the other way, so a
model read from a transformers directory is recorded in the run's config."""

from __future__ import annotations

import dataclasses
import torch.nn as nn

from allhands.config import ModelConfig, MoEConfig, given, mark_given
from allhands.models.gpt import GPT, GPTConfig
from allhands.models.llama import Llama, LlamaConfig
from allhands.models.moe import MoEArgs
from allhands.models.presets import preset


def moe_args(e: MoEConfig | None) -> MoEArgs:
    """The MoE shape of section ``e`` (None or ``n_experts = 0``: dense)."""
    if e is None or not e.n_experts:
        return MoEArgs()
    return MoEArgs(n_experts=e.n_experts, top_k=e.top_k, hidden=e.ffn_hidden,
                   n_shared=e.n_shared_experts, shared_hidden=e.shared_ffn_hidden,
                   shared_gate=e.shared_gate, score=e.score, norm_topk=e.norm_topk,
                   balance=e.balance, aux_coef=e.aux_coef, bias_rate=e.bias_rate, every=e.every,
                   first_dense=e.first_dense)


def moe_section(a: MoEArgs, base: MoEConfig | None = None) -> MoEConfig:
    """The ``moe`` section of ``a`` (the inverse of :func:`moe_args`); a dense ``a`` keeps
    ``base``'s fields with ``n_experts = 0``."""
    out = dataclasses.replace(base) if base is not None else MoEConfig()
    if not a.n_experts:
        out.n_experts = 0
        return out
    return dataclasses.replace(out, n_experts=a.n_experts, top_k=a.top_k, ffn_hidden=a.hidden,
                               n_shared_experts=a.n_shared, shared_ffn_hidden=a.shared_hidden,
                               shared_gate=a.shared_gate, score=a.score, norm_topk=a.norm_topk,
                               balance=a.balance, aux_coef=a.aux_coef, bias_rate=a.bias_rate,
                               every=a.every, first_dense=a.first_dense)


def family_config(m: ModelConfig, vocab_size: int,
                  moe: MoEConfig | None = None) -> GPTConfig | LlamaConfig:
    """The family config of section ``m`` (and ``moe``, the llama family's experts);
    ``vocab_size`` when ``m.vocab_size`` is 0."""
    vocab = m.vocab_size or vocab_size
    if m.family == "llama":
        return LlamaConfig(vocab_size=vocab, dim=m.n_embd, n_layers=m.n_layer, n_heads=m.n_head,
                           n_kv_heads=m.n_kv_head, head_dim=m.head_dim, ffn_hidden=m.ffn_hidden,
                           seq_len=m.seq_len, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                           rope_scaling=m.rope_scaling, rope_factor=m.rope_factor,
                           rope_low_freq_factor=m.rope_low_freq_factor,
                           rope_high_freq_factor=m.rope_high_freq_factor,
                           rope_original_seq_len=m.rope_original_seq_len, qkv_bias=m.qkv_bias,
                           qk_norm=m.qk_norm, tie_embeddings=m.tie_embeddings, moe=moe_args(moe))
    return GPTConfig(vocab_size=vocab, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                     n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                     tie_embeddings=m.tie_embeddings, ffn_hidden=m.ffn_hidden,
                     norm_eps=m.norm_eps, activation=m.activation)


def section_of(fc: GPTConfig | LlamaConfig, base: ModelConfig | None = None) -> ModelConfig:
    """The ``model`` section that builds ``fc`` (the inverse of :func:`family_config`); fields
    a family does not have are taken from ``base`` (dropout, max_positions)."""
    m = dataclasses.replace(base) if base is not None else ModelConfig()
    m.preset = ""
    if isinstance(fc, LlamaConfig):
        vals = dict(family="llama", vocab_size=fc.vocab_size, n_embd=fc.dim, n_layer=fc.n_layers,
                    n_head=fc.n_heads, n_kv_head=fc.n_kv_heads, head_dim=fc.head_dim,
                    ffn_hidden=fc.ffn_hidden, seq_len=fc.seq_len, norm_eps=fc.norm_eps,
                    rope_theta=fc.rope_theta, rope_scaling=fc.rope_scaling,
                    rope_factor=fc.rope_factor, rope_low_freq_factor=fc.rope_low_freq_factor,
                    rope_high_freq_factor=fc.rope_high_freq_factor,
                    rope_original_seq_len=fc.rope_original_seq_len, qkv_bias=fc.qkv_bias,
                    qk_norm=fc.qk_norm, tie_embeddings=fc.tie_embeddings, bias=False, dropout=0.0,
                    activation="gelu")
    else:
        vals = dict(family="gpt", vocab_size=fc.vocab_size, n_embd=fc.n_embd, n_layer=fc.n_layer,
                    n_head=fc.n_head, seq_len=fc.seq_len, bias=fc.bias, dropout=fc.dropout,
                    tie_embeddings=fc.tie_embeddings, ffn_hidden=fc.ffn_hidden,
                    norm_eps=fc.norm_eps, activation=fc.activation, n_kv_head=0, head_dim=0,
                    qkv_bias=False, qk_norm=False)
    for k, v in vals.items():
        setattr(m, k, v)
    return m


def build_model(fc: GPTConfig | LlamaConfig) -> nn.Module:
    return Llama(fc) if isinstance(fc, LlamaConfig) else GPT(fc)


def _filled(section, default, values: dict):
    """``section`` with ``values`` in the fields the user did not set: neither given (TOML,
    ``--set``, a dict) nor set in Python to other than their default. The result is final, so
    every field counts as given: filling it again (a worker, ``allhands plan``, a resume reading
    config.resolved.toml) changes nothing."""
    mine = given(section)
    out = dataclasses.replace(section)
    for k, v in values.items():
        if k not in mine and getattr(section, k) == getattr(default, k):
            setattr(out, k, v)
    mark_given(out, (f.name for f in dataclasses.fields(out)))
    return out


def with_preset(m: ModelConfig) -> ModelConfig:
    """``m`` with its preset's values in the fields the user did not set (:func:`_filled`)."""
    if not m.preset:
        return m
    return _filled(m, ModelConfig(), {k: v for k, v in preset(m.preset).items() if k != "moe"})


def moe_preset(m: ModelConfig, e: MoEConfig) -> MoEConfig:
    """``e`` with the ``moe`` values of ``m``'s preset (a mixture of experts') in the fields the
    user did not set; ``e`` itself for a dense preset or none."""
    values = preset(m.preset).get("moe") if m.preset else None
    return _filled(e, MoEConfig(), values) if values else e

"""The Llama decoder family from one implementation: Llama 2, Llama 3 / 3.1 / 3.2 (RoPE with the
"llama3" frequency scaling), Mistral, Qwen2 / 2.5 (bias on q, k, v) and Qwen3 (RMSNorm on each q
and k head), chosen by the flags of one :class:`LlamaConfig` (named shapes: presets.py).

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with RMSNorm, grouped-query
attention through SDPA and a SwiGLU feed-forward (layers.py); tied or untied embeddings.
Shapes: tokens ``(B, T)`` -> logits ``(B, T, vocab)``.

Cuttable the way models/gpt.py is, without changing parameter names:

- Tensor parallel: q_proj, k_proj, v_proj and o_proj are separate linears, so a column-wise shard
  of q/k/v holds whole query and key/value heads and attention reshapes with ``-1`` heads.
- Pipeline parallel: ``blocks`` is a ``ModuleDict`` keyed ``"0"``, ``"1"``, ... and ``forward``
  skips absent parts: without ``tok_emb`` the input is the previous stage's hidden state
  ``(B, T, C)``, without ``norm`` and ``lm_head`` the output is the hidden state.
  The RoPE table is a non-persistent buffer every stage keeps, recomputed from the config.
- ``positions`` ``(B, T)`` (default ``0 .. T-1``) lets packed documents restart their positions;
  with ``doc_token`` set (``data.packing = "mask"``) the model derives them, and a document mask,
  from the row's end-of-document tokens itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from allhands.models.layers import (Attention, RMSNorm, SwiGLU, document_mask, rope_frequencies,
                                    rope_table)
from allhands.models.moe import GroupedExperts, MoE, MoEArgs


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: n_heads (multi-head attention)
    head_dim: int = 0  # 0: dim / n_heads (Qwen3 sets it apart)
    ffn_hidden: int = 0  # 0: 8/3 dim rounded up to a multiple of 64
    seq_len: int = 128  # positions the RoPE table covers
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = ""  # "" or "llama3"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    qkv_bias: bool = False  # Qwen2 / 2.5
    qk_norm: bool = False  # Qwen3
    tie_embeddings: bool = False
    moe: MoEArgs = MoEArgs()  # n_experts > 0: MoE feed-forward in the layers moe.is_moe names
    doc_token: int = -1  # >= 0: rows are packed documents ending in this token (document masks)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or -(-8 * self.dim // 3 // 64) * 64

    def check(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.hd % 2:
            raise ValueError(f"head_dim={self.hd} must be even for RoPE")
        self.moe.check()


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.hd, qkv_bias=cfg.qkv_bias,
                              qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = (MoE(cfg.dim, cfg.hidden, cfg.moe) if cfg.moe.is_moe(layer)
                    else SwiGLU(cfg.dim, cfg.hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    def init_buffers(self) -> None:
        """(Re)compute the RoPE table and zero the MoE counts, e.g. after building on the meta
        device and ``to_empty``."""
        c = self.cfg
        inv = rope_frequencies(c.hd, c.rope_theta, c.rope_scaling, c.rope_factor,
                               c.rope_low_freq_factor, c.rope_high_freq_factor,
                               c.rope_original_seq_len)
        cos, sin = rope_table(inv, c.seq_len)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        for m in self.modules():
            if isinstance(m, MoE):  # the balancing bias starts at zero; a checkpoint may load it
                m.router.expert_bias.zero_()
                m.load.zero_()
                m.tokens.zero_()

    def init_weights(self) -> None:
        """Normal(0, 0.02) matrices, zero biases, unit norms; residual outputs (o_proj,
        down_proj) at 0.02 / sqrt(2 n_layers), GPT-2's scaled init."""
        self.init_buffers()
        std_out = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                out = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(m.weight, mean=0.0, std=std_out if out else 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, GroupedExperts):
                m.reset_parameters(0.02, std_out)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: token ids ``(B, T)``, or on a later pipeline stage the hidden state
        ``(B, T, C)``; ``positions``: ``(B, T)`` position of each token (default ``0 .. T-1``)."""
        T, mask = idx.shape[1], None
        x = self.tok_emb(idx) if self.tok_emb is not None else idx
        if self.cfg.doc_token >= 0 and self.tok_emb is not None and positions is None:
            # packed documents: positions restart and attention stays inside each document (under
            # context parallelism the layout passes positions and masks attention itself). One
            # mask for every layer: a BlockMask on CUDA, elsewhere a dense one in the hidden
            # state's dtype (bf16 under FSDP's mixed precision), the dtype q will have.
            positions, mask = document_mask(idx, self.cfg.doc_token, dtype=x.dtype)
        if T > self.cfg.seq_len and positions is None:
            raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        if positions is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for block in self.blocks.values():
            x = block(x, cos, sin, mask)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

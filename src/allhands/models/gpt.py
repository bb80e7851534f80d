"""The reference decoder: a nanoGPT-style GPT written for one device.

Parallelism is applied afterwards by ``allhands.parallel.apply_*``; nothing here knows about
processes. Shapes: tokens ``(B, T)`` -> logits ``(B, T, vocab)``.

Two choices keep the model cuttable without changing its parameter names (FQNs), so one
checkpoint loads under every layout:

- Tensor parallel: the fused ``qkv`` projection stores its rows head by head
  (``[q_h0 k_h0 v_h0 | q_h1 k_h1 v_h1 | ...]``, Megatron-LM's layout), so a column-wise shard
  of it holds whole heads, and attention reshapes with ``-1`` heads: the same code runs on all
  heads or on the local ``n_head / tp``.
- Pipeline parallel: ``blocks`` is a ``ModuleDict`` keyed ``"0"``, ``"1"``, ... (the same
  state-dict keys as a ``ModuleList``) and ``forward`` skips parts that are absent, so a stage
  is the model with the other stages' modules deleted (torchtitan's manual split) and its
  keys are a subset of the full model's. A stage's input is the previous stage's hidden state
  ``(B, T, C)``; only the first stage takes token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    ffn_hidden: int = 0  # 0: 4 * n_embd
    norm_eps: float = 1e-5
    activation: str = "gelu"  # "gelu" (exact erf) or "gelu_new" (GPT-2's tanh approximation)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, 3C') -> (B, T, heads, 3 * head_dim) -> q, k, v each (B, heads, T, head_dim), where
        # C' is the local width: n_embd, or n_embd / tp when qkv is column-sharded.
        qkv = self.qkv(x).view(B, T, -1, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.ffn_hidden or 4 * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        # transformers' "gelu_new" (GPT-2's own) is the tanh approximation of Hendrycks & Gimpel
        self.approximate = "tanh" if cfg.activation == "gelu_new" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init)
        # GPT-2's scaled init of residual projections: std 0.02 / sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: token ids ``(B, T)``, or on a later pipeline stage the hidden state ``(B, T, C)``."""
        if self.tok_emb is not None:
            T = idx.shape[1]
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.cfg.seq_len}")
            x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        else:
            x = idx
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""The layers a decoder family is made of, written once: RMSNorm, rotary position embeddings
(plain and Llama 3's frequency scaling), grouped-query attention and the SwiGLU feed-forward.

Every layer is written for one device and stays correct when tensor parallelism column-shards
its input projections: attention reshapes its projections with ``-1`` heads, so the same code
runs on ``n_heads`` query and ``n_kv_heads`` key/value heads or on the local
``n_heads / tp`` and ``n_kv_heads / tp`` of one tensor-parallel rank.

Shapes: ``x`` is ``(B, T, C)``; per-head tensors are ``(B, heads, T, head_dim)``; RoPE tables are
``(T, head_dim)`` or, for explicit positions, ``(B, T, head_dim)``.

Document masks (packed rows) take one of two kernels, chosen by device (:func:`attention_path`):
FlexAttention with a block mask on CUDA, SDPA with a dense mask elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# flex_attention and create_block_mask, each compiled once per process and shared by every layer
# of every model, as torchtitan keeps one compiled flex_attention (a class attribute of its
# FlexAttention) and one compiled create_block_mask. Eager, flex_attention materialises the whole
# (B, H, T, T) score matrix and create_block_mask evaluates the mask_mod on every (q, kv) pair;
# compiled, both work block by block and skip masked-out blocks. Made on first use rather than at
# import: torch.compile imports dynamo and inductor (2.6 s measured here), which CPU runs and
# commands that only read a model's shape never use.
_COMPILED: dict[str, Callable] = {}


def compiled(name: str) -> Callable:
    """The compiled ``"flex_attention"`` or ``"create_block_mask"``. The first call comes from
    :func:`document_block_mask`, in the model's forward before any block runs, so a block that
    is itself compiled only reads the cache. ``wrap_inductor_compiled_regions`` shows the compiled
    attention to TorchDispatchModes as one ``inductor_compiled_code`` op, so selective activation
    checkpointing (parallel/ac.py) can save its output (torchtitan sets the same option)."""
    if name not in _COMPILED:
        if name == "flex_attention":
            fn = torch.compile(flex_attention, options={"wrap_inductor_compiled_regions": True})
        else:
            fn = torch.compile(create_block_mask)
        _COMPILED[name] = fn
    return _COMPILED[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) with a learned scale, computed in float32
    and cast back before the scale, as transformers' LlamaRMSNorm does, so bf16 runs round alike."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(head_dim: int, theta: float, scaling: str = "", factor: float = 8.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_seq_len: int = 8192) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies of RoPE (Su et al. 2021), float32.

    ``scaling="llama3"``: Llama 3.1's context extension (Meta's llama-models
    ``apply_scaling``, transformers' ``_compute_llama3_parameters``): wavelengths longer than
    ``original_seq_len / low_freq_factor`` are slowed by ``factor``, those shorter than
    ``original_seq_len / high_freq_factor`` kept, and the band between interpolated smoothly.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling == "":
        return inv
    if scaling != "llama3":
        raise ValueError(f"rope scaling {scaling!r} is not implemented (only 'llama3')")
    low_wavelen = original_seq_len / low_freq_factor
    high_wavelen = original_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(seq_len, head_dim)`` for positions ``0 .. seq_len-1``: each frequency is
    repeated in both halves (``cat(freqs, freqs)``), the rotate-half layout below."""
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, heads, T, head_dim)`` by position. This is the rotate-half convention
    (dimension ``i`` pairs with ``i + head_dim/2``) that transformers' Llama, Mistral and Qwen use,
    not Meta's interleaved pairs ``(2i, 2i+1)``: written this way, weights from transformers load
    unchanged, without the q/k row permutation torchtitan's state-dict adapter applies."""
    if cos.dim() == 3:  # per-sample positions (B, T, hd): broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def document_positions(idx: torch.Tensor, doc_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of packed rows ``idx`` ``(B, T)``: its position in its document (restarting at
    each document) and its document's index in the row. A document ends with ``doc_token``,
    which still belongs to it (data/packing.py)."""
    ar = torch.arange(idx.shape[1], device=idx.device)
    ends = idx == doc_token
    seg = torch.cumsum(ends, dim=1) - ends.long()  # documents ended before each token
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]  # a token right after an end starts a document
    first = torch.cummax(torch.where(starts, ar, torch.zeros_like(ar)), dim=1).values
    return ar - first, seg


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as SDPA's additive float mask (0 or -inf),
    made once per forward: given a boolean one, SDPA on CPU converts it to float in every layer
    and each layer's copy is kept for backward (measured: T x T x 4 bytes a layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attention_path(device: torch.device | str) -> str:
    """The kernel a document mask is built for on ``device``: ``"flex"`` on CUDA, ``"sdpa"``
    elsewhere.

    On CUDA, SDPA with a dense mask cannot run flash attention (it takes no mask) and, with
    grouped-query heads, not the memory-efficient kernel either, so it falls back to the math
    kernel and its ``(B, H, T, T)`` scores: out of memory or several times slower at 8k tokens.
    FlexAttention takes grouped-query heads and a block mask that skips every block outside a
    document. On CPU (torch 2.13) flex_attention has no backward, so the CPU keeps SDPA."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def document_block_mask(seg: torch.Tensor, queries: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention's block mask for document ids ``seg`` ``(B, T)``: query ``q`` may attend key
    ``kv`` when ``kv <= q`` in the same document. ``queries``: the global positions of the
    queries when they are not all ``T`` in order (a context-parallel rank's chunks,
    parallel/context.py); the keys are always the whole sequence in order. Built once per batch
    and shared by every layer and head (``H=None``); compiled on CUDA."""
    B, T = seg.shape

    def causal_document(b, h, q_idx, kv_idx):
        at = q_idx if queries is None else queries[q_idx]
        return (kv_idx <= at) & (seg[b, at] == seg[b, kv_idx])

    n = T if queries is None else queries.numel()
    if not seg.is_cuda:
        return create_block_mask(causal_document, B, None, n, T, device=seg.device)
    compiled("flex_attention")  # made here, outside any compiled block (see compiled)
    return compiled("create_block_mask")(causal_document, B, None, n, T, device=seg.device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention of ``q`` over ``k``, ``v`` under ``block_mask``, grouped-query heads inside
    the kernel: the compiled kernel on CUDA, the eager one (forward only) elsewhere."""
    flex = compiled("flex_attention") if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def document_mask(idx: torch.Tensor, doc_token: int, dtype: torch.dtype = torch.float32,
                  path: str | None = None) -> tuple[torch.Tensor, torch.Tensor | BlockMask]:
    """Positions ``(B, T)`` that restart at each document of a packed row, and the mask that keeps
    each token inside its own document and causal, for ``path`` (default
    :func:`attention_path` of ``idx``'s device): a :class:`BlockMask` for ``"flex"``, or for
    ``"sdpa"`` the additive mask ``(B, 1, T, T)`` in ``dtype``, which should be the queries'
    dtype: SDPA's memory-efficient CUDA kernel refuses a float32 mask with bf16 queries."""
    pos, seg = document_positions(idx, doc_token)
    if (path or attention_path(idx.device)) == "flex":
        return pos, document_block_mask(seg)
    T = idx.shape[1]
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return pos, additive((same & causal)[:, None], dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (Ainslie et al. 2023): ``n_kv_heads`` key and
    value heads each serve ``n_heads / n_kv_heads`` query heads (1 = multi-query, ``n_heads`` =
    multi-head). Optional bias on q, k, v (Qwen2) and RMSNorm over each q and k head (Qwen3)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """``mask``: None for plain causal attention, or :func:`document_mask`'s: a
        :class:`BlockMask` (FlexAttention) or an additive ``(B, 1, T, T)`` (SDPA)."""
        B, T, _ = x.shape
        # (B, T, heads * hd) -> (B, T, heads, hd); heads are the local ones under tensor parallel
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA's own grouped-query broadcasting: on CPU (torch 2.13) it was faster than
        # expanding k and v with repeat_interleave first (bench/attention_gqa.py), and it
        # never materialises the repeated heads. FlexAttention broadcasts the same way.
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, BlockMask):
            y = flex_attend(q, k, v, mask)
        else:
            if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
                # an additive mask must match q (e.g. a float32 mask under bf16 autocast);
                # document_mask builds it in the model's dtype so this copy is the exception
                mask = mask.to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """The gated feed-forward of Shazeer 2020: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

"""Context parallelism (``parallel.cp``): each rank of a cp group holds ``1/cp`` of every
sequence, and attention sees the whole sequence through keys and values all-gathered per layer:
the all-gather form Llama 3 was trained with (Dubey et al. 2024, section 3.3.2), rather than a
ring. Keys and values are the small side of grouped-query attention (``n_kv_heads`` heads), and
an all-gather composes with document masks and with any kernel that takes a mask.

Load balance (the same paper; torchtitan's and Megatron-LM's CP): a sequence is cut into
``2 cp`` chunks and rank ``r`` holds chunk ``r`` and chunk ``2 cp - 1 - r``, a head and a tail,
so every rank's queries see about as many earlier keys under a causal mask.

The model is not changed for it. :meth:`ContextParallel.shard` gives the layout this rank's
tokens, targets and their global positions (restarting at each document when the model masks
documents), and :meth:`ContextParallel.attention` is a ``TorchFunctionMode`` under which each
``F.scaled_dot_product_attention`` call gets the gathered keys and values, in the order the
ranks hold them, and the mask that says which of them each local query may see: earlier
positions of its own document. The kernel follows the device (models/layers.py
``attention_path``): on CUDA, FlexAttention over the gathered keys in global order, with a
block mask built once per batch (causal over global positions, inside each document) that skips
every block a query cannot see, grouped-query heads inside the kernel; on CPU, without document
masks, two flash-attention calls per chunk merged by their log-sum-exp (``_CausalBlocks``, no
mask at all), and with them SDPA with a dense mask. The gather's backward sums the key/value
gradients back to their owners (a reduce-scatter, or all_to_all on gloo).

Shapes: full rows ``x``, ``y`` ``(B, T)``; local ``(B, T / cp)``; per layer ``q``
``(B, heads, T / cp, hd)``, gathered ``k``, ``v`` ``(B, kv_heads, T, hd)``; the mask
``(B, 1, T / cp, T)``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from allhands.mesh import Mesh
from allhands.models.layers import additive, attention_path, document_block_mask, document_positions, flex_attend


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank ``rank`` of ``cp`` holds of a sequence of ``seq_len`` tokens: chunk
    ``rank`` and chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks, in that order."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def documents(x: torch.Tensor, doc_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document indices of full rows ``x`` ``(B, T)``: one document a row when
    ``doc_token`` < 0, else the model's own (models/layers.py)."""
    if doc_token >= 0:
        return document_positions(x, doc_token)
    return torch.arange(x.shape[1], device=x.device).expand_as(x), torch.zeros_like(x)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` whose backward is a reduce-scatter: each rank
    gets the sum of every rank's gradient for its own part. torch.distributed.nn's all_gather
    does this too, but on gloo its backward scatters from group-local ranks as if they were
    global ones, which fails in any cp group that is not ranks 0..cp-1 (torch 2.13, measured
    with tp=2 x cp=2); gloo has no reduce_scatter, so the sum is taken after an all_to_all."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group, n = group, dist.get_world_size(group)
        out = t.new_empty((n * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad, n = grad.contiguous(), dist.get_world_size(ctx.group)
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        parts = torch.empty_like(grad)
        dist.all_to_all_single(parts, grad, group=ctx.group)  # part r of every rank, to rank r
        return parts.view(n, -1, *grad.shape[1:]).sum(0), None


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of this rank's query chunks over the whole sequence without a mask: each
    chunk (global chunk ``g``, ``c`` tokens) attends its prefix ``[0, g c)`` in full and its own
    chunk causally, two flash-attention calls merged by their log-sum-exp; backward runs each
    block's flash backward with the merged output and log-sum-exp, as ring attention does
    (Liu et al. 2023). Only q, k, v, the output and the log-sum-exp are kept: no ``T/cp x T``
    mask or probabilities, and k and v with their own ``kv_heads`` heads (expanded to the query
    heads per block, again in backward). ``q`` ``(B, H, T/cp, hd)``; ``k``, ``v``
    ``(B, kv_heads, T, hd)`` in global order; ``chunks``: the global index of each local chunk. CPU kernels (torch's flash
    attention for CPU); elsewhere the mask path is taken."""

    @staticmethod
    def forward(ctx, q, k, v, chunks):
        c, G = q.shape[2] // len(chunks), q.shape[1] // k.shape[1]
        ctx.chunks, ctx.G = chunks, G

        def kv(t, keys):  # one block of keys or values, one copy per query head of its group
            return t[:, :, keys].repeat_interleave(G, dim=1).contiguous()

        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for j, g in enumerate(chunks):
            qj = q[:, :, j * c:(j + 1) * c].contiguous()
            diag, prefix = slice(g * c, (g + 1) * c), slice(0, g * c)
            o, l = _flash(qj, kv(k, diag), kv(v, diag), 0.0, True)[:2]
            if g:
                op, lp = _flash(qj, kv(k, prefix), kv(v, prefix), 0.0, False)[:2]
                m = torch.logaddexp(lp, l)
                o = op * (lp - m).exp()[..., None].to(o.dtype) + o * (l - m).exp()[..., None].to(o.dtype)
                l = m
            out[:, :, j * c:(j + 1) * c], lse[:, :, j * c:(j + 1) * c] = o, l
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        c, G = q.shape[2] // len(ctx.chunks), ctx.G
        B, kvh, _, hd = k.shape
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, g in enumerate(ctx.chunks):
            rows = slice(j * c, (j + 1) * c)
            args = (grad[:, :, rows].contiguous(), q[:, :, rows].contiguous())
            held = (out[:, :, rows].contiguous(), lse[:, :, rows].contiguous())
            for keys, causal in ((slice(g * c, (g + 1) * c), True), (slice(0, g * c), False)):
                if keys.stop == 0:
                    continue
                gq, gk, gv = _flash_backward(*args, k[:, :, keys].repeat_interleave(G, dim=1).contiguous(),
                                             v[:, :, keys].repeat_interleave(G, dim=1).contiguous(),
                                             *held, 0.0, causal)
                dq[:, :, rows] += gq
                # a kv head's gradient: the sum over the query heads of its group
                dk[:, :, keys] += gk.view(B, kvh, G, -1, hd).sum(2)
                dv[:, :, keys] += gv.view(B, kvh, G, -1, hd).sum(2)
        return dq, dk, dv, None


class _GatheredAttention(TorchFunctionMode):
    def __init__(self, owner: "ContextParallel"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        o = self.owner
        # One gather of k and v stacked: two would be two collectives in backward whose order
        # autograd does not fix across ranks (independent branches), and same-shaped tensors
        # swapped between ranks sum silently wrong (measured).
        kv = _GatherSeq.apply(torch.stack([k, v]).movedim(3, 0), o.group)  # (cp T/cp, 2, B, kvh, hd)
        k, v = kv.movedim(0, 3).unbind(0)  # each (B, kvh, T, hd), the ranks' parts in rank order
        kwargs.pop("is_causal", None)
        return o.attend(q, k, v, func, *args[3:], **kwargs)


class ContextParallel:
    """This rank's part of every sequence and the attention over the whole of it (module doc)."""

    def __init__(self, mesh: Mesh, doc_token: int = -1, path: str | None = None):
        self.group, self.size, self.rank = mesh.group("cp"), mesh.size("cp"), mesh.local_rank("cp")
        self.doc_token = doc_token
        self.path = path  # "flex" or "sdpa"; None: the device's (attention_path)
        self.mask: torch.Tensor | None = None
        self.block_mask = None  # FlexAttention's BlockMask of the batch (the flex path)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa=F.scaled_dot_product_attention,
               *args, **kwargs) -> torch.Tensor:
        """Attention of this rank's queries ``q`` over the gathered ``k``, ``v`` (the ranks'
        parts in rank order), on the path :meth:`shard` chose for the batch."""
        if self.mask is None:  # both kernels take the keys in global order
            k, v = k[:, :, self.order], v[:, :, self.order]
            if self.block_mask is not None:  # CUDA: FlexAttention
                return flex_attend(q, k, v, self.block_mask)
            return _CausalBlocks.apply(q, k, v, self.chunks)  # plain causal on CPU: no mask at all
        if self.mask.dtype != q.dtype:  # bf16 q under FSDP's mixed precision: cast once a forward
            self.mask = self.mask.to(q.dtype)
        kwargs["attn_mask"] = self.mask  # causal over global positions, inside each document
        return sdpa(q, k, v, *args, **kwargs)

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """This rank's tokens and targets of full rows ``x``, ``y`` and the keyword arguments the
        model takes for them (``positions``); sets the mask :meth:`attention` applies."""
        T = x.shape[1]
        if T % (2 * self.size):
            raise ValueError(f"a sequence of {T} tokens does not cut into 2 x parallel.cp="
                             f"{self.size} equal chunks")
        pos, seg = documents(x, self.doc_token)
        mine = chunk_index(T, self.size, self.rank).to(x.device)
        held = torch.cat([chunk_index(T, self.size, r) for r in range(self.size)]).to(x.device)
        self.order, self.block_mask = torch.argsort(held), None
        if (self.path or attention_path(x.device)) == "flex":
            # one block mask a batch: a query block of one chunk sees its prefix, the blocks past
            # it are skipped, so the kernel does the causal half of the work
            self.mask, self.block_mask = None, document_block_mask(seg, queries=mine)
            return x[:, mine], y[:, mine], {"positions": pos[:, mine]}
        if self.doc_token < 0 and x.device.type == "cpu":  # no mask needed: _CausalBlocks
            self.mask = None
            self.chunks = [self.rank, 2 * self.size - 1 - self.rank]
            return x[:, mine], y[:, mine], {"positions": pos[:, mine]}
        # query i (global position mine[i]) may see gathered key j (global position held[j])
        causal = held[None, :] <= mine[:, None]
        same = seg[:, mine][:, :, None] == seg[:, held][:, None, :]
        self.mask = additive((causal[None] & same)[:, None])
        return x[:, mine], y[:, mine], {"positions": pos[:, mine]}

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        with _GatheredAttention(self):
            yield

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the cp group of each rank's loss on its part (equal parts): the loss
        of the whole sequences, for logging."""
        out = loss.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out / self.size

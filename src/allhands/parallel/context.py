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
positions of its own document. Its backward sums the key/value gradients back to their
owners (torch.distributed.nn's all_gather: a reduce-scatter, or all_to_all on gloo).

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
from torch.distributed.nn.functional import all_gather
from torch.overrides import TorchFunctionMode

from allhands.mesh import Mesh
from allhands.models.layers import additive, document_positions


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
        k, v = torch.cat(all_gather(torch.stack([k, v]), group=o.group), dim=3).unbind(0)
        kwargs.pop("is_causal", None)
        kwargs["attn_mask"] = o.mask  # causal over global positions, inside each document
        return func(q, k, v, *args[3:], **kwargs)


class ContextParallel:
    """This rank's part of every sequence and the attention over the whole of it (module doc)."""

    def __init__(self, mesh: Mesh, doc_token: int = -1):
        self.group, self.size, self.rank = mesh.group("cp"), mesh.size("cp"), mesh.local_rank("cp")
        self.doc_token = doc_token
        self.mask: torch.Tensor | None = None

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

"""The mixture-of-experts feed-forward of the decoder family, written once: a top-k router
(softmax or sigmoid scores), routed SwiGLU experts computed as grouped GEMMs, optional shared
experts; dropless (every token reaches all of its k experts, whatever the imbalance).

Shapes: ``x`` ``(B, T, H)`` is flattened to ``N = B T`` tokens; the router gives each token
``k`` experts of ``E``; the ``N k`` (token, expert) pairs are sorted by expert, so expert ``e``
sees a contiguous run of ``counts[e]`` rows, and the three expert matrices are stacked
``(E, out, in)`` like ``nn.Linear`` weights (which is how transformers stores one expert).

Load balancing, chosen by ``balance``:

- ``aux``: the auxiliary loss of Switch Transformer / Mixtral (Fedus et al. 2021),
  ``aux_coef * E * sum_e f_e P_e`` with ``f_e`` the share of routed pairs sent to ``e`` and
  ``P_e`` its mean score. It reaches the gradient without the training loss knowing: the layer's
  output passes through :class:`AuxLoss`, an identity whose backward adds the gradient of
  ``aux_scale * aux`` (Megatron-LM's ``MoEAuxLossAutoScaler``), so the loss function, pipeline
  stages and activation checkpointing need no change. ``aux_scale`` is the weight the loop gives
  this micro-batch's loss (parallel/layout.py sets it); ``last_aux`` keeps the value for metrics.
- ``bias``: DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024): a per-expert bias is
  added to the scores for the top-k choice only, and after each optimizer step moved by
  ``bias_rate`` towards balance (:func:`update_expert_bias`); the weights stay the raw scores.
- ``none``.

Expert parallelism (parallel/expert.py) sets ``dispatcher``: it moves the sorted rows to the
ranks holding their experts and back; without one every expert is local. Under tensor
parallelism the layer runs whole on every tp rank on plain tensors (routing, sorting and
scattering have no DTensor rules): its parameters are replicated DTensors there, read through
:func:`local` (parallel/tensor.py ``LocalReplicate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from allhands import collective
from allhands.models.layers import SwiGLU


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter as the plain tensor this rank computes with (a DTensor's local part)."""
    return t.to_local() if hasattr(t, "to_local") else t


def swiglu(m: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """:class:`SwiGLU` ``m`` on plain ``x`` whatever its parameters are (see :func:`local`)."""
    gate, up, down = (local(lin.weight) for lin in (m.gate_proj, m.up_proj, m.down_proj))
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass(frozen=True)
class MoEArgs:
    """The MoE shape of a decoder; ``n_experts = 0`` is a dense model."""

    n_experts: int = 0
    top_k: int = 2
    hidden: int = 0  # width of one routed expert; 0 = the dense ffn_hidden
    n_shared: int = 0  # shared experts every token passes through (DeepSeekMoE)
    shared_hidden: int = 0  # width of the shared SwiGLU; 0 = n_shared * hidden
    shared_gate: bool = False  # Qwen2-MoE: the shared output scaled by sigmoid(w . x)
    score: str = "softmax"  # softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the k weights of a token to sum to 1
    balance: str = "aux"  # aux, bias or none
    aux_coef: float = 0.01
    bias_rate: float = 1e-3
    every: int = 1  # layer i is MoE when (i + 1) % every == 0 (Qwen's decoder_sparse_step) ...
    first_dense: int = 0  # ... and i >= first_dense (DeepSeek's first_k_dense_replace)

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.first_dense and (layer + 1) % self.every == 0

    def expert_hidden(self, dense_hidden: int) -> int:
        return self.hidden or dense_hidden

    def shared_width(self, dense_hidden: int) -> int:
        return self.shared_hidden or self.n_shared * self.expert_hidden(dense_hidden)

    def check(self) -> None:
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"score {self.score!r}: allowed softmax, sigmoid")
        if self.balance not in ("aux", "bias", "none"):
            raise ValueError(f"balance {self.balance!r}: allowed aux, bias, none")


def compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast gives ``x``'s GEMMs, None outside autocast.

    The experts cast to it themselves: autocast casts only the ops it lists, and neither
    ``_grouped_mm`` nor the gathers and scatters around it are among them. Under ZeRO-0/1
    (autocast over fp32 parameters) the rows and the expert weights would reach
    :func:`grouped_mm` in fp32 and take the padded fallback, where FSDP's bf16 parameters
    (ZeRO-2/3) take the grouped kernel."""
    t = x.device.type
    return torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else None


def takes_grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``torch._grouped_mm``: on CUDA in bf16 (Hopper and
    later) with 16-byte aligned rows. On CPU (torch 2.13) ``_grouped_mm`` runs forward in fp32
    but its backward fails ("Invalid strides"), so the CPU takes the fallback."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and hasattr(torch, "_grouped_mm"))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` ``(M, in)`` rows sorted by group, ``counts`` ``(G,)`` rows per group, ``w``
    ``(G, out, in)``: row ``i`` of group ``g`` times ``w[g].T``, ``(M, out)``.

    One ``torch._grouped_mm`` kernel where :func:`takes_grouped_kernel`, without a host sync
    (the group offsets stay on the device); elsewhere :func:`padded_mm`."""
    if takes_grouped_kernel(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return padded_mm(x, w, counts)


def padded_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` as one batched GEMM: the rows are scattered into ``(G, L, in)`` with
    ``L`` the largest group (zeros elsewhere), multiplied by ``torch.bmm`` and gathered back.
    The padding costs ``G L - M`` idle rows: nothing when routing is even, ``(G-1) M`` when every
    row goes to one group."""
    group, pos = _positions(counts, x.shape[0])
    L = int(counts.max()) if x.shape[0] else 0
    pad = x.new_zeros(w.shape[0], L, x.shape[1]).index_put((group, pos), x)
    return torch.bmm(pad, w.transpose(1, 2))[group, pos]


def _positions(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group of each sorted row, its index inside the group), both ``(rows,)``."""
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    start = counts.cumsum(0) - counts
    return group, torch.arange(rows, device=counts.device) - start[group]


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's recompute inside backward (the routed
    pairs were counted by the forward it repeats): the autograd engine is running a graph task."""
    return torch._C._current_graph_task_id() != -1


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts, ``down(silu(gate x) * up x)``, their weights stacked ``(n, out, in)``.
    Under expert parallelism the parameters are DTensors sharded on dim 0 and this rank computes
    its local ``n / ep`` experts."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))

    def reset_parameters(self, std: float, std_out: float) -> None:
        for p, s in ((self.gate_proj, std), (self.up_proj, std), (self.down_proj, std_out)):
            nn.init.normal_(p, mean=0.0, std=s)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(M, dim)`` sorted by local expert, ``counts`` ``(n_local,)`` -> ``(M, dim)``,
        in autocast's dtype where autocast is on (see :func:`compute_dtype`)."""
        g, u, d = self.local_weights()
        dtype = compute_dtype(x)
        if dtype is not None:
            x, g, u, d = (t.to(dtype) for t in (x, g, u, d))
        h = F.silu(grouped_mm(x, g, counts)) * grouped_mm(x, u, counts)
        return grouped_mm(h, d, counts)

    def reference(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same, one expert at a time (the oracle of the tests)."""
        g, u, d = self.local_weights()
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            xe = x[start:start + c]
            out.append(F.linear(F.silu(F.linear(xe, g[e])) * F.linear(xe, u[e]), d[e]))
            start += c
        return torch.cat(out) if out else x.new_zeros(0, x.shape[1])


class Router(nn.Module):
    """Scores ``(N, E)`` of each token for each expert and its top-k choice."""

    def __init__(self, dim: int, a: MoEArgs):
        super().__init__()
        self.a = a
        self.gate = nn.Linear(dim, a.n_experts, bias=False)
        # DeepSeek-V3's balancing bias: state, not a parameter (no gradient), checkpointed
        self.register_buffer("expert_bias", torch.zeros(a.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights ``(N, k)`` float32, experts ``(N, k)``, scores ``(N, E)`` float32)."""
        logits = F.linear(x, local(self.gate.weight)).float()
        scores = logits.softmax(-1) if self.a.score == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.a.balance == "bias" else scores
        _, idx = torch.topk(choose, self.a.top_k, dim=-1)
        weights = scores.gather(-1, idx)
        if self.a.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, idx, scores


class AuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends ``scale`` into ``aux`` (a scalar), so the
    auxiliary loss is trained as if added to the loss (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MoE(nn.Module):
    """The MoE feed-forward: ``(B, T, H) -> (B, T, H)``."""

    def __init__(self, dim: int, dense_hidden: int, a: MoEArgs):
        super().__init__()
        a.check()
        self.a = a
        self.router = Router(dim, a)
        self.experts = GroupedExperts(a.n_experts, dim, a.expert_hidden(dense_hidden))
        width = a.shared_width(dense_hidden)
        self.shared = SwiGLU(dim, width) if width else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if a.shared_gate else None
        self.dispatcher = None  # parallel/expert.py: rows to the ranks of their experts and back
        self.aux_scale = 1.0
        self.last_aux: torch.Tensor | None = None
        # routed pairs per expert since the last bias update (int64: model.to(dtype) keeps it),
        # and since the last logged step (parallel/moe_metrics.py)
        self.register_buffer("load", torch.zeros(a.n_experts, dtype=torch.long), persistent=False)
        self.register_buffer("tokens", torch.zeros(a.n_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        weights, idx, scores = self.router(flat)
        k = idx.shape[1]
        pairs = idx.reshape(-1)  # (N k,) expert of each (token, choice) pair
        order = torch.argsort(pairs, stable=True)  # pairs grouped by expert, tokens in order
        # not bincount: on CUDA it reads the max of its input on the host
        counts = torch.zeros(self.a.n_experts, dtype=torch.long, device=pairs.device)
        counts = counts.scatter_add_(0, pairs, torch.ones_like(pairs))
        token = order // k
        rows = flat[token]
        dtype = compute_dtype(rows)
        if dtype is not None:  # the dispatch under ep sends the rows in the dtype they compute in
            rows = rows.to(dtype)
        if self.dispatcher is None:
            ys = self.experts(rows, counts)
        else:
            ys = self.dispatcher(rows, counts, self.experts)
        # back in the residual stream's dtype: fp32 under autocast, which index_add does not cast
        ys = ys.to(flat.dtype) * weights.reshape(-1)[order].unsqueeze(1).to(flat.dtype)
        out = torch.zeros_like(flat).index_add(0, token, ys)
        if self.shared is not None:
            s = swiglu(self.shared, flat)
            if self.shared_gate is not None:
                s = torch.sigmoid(F.linear(flat, local(self.shared_gate.weight))) * s
            out = out + s
        if self.training and not recomputing():
            with torch.no_grad():
                self.load += counts
                self.tokens += counts
        if self.training and self.a.balance == "aux" and self.a.aux_coef > 0:
            f = counts.to(scores.dtype) / pairs.numel()
            p = scores if self.a.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = self.a.aux_coef * self.a.n_experts * (f * p.mean(0)).sum()
            self.last_aux = aux.detach()
            out = AuxLoss.apply(out, aux, self.aux_scale)
        return out.view(B, T, H)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """The weight of this micro-batch's loss, given to every MoE layer's auxiliary loss."""
    for m in moe_layers(model):
        m.aux_scale = scale


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's bias step, after an optimizer step: ``b_e += rate * sign(mean load - load_e)``
    over the loads of every data-parallel rank (summed over ``group``), so every rank moves its
    copy of the bias alike; then the loads restart from zero."""
    layers = [m for m in moe_layers(model) if m.a.balance == "bias"]
    if not layers:
        return
    loads = torch.stack([m.load for m in layers]).double()
    if group is not None and dist.get_world_size(group) > 1:
        collective.all_reduce(loads, call="update_expert_bias", group=group)
    for m, load in zip(layers, loads):
        step = m.a.bias_rate * torch.sign(load.mean() - load)
        m.router.expert_bias += step.to(m.router.expert_bias)
        m.load.zero_()

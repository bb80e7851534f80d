"""Expert parallelism (GShard, Lepikhin et al. 2020; TorchTitan's ``ExpertParallel``): each of
the ``ep`` ranks of an expert group holds ``E / ep`` of every MoE layer's experts, and the rows
routed to an expert travel to its rank and back by ``all_to_all_single`` with variable splits.

One MoE layer's forward on a rank (``N k`` routed rows, sorted by expert, models/moe.py):

1. the per-expert row counts ``(E,)`` are exchanged (one small all_to_all), so every rank knows
   how many rows it receives from each peer for each of its local experts;
2. dispatch: rows to the ranks of their experts (ranks hold contiguous experts, so the rows for
   one rank are one contiguous run); the received rows, grouped by source rank, are regrouped by
   local expert for the grouped GEMM;
3. combine: the outputs go back by the reverse all_to_all, in the order they came.

Both exchanges are :class:`AllToAll`, whose backward is the reverse exchange, so gradients
follow the rows back. Under activation checkpointing a recomputed block exchanges again, in the
same order on every rank.

Parameters: the experts' matrices become DTensors ``Shard(0)`` over the ``ep`` mesh dim, with the
global shape ``(E, out, in)`` under their single-device FQNs, so a checkpoint written at one
``ep`` loads at another (DCP reshards). Each expert sees rows from all ``ep`` ranks, so its
gradient is already the sum over those ranks' losses; what remains is the sum over the ``edp``
groups holding the same experts and the 1/dp of the data-parallel mean: under ZeRO-2/3 experts
get an FSDP unit of their own over ``edp`` whose gradient divide factor is dp
(:func:`shard_experts`); replicated layouts leave them out of DDP and reduce them once after
backward (:func:`reduce_expert_grads`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from allhands import collective
from allhands.mesh import Mesh
from allhands.models.moe import GroupedExperts, MoE, moe_layers


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows ``x`` ``(sum(send), H)`` -> ``(sum(recv), H)``;
    backward sends the gradients the reverse way. ``meter`` (a :class:`Dispatcher`) adds the
    seconds of both."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group, meter):
        ctx.recv, ctx.send, ctx.group, ctx.meter = recv, send, group, meter
        t = time.perf_counter()
        out = x.new_empty(sum(recv), *x.shape[1:])
        collective.all_to_all_single(out, x.contiguous(), recv, send, call="expert dispatch", group=group)
        meter.seconds += time.perf_counter() - t
        return out

    @staticmethod
    def backward(ctx, grad):
        t = time.perf_counter()
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        collective.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, call="expert dispatch (backward)",
                                     group=ctx.group)
        ctx.meter.seconds += time.perf_counter() - t
        return back, None, None, None, None


class Dispatcher:
    """Moves one MoE layer's sorted rows to the ranks of their experts and back (see above).
    Counts what it moves: ``bytes`` (payload this rank sends to other ranks in the forward
    dispatch and combine; backward sends the same again) and ``seconds`` (inside the exchanges,
    forward and backward), summed until :func:`comm_stats` reads them."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep
        self.bytes = 0
        self.seconds = 0.0

    def _exchange(self, x, recv, send, me: int):
        out = AllToAll.apply(x, recv, send, self.group, self)
        self.bytes += (sum(send) - send[me]) * x[0].numel() * x.element_size() if x.numel() else 0
        return out

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts):
        ep, n = self.ep, counts.numel()
        local = n // ep
        me = dist.get_rank(self.group)
        recv_counts = torch.empty_like(counts)
        # (ep src, local) after view
        collective.all_to_all_single(recv_counts, counts, call="expert counts", group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        by_src = recv_counts.view(ep, local)
        recv = by_src.sum(1).tolist()
        got = self._exchange(rows, recv, send, me)  # grouped by source rank, then local expert
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=counts.device).repeat(ep), recv_counts)
        order = torch.argsort(expert_of, stable=True)
        ys = experts(got[order], by_src.sum(0))
        back = torch.empty_like(ys).index_copy(0, order, ys)  # the order they arrived in
        return self._exchange(back, send, recv, me)


def apply_ep(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Give every MoE layer of ``model`` its dispatcher and keep only this rank's experts, as
    ``Shard(0)`` DTensors over the ``ep`` dim (the full experts are on every rank before, alike)."""
    ep = mesh.size("ep")
    emesh = mesh.submesh("ep")
    me = mesh.local_rank("ep")
    for m in moe_layers(model):
        n = m.a.n_experts
        if n % ep:
            raise ValueError(f"parallel.ep={ep} must divide moe.n_experts={n}")
        ex = m.experts
        for name, p in list(ex.named_parameters(recurse=False)):
            whole = p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # tp: replicated
            block = whole[me * (n // ep):(me + 1) * (n // ep)].clone()
            setattr(ex, name, nn.Parameter(DTensor.from_local(block, emesh, [Shard(0)],
                                                              run_check=False)))
        m.dispatcher = Dispatcher(mesh.group("ep"), ep)
    return model


def ddp_ignored(model: nn.Module) -> list[str]:
    """FQNs DDP must leave alone: every MoE layer's per-rank load counter (DDP would broadcast
    rank 0's over the others' before each forward) and, under expert parallelism, the expert
    matrices (each rank holds other experts; :func:`reduce_expert_grads` reduces them)."""
    out = []
    for mn, mod in model.named_modules():
        if isinstance(mod, MoE):
            out += [f"{mn}.load", f"{mn}.tokens"]
            if mod.dispatcher is not None:
                out += [f"{mn}.experts.{pn}" for pn, _ in mod.experts.named_parameters()]
    return out


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The expert matrices of every expert-parallel MoE layer (what data parallelism leaves to
    :func:`reduce_expert_grads` or :func:`shard_experts`)."""
    return {p for m in moe_layers(model) if m.dispatcher is not None for p in m.experts.parameters()}


def shard_experts(model: nn.Module, mesh: Mesh, *, reshard_after_forward: bool, mp_policy) -> None:
    """ZeRO-2/3: each MoE layer's experts an FSDP unit over ``edp`` (the ranks holding the same
    experts), their reduce-scatter dividing by all dp ranks: the expert gradient already sums the
    ep ranks' losses (TorchTitan sets the same factor)."""
    from torch.distributed.fsdp import fully_shard

    for m in moe_layers(model):
        fully_shard(m.experts, mesh=mesh.submesh("edp"), reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy)
        m.experts.set_gradient_divide_factor(float(mesh.dp_size))


def reduce_expert_grads(parts: list[nn.Module], mesh: Mesh) -> None:
    """Replicated layouts after the step's last backward: sum each expert gradient over ``edp``
    and divide by dp, the data-parallel mean DDP takes of every other gradient."""
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for part in parts for m in moe_layers(part)
             for g in (p.grad for p in m.experts.parameters()) if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if mesh.size("edp") > 1:
        collective.all_reduce(flat, call="reduce_expert_grads", group=mesh.group("edp"))
    flat /= mesh.dp_size
    start = 0
    for g in grads:
        g.copy_(flat[start:start + g.numel()].view_as(g))
        start += g.numel()


def comm_stats(parts: list[nn.Module]) -> tuple[int, float]:
    """(all_to_all bytes sent, seconds in the exchanges) since the last call, over every MoE
    layer of this rank; resets the counts."""
    total_b, total_s = 0, 0.0
    for part in parts:
        for m in moe_layers(part):
            d = m.dispatcher
            if isinstance(d, Dispatcher):
                total_b, total_s = total_b + d.bytes, total_s + d.seconds
                d.bytes, d.seconds = 0, 0.0
    return total_b, total_s


def is_expert_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, MoE) and m.dispatcher is not None for m in model.modules())

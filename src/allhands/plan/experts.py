"""What a mixture of experts adds to a layout's price (parallel/expert.py's scheme): the routed
experts' training state, split over ``ep`` and, under ZeRO-2/3, sharded over the ``edp = dp / ep``
ranks that hold the same experts; the all_to_all that carries each MoE layer's routed rows to
their experts' ranks and back; and the expert gradients' reduction over ``edp``.

Dispatch and combine each move a rank's ``tokens x top_k`` rows of ``C`` values, of which the
``(ep - 1) / ep`` bound for other ranks leave it (balanced routing): four exchanges a layer and
microbatch (dispatch and combine forward, their reverse in backward), two more when a checkpointed
block recomputes its forward, each after a small exchange of the per-expert row counts. They sit
between the router and the experts, so none of it overlaps compute.
"""

from __future__ import annotations

from allhands.plan.cluster import ring_bytes
from allhands.plan.decoder import Decoder


def stage_experts(d: Decoder, layers: range) -> tuple[int, int]:
    """(routed-expert parameters of every expert of ``layers``' MoE layers, their tensor count)."""
    k = d.moe_in(layers)
    return k * d.expert_params(), 3 * k


def expert_shard(layout) -> int:
    """Ranks one rank's routed experts are sharded over: ``edp = dp / ep`` under ZeRO-2/3."""
    return layout.dp // layout.ep if layout.zero >= 2 else 1


def expert_state(layout, numel: int, tensors: int, adam: int) -> dict[str, float]:
    """Bytes of the routed experts' fp32 parameters, gradients and optimizer state on one rank:
    ``numel`` (all experts of its stage) / ep, then / edp under ZeRO-2/3 (their own FSDP units
    over ``edp``); replicated layouts keep the rank's experts whole."""
    shard = expert_shard(layout)
    p = 4.0 * numel / layout.ep / shard
    optim = adam / 4 * p + 4.0 * tensors * (adam > 0) / shard
    return {"params": p, "grads": p, "optim": optim}


def a2a_bytes(d: Decoder, tokens: float, ep: int, act_bytes: int) -> float:
    """Bytes one rank sends in one dispatch (or combine) of one MoE layer: ``tokens x top_k x C``
    values, the ``(ep - 1) / ep`` of them routed to other ranks."""
    return tokens * d.top_k * d.c * act_bytes * (ep - 1) / ep


def a2a_seconds(d: Decoder, layout, tokens: float, act_bytes: int, bw: float, latency: float) -> float:
    """Seconds of all_to_all per MoE layer and microbatch of ``tokens`` tokens."""
    if layout.ep <= 1 or not d.moe_layers:
        return 0.0
    exchanges = 4 + 2 * (layout.ac == "block")
    return exchanges * (2 * latency + a2a_bytes(d, tokens, layout.ep, act_bytes) / bw)


def expert_grad_comm(layout, pbytes: float, units: int, bw: float, latency: float, bf16: bool,
                     reduce_bf16: bool, spare: float) -> tuple[float, float]:
    """(seconds of the experts' data-parallel communication over ``edp`` per step, the part of it
    exposed) for ``pbytes`` of a rank's fp32 expert parameters in ``units`` FSDP units: replicated
    layouts all-reduce their gradients once after backward (all exposed); ZeRO-2/3 gather and
    reduce-scatter each unit, hidden by the ``spare`` compute the dense units leave but one unit."""
    n = layout.dp // layout.ep
    if n <= 1 or pbytes <= 0:
        return 0.0, 0.0
    if layout.zero == 0:
        t = ring_bytes("allreduce", pbytes, n) / bw + latency
        return t, t
    gather = ring_bytes("allgather", pbytes / 2 if bf16 else pbytes, n) / bw * (2 if layout.zero == 3 else 1)
    reduce = ring_bytes("reducescatter", pbytes / 2 if bf16 and reduce_bf16 else pbytes, n) / bw
    t = gather + reduce + latency * units * (3 if layout.zero == 3 else 2)
    return t, max(t - spare, t / max(1, units))

"""Per-rank memory and step time of one layout of a shipped decoder (the reference GPT or the
Llama family, whose shapes decoder.py prices) on one cluster.

Memory, counted the way allhands measures it (memory.py): training state from the parameters
each rank holds (tp shards, its pipeline stage's blocks, 1/N under ZeRO; the ZeRO formulas,
Rajbhandari et al. 2020), plus activations (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models": with SDPA no T x T matrix is stored, so about
17 B T C values per block without recomputation (16 without dropout), 10 with the selective
policy, the block input with full checkpointing; / tp under sequence parallelism), in-flight
pipeline microbatches (by schedule and rank: schedule.py), the full parameters FSDP gathers, and
the runtime's own bytes.

Time: matmul FLOPs at ``gemm_eff`` of peak (less for narrow matrices), attention at its own
kernel's share (kernels.py), element-wise traffic at ``ew_eff`` of memory bandwidth, a cost per
eager op (fewer under compile, which fuses each block), ring collectives
(all-reduce 2(n-1)/n B, all-gather/reduce-scatter (n-1)/n B) on the link their mesh dim spans
(between nodes, the NICs of the group's members on a node), the part of data-parallel
communication that backward/forward cannot hide (at most ``overlap`` of it), and the pipeline
schedule's bubble on the busiest rank (schedule.py). A mixture of experts adds its routed
experts' state, all_to_all and expert-gradient reduction (experts.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from allhands.config import Config
from allhands.plan.cluster import Cluster, ring_bytes as _ring
from allhands.plan.comm import bandwidth as _bw, dp_comm
from allhands.plan.layout import Layout
from allhands.plan.decoder import Decoder
from allhands.plan.experts import a2a_seconds, expert_grad_comm, expert_shard, expert_state, stage_experts
from allhands.plan.kernels import kernel_seconds, matmul_size_factor
from allhands.plan.localtime import PARTIAL_REDUCES, local_step, partial_grad_tensors
from allhands.plan.muon import hidden_matrices, muon_seconds, muon_state_saving
from allhands.plan.schedule import bubble as _bubble, in_flight as _in_flight, rank_layers, stage_blocks

# Values kept per block per token per C (see the docstring), by parallel.ac. Without recomputation,
# Korthikanti et al.'s 34 bytes (16-bit activations) include two 1-byte dropout masks (attention
# output, MLP output): 17 values with dropout; without it (model.dropout=0: ATen's dropout returns
# its input when p is 0 and stores no mask) the 32 bytes left are 16 values.
ACT_PER_BLOCK = {"none": 17, "selective": 10, "block": 1}
DROPOUT_MASK_BYTES = 2
# Eager ops per block forward+backward and element-wise tensor passes per block (B T C each),
# and what per-block compile leaves (one fused kernel per chain of element-wise ops).
OPS_PER_BLOCK = {False: 60, True: 16}
EW_PASSES = {False: 40, True: 14}
# Attention without a fused kernel (Megatron-LM's of 2021: baddbmm, FusedScaleMaskSoftmax, dropout,
# bmm) stores the T x T scores per head and reads and writes them in element-wise kernels: forward,
# the softmax (read, write) and the dropout (read, write, a 1-byte mask), 4.5 passes; backward, the
# dropout's (grad and mask in, grad out) and the softmax's (probabilities and grad in, grad out), 5.5.
SCORE_PASSES_FWD = 4.5
SCORE_PASSES = SCORE_PASSES_FWD + 5.5


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)  # bytes, the busiest rank
    state_rank: list[float] = field(default_factory=list)  # training-state bytes per pp stage
    time: dict[str, float] = field(default_factory=dict)  # seconds per step
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    reason: str = ""  # why it cannot run; empty when it can
    params: int = 0  # the model's parameters, every expert of a mixture of experts
    active: int = 0  # those a token passes through (top_k experts)
    interval: tuple[float, float] = (0.0, 0.0)  # tokens/s, low and high (the cluster's interval); 0: unknown
    unverified: str = ""  # what the prediction rests on that no run has checked (:func:`unverified`)

    @property
    def feasible(self) -> bool:
        return not self.reason


def _stage_layers(n_layer: int, pp: int) -> list[range]:
    blocks = stage_blocks(n_layer, pp)
    return [range(sum(blocks[:s]), sum(blocks[:s + 1])) for s in range(pp)]


def _held_params(d: Decoder, layers: list[range], first: bool, last: bool, tp: int, pp: int) -> tuple[int, int]:
    """(parameters, tensors) of the blocks ``layers`` plus the embedding / the head and norm."""
    numel = tensors = 0
    per, per_tensors = _block(d, tp, False)
    per_moe, moe_tensors = _block(d, tp, True)
    for rng in layers:
        moe = d.moe_in(rng)
        numel += (len(rng) - moe) * per + moe * per_moe
        tensors += (len(rng) - moe) * per_tensors + moe * moe_tensors
    if first:
        numel, tensors = numel + d.first_params(tp)[0], tensors + d.first_params(tp)[1]
    if last:
        numel, tensors = numel + d.last_params(tp, pp)[0], tensors + d.last_params(tp, pp)[1]
    return numel, tensors


def stage_params(cfg: Config, pp: int, tp: int, stage: int) -> tuple[int, int]:
    """(parameters this rank holds before data-parallel sharding, their tensor count) on pipeline
    stage ``stage``: tp shards q/k/v (or qkv) and fc (or gate/up) column-wise with their biases,
    the output projections row-wise, the embedding and head over the vocabulary; norms, position
    embedding and row biases are replicated (parallel/tensor.py's plans; decoder.py). Routed
    experts are not counted here (experts.py's ``stage_experts``): ep splits them, not tp."""
    d = Decoder.of(cfg.model, cfg.moe)
    return _held_params(d, [_stage_layers(d.n_layer, pp)[stage]], stage == 0, stage == pp - 1, tp, pp)


def _threads(cluster: Cluster) -> int:
    return max(1, (os.cpu_count() or 1) // cluster.per_node)


@functools.lru_cache(maxsize=64)
def _sizes(d: Decoder) -> tuple[int, int]:
    """(all parameters, active ones): the same for every layout a search scores."""
    return d.params(), d.active_params()


@functools.lru_cache(maxsize=256)
def _block(d: Decoder, tp: int, moe: bool) -> tuple[int, int]:
    return d.block_params(tp, moe)


def unverified(layout: Layout, cluster: Cluster) -> str:
    """What a layout's prediction on ``cluster`` rests on that no run has checked: on a GPU
    cluster every path (allhands has not trained on a GPU yet: docs/gpu.md), named by the parts
    the layout uses; on this machine nothing (``plan --check`` trains it)."""
    if cluster.device != "cuda":
        return ""
    parts = ["DDP" if layout.zero == 0 else "ZeRO-1" if layout.zero == 1 else f"FSDP (zero {layout.zero})"]
    parts += ["tp"] if layout.tp > 1 else []
    parts += ["cp (FlexAttention)"] if layout.cp > 1 else []
    parts += ["ep"] if layout.ep > 1 else []
    parts += [f"pp {layout.schedule}"] if layout.pp > 1 else []
    parts += ["compile"] if layout.compile else []
    return "verified only by reading, not run on a GPU: " + ", ".join(parts)


def train_state(layout: Layout, p: float, tensors: int, adam: int) -> dict[str, float]:
    """Bytes of fp32 parameters ``p`` (``tensors`` tensors), their gradients and ``adam`` bytes
    of optimizer state per parameter (plus AdamW's step counter per tensor) on one rank."""
    n = layout.dp_shard
    optim = adam / 4 * p + 4.0 * tensors * (adam > 0)
    if layout.zero == 0:
        return {"params": p, "grads": p, "optim": optim}
    if layout.zero == 1:
        return {"params": p, "grads": p, "optim": optim / n}
    return {"params": p / n, "grads": p / n, "optim": optim / n}


def _act_none(cfg: Config, act_bytes: int) -> float:
    """Values a block keeps per token per C without recomputation (ACT_PER_BLOCK's note)."""
    masks = DROPOUT_MASK_BYTES / act_bytes if cfg.model.dropout > 0 else 0.0
    return ACT_PER_BLOCK["none"] - DROPOUT_MASK_BYTES / 2 + masks


def estimate(cfg: Config, layout: Layout, cluster: Cluster, bf16: bool, *, attention: str = "fused",
             overlap_dp: bool = True, loss: str = "fp32") -> Estimate:
    """``attention="materialized"``, ``overlap_dp=False`` and ``loss="fused"`` describe other
    software than allhands (bench/plan.py's published runs): attention computed over a stored T x T
    score matrix instead of a fused kernel (SDPA, FlashAttention); DDP's all-reduce after backward,
    not during it; a fused cross-entropy kernel that reads the bf16 logits and writes their bf16
    gradient, with no fp32 copy (flash-attn's ``flash_attn.losses.cross_entropy.CrossEntropyLoss``,
    which saves the logits and a log-sum-exp per row, llm-foundry's default ``loss_fn``)."""
    r, d = cfg.run, Decoder.of(cfg.model, cfg.moe)
    seq_layout, layout = layout, layout.grad_view()  # cp: sequences cut, parameters as dp's
    cp = seq_layout.cp
    c, t, v, tp, pp, n = d.c, d.t // cp, d.v, layout.tp, layout.pp, layout.dp_shard
    est = Estimate(seq_layout, params=_sizes(d)[0], active=_sizes(d)[1])
    act_bytes = 2 if bf16 else 4
    adam = 8 if cfg.optim.name in ("adamw", "muon") else 0  # muon: AdamW's on all but the matrices
    muon = cfg.optim.name == "muon"
    # samples per forward on one rank: global batch / data-parallel ranks / accumulation / microbatches
    # (the cp ranks of a group share samples, each t = T / cp of their tokens)
    mb = r.global_batch / (layout.dp / cp * r.micro_batches * layout.microbatches)
    spr = layout.stages_per_rank if pp > 1 else 1
    held = rank_layers(d.n_layer, pp, spr, layout.schedule)  # per pp rank: its blocks, first, last
    blocks = [sum(len(rng) for rng in h[0]) for h in held]
    moes = [sum(d.moe_in(rng) for rng in h[0]) for h in held]
    worst = None
    for rank, (ranges, first, last) in enumerate(held):
        in_flight = _in_flight(layout.schedule, pp, spr, layout.microbatches, rank)
        numel, tensors = _held_params(d, ranges, first, last, tp, pp)
        p = 4.0 * numel
        state = train_state(layout, p, tensors, adam)
        if muon:  # one momentum buffer on the hidden matrices, not two moments
            state["optim"] -= muon_state_saving(hidden_matrices(d, blocks[rank], moes[rank]),
                                                tp, n if layout.zero else 1)
        e_numel = sum(stage_experts(d, rng)[0] for rng in ranges)
        e_tensors = sum(stage_experts(d, rng)[1] for rng in ranges)
        experts = expert_state(layout, e_numel, e_tensors, adam)
        state = {k: v + experts[k] for k, v in state.items()}
        est.state_rank.append(sum(state.values()))
        table = {**ACT_PER_BLOCK, "none": _act_none(cfg, act_bytes)}
        per_token = d.act_values(layout.ac, table)
        per_block = per_token * mb * t * c / tp * act_bytes
        moe = moes[rank]  # their feed-forward whole on every tp rank
        moe_extra = (d.ffn_act_values(layout.ac, True) - d.ffn_act_values(layout.ac) / tp) * mb * t * c * act_bytes
        acts = in_flight * (blocks[rank] * per_block + moe * moe_extra)
        if cp > 1 and layout.ac != "block":  # the gathered keys and values SDPA saves, T not T/cp
            acts += in_flight * blocks[rank] * 2 * mb * (d.t - t) * d.n_kv * d.hd / tp * act_bytes
        if layout.ac == "block":  # one block's intermediates live again during its recompute
            acts += d.act_values("none", table) * mb * t * c / tp * act_bytes
        if last:  # logits, their fp32 copy for the loss and its gradient; fused: the
            # logits and their gradient, both in the activations' dtype
            acts += 3 * mb * t * v * 4 if loss == "fp32" else 2 * mb * t * v * act_bytes
        block_params = 4.0 * _block(d, tp, False)[0] * (2 / 4 if bf16 and layout.zero >= 2 else 1)
        layer_experts = 4.0 * d.expert_params() / layout.ep * (2 / 4 if bf16 and layout.zero >= 2 else 1)
        gathered = {0: p / 2 if bf16 else 0.0, 1: p / 2 if bf16 else 0.0,
                    2: blocks[rank] * block_params + moe * layer_experts,
                    3: 2 * block_params + min(moe, 2) * layer_experts}[layout.zero]
        mem = {**state, "activations": acts, "buffers": gathered + cluster.runtime}
        mem["total"] = sum(mem.values())
        if worst is None or mem["total"] > worst["total"]:
            worst = mem
    est.memory = worst
    usable = cluster.memory * (0.9 if cluster.device == "cuda" else 0.8)
    if worst["total"] > usable:
        est.reason = (f"needs {worst['total'] / 2**30:.1f} GiB per rank, {usable / 2**30:.1f} GiB "
                      f"usable of {cluster.memory / 2**30:.1f}")

    # ---- time: the busiest pipeline rank (the first holds the remainder blocks and the embedding)
    peak = cluster.peak(bf16)
    tokens_mb = mb * t
    layers_flops = max(sum(d.layers_flops(rng, tp) for rng in h[0]) for h in held) * tokens_mb
    # attention's QK^T and AV (12 T n_head hd a token and block, over the full T x T, as counted)
    attn_flops = 12 * d.n_head * d.hd * d.t / tp * max(blocks) * tokens_mb
    head_flops = 6 * v * c * tokens_mb / tp
    mm_flops = layers_flops - attn_flops + (head_flops if pp == 1 else head_flops / 2)
    kern = kernel_seconds(cluster, peak, mm_flops, attn_flops, attention,
                          matmul_size_factor(d, tp, cluster.gemm_k0))
    # the passes were counted on the GPT's element-wise widths (8 C a block); a family's scale with its own
    ew = EW_PASSES[layout.compile] * d.ew_width() / 8 * tokens_mb * c / tp * act_bytes * max(blocks) \
        / (cluster.mem_bw * cluster.ew_eff)
    moe = max(moes)  # MoE layers on the busiest rank
    ew += moe * d.moe_ew_values() * tokens_mb * act_bytes / (cluster.mem_bw * cluster.ew_eff)
    eager = d.eager_ops() if not layout.compile else 1.0
    ops = (OPS_PER_BLOCK[layout.compile] * eager * max(blocks) + 30) * cluster.op_overhead
    if attention == "materialized":  # element-wise passes over (mb, heads, T, T) per block
        passes = SCORE_PASSES + (SCORE_PASSES_FWD if layout.ac == "block" else 0.0)
        ew += passes * mb * (d.n_head // tp) * t * t * act_bytes * max(blocks) / (cluster.mem_bw * cluster.ew_eff)
    # forward, input-gradient and weight-gradient shares of a microbatch (the zero-bubble split):
    # matmuls a third each, attention a third forward and two thirds input gradient, the rest
    # (element-wise, launches) a third forward; a recomputed forward's matmuls and attention belong
    # to the backward (its element-wise passes are in EW_PASSES, the scores' in SCORE_PASSES_FWD)
    rec = 1 / 3 if layout.ac == "block" else 0.0
    f = (kern["mm"] + kern["attn"] + ew + ops) / 3
    w = kern["mm"] / 3
    b = kern["mm"] / 3 + 2 * (kern["attn"] + ew + ops) / 3 + rec * (kern["mm"] + kern["attn"])
    t_mb = f + b + w
    compute = r.micro_batches * layout.microbatches * t_mb
    bubble = r.micro_batches * _bubble(layout.schedule, pp, spr, f, b, w)
    # communication per step
    numel0, tensors0 = _held_params(d, *held[0], tp, pp)  # rank 0's: the most blocks and the embedding
    pbytes = 4.0 * numel0
    lat = cluster.latency
    reduce, exposed = dp_comm(layout, cluster, pbytes, tensors0, max(blocks) + 1, compute, bf16, overlap_dp,
                              cfg.parallel.reduce_dtype == "bf16", r.micro_batches)
    tp_comm = 0.0
    if tp > 1:  # 2 all-gathers + 2 reduce-scatters of (B, T, C) per block forward, as many backward
        per = _ring("allgather", tokens_mb * c * act_bytes, tp) / _bw(cluster, layout, "tp") + lat
        tp_comm = r.micro_batches * layout.microbatches * max(blocks) * 8 * per
    cp_comm = 0.0
    if cp > 1:  # keys and values all-gathered per block forward, reduce-scattered backward
        kv_bytes = 2 * tokens_mb * cp * d.n_kv * d.hd * act_bytes
        cp_comm = r.micro_batches * layout.microbatches * max(blocks) * 2 * (
            lat + _ring("allgather", kv_bytes, cp) / _bw(cluster, seq_layout, "cp"))
    pp_comm = 0.0
    if pp > 1:  # activations forward, their gradients backward, per microbatch and stage boundary
        pp_comm = r.micro_batches * layout.microbatches * 2 * spr * (
            lat + tokens_mb * c * act_bytes / _bw(cluster, layout, "pp"))
    optim = (28.0 * numel0 / max(1, n if layout.zero else 1)) / cluster.mem_bw \
        + (12 * tensors0 if cluster.device == "cpu" else 24) * cluster.op_overhead
    if tp > 1:  # each Partial gradient all-reduced by every op that reads it: NCCL's latency a call
        optim += PARTIAL_REDUCES * partial_grad_tensors(cfg, max(blocks), pp == 1) * (
            lat + _ring("allreduce", 4.0 * c, tp) / _bw(cluster, layout, "tp"))
    ep_comm = r.micro_batches * layout.microbatches * moe * a2a_seconds(
        d, layout, tokens_mb, act_bytes, _bw(cluster, layout, "ep"), lat)
    e_numel = sum(stage_experts(d, rng)[0] for rng in held[0][0])  # rank 0's routed experts
    e_reduce, e_exposed = expert_grad_comm(
        layout, 4.0 * e_numel / layout.ep, moes[0], _bw(cluster, layout, "edp"), lat, bf16,
        cfg.parallel.reduce_dtype == "bf16", max(0.0, compute - reduce))
    if e_numel:
        optim += 28.0 * e_numel / layout.ep / expert_shard(layout) / cluster.mem_bw
    reduce, exposed = reduce + e_reduce, exposed + e_exposed
    step = compute + bubble + exposed + tp_comm + cp_comm + pp_comm + ep_comm + optim
    est.time = {"compute": compute, "bubble": bubble, "comm": reduce + tp_comm + cp_comm + pp_comm + ep_comm,
                "comm_exposed": exposed + tp_comm + cp_comm + pp_comm + ep_comm, "optimizer": optim,
                "step": step}
    if d.moe_layers:
        est.time["all_to_all"] = ep_comm
    if cluster.calib and cp == 1 and not d.moe_layers:  # this machine: composed from its calibration (localtime.py)
        shape = [stage_params(cfg, pp, tp, s) for s in range(pp)]
        est.time = local_step(cfg, layout, cluster.calib, blocks=blocks, numel=[x[0] for x in shape],
                              tensors=[x[1] for x in shape], threads=_threads(cluster))
        step = est.time["step"]
    if muon:  # Newton-Schulz and its exchange, on the busiest stage
        extra = muon_seconds(cfg, hidden_matrices(d, max(blocks), moes[0]), layout, cluster,
                             _bw(cluster, layout, "dp"))
        est.time["optimizer"] += extra
        est.time["step"] = step = step + extra
    flops_step = d.flops_per_token() * d.t * r.global_batch
    est.tokens_per_s = r.global_batch * d.t / step
    est.mfu = flops_step / step / (peak * seq_layout.world)
    est.unverified = unverified(seq_layout, cluster)
    if cluster.interval[1] and cluster.device == "cuda":
        est.interval = (est.tokens_per_s * cluster.interval[0], est.tokens_per_s * cluster.interval[1])
    return est

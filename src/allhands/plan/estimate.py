"""Per-rank memory and step time of one layout of a shipped decoder (the reference GPT or the
Llama family, whose shapes decoder.py prices) on one cluster.

Memory, counted the way allhands measures it (memory.py): training state from the parameters
each rank holds (tp shards, its pipeline stage's blocks, 1/N under ZeRO; the ZeRO formulas,
Rajbhandari et al. 2020), plus activations (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models": with SDPA no T x T matrix is stored, so about
17 B T C values per block without recomputation (16 without dropout), 10 with the selective
policy, the block input with full checkpointing; / tp under sequence parallelism), in-flight
pipeline microbatches (1F1B: pp - stage), the full parameters FSDP gathers, and the runtime's
own bytes.

Time: matmul FLOPs at ``gemm_eff`` of peak, element-wise traffic at memory bandwidth, a cost
per eager op (fewer under compile, which fuses each block), ring collectives
(all-reduce 2(n-1)/n B, all-gather/reduce-scatter (n-1)/n B) on the link their mesh dim spans
(between nodes, the NICs of the group's members on a node), the part of data-parallel
communication that backward/forward cannot hide, and the 1F1B bubble (pp - 1) microbatch times
(Narayanan et al. 2021).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from allhands.config import Config
from allhands.plan.cluster import Cluster
from allhands.plan.decoder import Decoder
from allhands.plan.localtime import PARTIAL_REDUCES, local_step, partial_grad_tensors

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


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    zero: int
    microbatches: int = 1  # pipeline microbatches (1 without pp)
    ac: str = "none"
    compile: bool = False
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def grad_view(self) -> "Layout":
        """The layout as its gradient reduction sees it: the cp ranks of a group hold the same
        parameters, so they join the data-parallel ranks (FSDP shards over dp_shard x cp)."""
        if self.cp == 1:
            return self
        if self.zero >= 1:
            return dataclasses.replace(self, dp_shard=self.dp_shard * self.cp, cp=1)
        return dataclasses.replace(self, dp_replicate=self.dp_replicate * self.cp, cp=1)

    def overrides(self) -> list[str]:
        """The ``--set`` items that train this layout."""
        return [f"parallel.dp_replicate={self.dp_replicate}", f"parallel.dp_shard={self.dp_shard}",
                f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.zero={self.zero}",
                f"parallel.pp_microbatches={self.microbatches if self.pp > 1 else 0}",
                f"parallel.ac={self.ac}", f"run.compile={str(self.compile).lower()}",
                f"parallel.cp={self.cp}"]

    def name(self) -> str:
        parts = [f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_shard > 1 and self.dp_replicate > 1
                 else f"dp{self.dp}", f"zero{self.zero}"]
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"pp{self.pp}/m{self.microbatches}"] if self.pp > 1 else []
        parts += [f"ac:{self.ac}"] if self.ac != "none" else []
        parts += ["compile"] if self.compile else []
        return " ".join(parts)


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)  # bytes, the busiest rank
    state_rank: list[float] = field(default_factory=list)  # training-state bytes per pp stage
    time: dict[str, float] = field(default_factory=dict)  # seconds per step
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    reason: str = ""  # why it cannot run; empty when it can

    @property
    def feasible(self) -> bool:
        return not self.reason


def _stage_blocks(n_layer: int, pp: int) -> list[int]:
    base, extra = divmod(n_layer, pp)  # parallel/pipeline.py's balanced_split
    return [base + (1 if s < extra else 0) for s in range(pp)]


def stage_params(cfg: Config, pp: int, tp: int, stage: int) -> tuple[int, int]:
    """(parameters this rank holds before data-parallel sharding, their tensor count) on pipeline
    stage ``stage``: tp shards q/k/v (or qkv) and fc (or gate/up) column-wise with their biases,
    the output projections row-wise, the embedding and head over the vocabulary; norms, position
    embedding and row biases are replicated (parallel/tensor.py's plans; decoder.py)."""
    d = Decoder.of(cfg.model)
    blocks = _stage_blocks(d.n_layer, pp)[stage]
    per, per_tensors = d.block_params(tp)
    numel, tensors = blocks * per, blocks * per_tensors
    if stage == 0:
        numel, tensors = numel + d.first_params(tp)[0], tensors + d.first_params(tp)[1]
    if stage == pp - 1:
        numel, tensors = numel + d.last_params(tp, pp)[0], tensors + d.last_params(tp, pp)[1]
    return numel, tensors


def _threads(cluster: Cluster) -> int:
    return max(1, (os.cpu_count() or 1) // cluster.per_node)


def _ring(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "allreduce" else 1.0) * (n - 1) / n * nbytes


def _bw(cluster: Cluster, layout: Layout, dim: str) -> float:
    """Bandwidth a rank of a mesh dim's group gets. Mesh order is (pp, dp_replicate, dp_shard, cp, tp),
    outermost first: a dim's stride is the product of the inner ones. Inside a node, the node's
    links. A group spanning nodes with k members on each node gets min(intra, k x inter): NCCL
    builds several rings (channels), each entering a node through one NIC, passing the node's GPUs
    over NVLink and leaving through a NIC, and runs them concurrently on different NICs, so a
    group's traffic between nodes is spread over the NICs of all its members on a node (NCCL's
    maintainer S. Jeaugey on nodes with several NICs, in the NVIDIA/nccl discussion "How will NCCL
    behave when there are multiple NICs on a node?", and on channels and NICs in "Some questions
    about selecting NET when searching channels"). With one member a node (a stride of a node or
    more, as HSDP's replicate dim or dp under tp=8) the group has that member's one NIC."""
    sizes = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
             "cp": layout.cp, "tp": layout.tp}
    order = list(sizes)
    if dim == "dp":  # dp_replicate x dp_shard, adjacent in the mesh
        size, stride = layout.dp, layout.tp * layout.cp
    else:
        size, stride = sizes[dim], 1
        for d in order[order.index(dim) + 1:]:
            stride *= sizes[d]
    if size * stride <= cluster.per_node:
        return cluster.intra_bw
    members = max(1, cluster.per_node // stride)  # of the group on one node
    return min(cluster.intra_bw, members * cluster.inter_bw)


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


def dp_comm(layout: Layout, cluster: Cluster, pbytes: float, tensors: int, units: int, compute: float,
            bf16: bool, overlap: bool = True, reduce_bf16: bool = False) -> tuple[float, float]:
    """(seconds of data-parallel communication per step, the part of it backward/forward cannot
    hide) for ``pbytes`` of fp32 parameters in ``tensors`` tensors and ``units`` FSDP units;
    without ``overlap`` the all-reduce runs after backward, all of it exposed; ``reduce_bf16``:
    FSDP reduces gradients in bf16 (parallel.reduce_dtype), half the bytes of fp32."""
    n, lat = layout.dp_shard, cluster.latency
    dp_bw = _bw(cluster, layout, "dp_shard" if layout.zero >= 2 else "dp")
    if layout.zero <= 1:
        reduce = _ring("allreduce", pbytes, layout.dp) / dp_bw + lat * max(1, pbytes // 25e6)
        exposed = reduce - min(reduce * (1 - 1 / max(1, pbytes // 25e6 + 1)), compute * 2 / 3) * overlap
        if layout.zero == 1:  # ZeroRedundancyOptimizer hands each owner's updated parameters on
            bcast = _ring("allgather", pbytes, n) / dp_bw + lat * tensors
            reduce, exposed = reduce + bcast, exposed + bcast
        return reduce, exposed
    gather_bytes = pbytes / 2 if bf16 else pbytes
    ag = _ring("allgather", gather_bytes, n) / dp_bw * (2 if layout.zero == 3 else 1)
    grad_bytes = pbytes / 2 if bf16 and reduce_bf16 else pbytes
    rs = _ring("reducescatter", grad_bytes, n) / dp_bw
    hsdp = _ring("allreduce", grad_bytes / n, layout.dp_replicate) / _bw(cluster, layout, "dp_replicate")
    reduce = ag + rs + hsdp + lat * units * (3 if layout.zero == 3 else 2)
    return reduce, max(reduce - compute, reduce / units)  # prefetch hides all but about one unit


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
    r, d = cfg.run, Decoder.of(cfg.model)
    seq_layout, layout = layout, layout.grad_view()  # cp: sequences cut, parameters as dp's
    cp = seq_layout.cp
    c, t, v, tp, pp, n = d.c, d.t // cp, d.v, layout.tp, layout.pp, layout.dp_shard
    est = Estimate(seq_layout)
    act_bytes = 2 if bf16 else 4
    adam = 8 if cfg.optim.name == "adamw" else 0
    # samples per forward on one rank: global batch / data-parallel ranks / accumulation / microbatches
    # (the cp ranks of a group share samples, each t = T / cp of their tokens)
    mb = r.global_batch / (layout.dp / cp * r.micro_batches * layout.microbatches)
    blocks = _stage_blocks(d.n_layer, pp)
    worst = None
    for stage in range(pp):
        numel, tensors = stage_params(cfg, pp, tp, stage)
        p = 4.0 * numel
        state = train_state(layout, p, tensors, adam)
        est.state_rank.append(sum(state.values()))
        in_flight = min(layout.microbatches, pp - stage) if pp > 1 else 1
        table = {**ACT_PER_BLOCK, "none": _act_none(cfg, act_bytes)}
        per_token = d.act_values(layout.ac, table)
        per_block = per_token * mb * t * c / tp * act_bytes
        acts = in_flight * blocks[stage] * per_block
        if layout.ac == "block":  # one block's intermediates live again during its recompute
            acts += d.act_values("none", table) * mb * t * c / tp * act_bytes
        if stage == pp - 1:  # logits, their fp32 copy for the loss and its gradient; fused: the
            # logits and their gradient, both in the activations' dtype
            acts += 3 * mb * t * v * 4 if loss == "fp32" else 2 * mb * t * v * act_bytes
        block_params = 4.0 * d.block_params(tp)[0] * (2 / 4 if bf16 and layout.zero >= 2 else 1)
        gathered = {0: p / 2 if bf16 else 0.0, 1: p / 2 if bf16 else 0.0,
                    2: blocks[stage] * block_params, 3: 2 * block_params}[layout.zero]
        mem = {**state, "activations": acts, "buffers": gathered + cluster.runtime}
        mem["total"] = sum(mem.values())
        if worst is None or mem["total"] > worst["total"]:
            worst = mem
    est.memory = worst
    usable = cluster.memory * (0.9 if cluster.device == "cuda" else 0.8)
    if worst["total"] > usable:
        est.reason = (f"needs {worst['total'] / 2**30:.1f} GiB per rank, {usable / 2**30:.1f} GiB "
                      f"usable of {cluster.memory / 2**30:.1f}")

    # ---- time: the busiest stage (the first one holds the remainder blocks and the embedding)
    peak = cluster.peak(bf16)
    tokens_mb = mb * t
    layer_flops = d.flops_per_token(n_layer=1, head=False) * tokens_mb / tp
    head_flops = 6 * v * c * tokens_mb / tp
    stage_flops = max(blocks) * layer_flops + (head_flops if pp == 1 else head_flops / 2)
    recompute = max(blocks) * layer_flops / 3 if layout.ac == "block" else 0.0
    # the passes were counted on the GPT's element-wise widths (8 C a block); a family's scale with its own
    ew = EW_PASSES[layout.compile] * d.ew_width() / 8 * tokens_mb * c / tp * act_bytes * max(blocks) \
        / cluster.mem_bw
    eager = d.eager_ops() if not layout.compile else 1.0
    ops = (OPS_PER_BLOCK[layout.compile] * eager * max(blocks) + 30) * cluster.op_overhead
    if attention == "materialized":  # element-wise passes over (mb, heads, T, T) per block
        passes = SCORE_PASSES + (SCORE_PASSES_FWD if layout.ac == "block" else 0.0)
        ew += passes * mb * (d.n_head // tp) * t * t * act_bytes * max(blocks) / cluster.mem_bw
    t_mb = (stage_flops + recompute) / (peak * cluster.gemm_eff) + ew + ops
    compute = r.micro_batches * layout.microbatches * t_mb
    bubble = r.micro_batches * (pp - 1) * t_mb
    # communication per step
    numel0, tensors0 = stage_params(cfg, pp, tp, 0)
    pbytes = 4.0 * numel0
    lat = cluster.latency
    reduce, exposed = dp_comm(layout, cluster, pbytes, tensors0, max(blocks) + 1, compute, bf16, overlap_dp,
                              cfg.parallel.reduce_dtype == "bf16")
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
        pp_comm = r.micro_batches * layout.microbatches * 2 * (
            lat + tokens_mb * c * act_bytes / _bw(cluster, layout, "pp"))
    optim = (28.0 * numel0 / max(1, n if layout.zero else 1)) / cluster.mem_bw \
        + (12 * tensors0 if cluster.device == "cpu" else 24) * cluster.op_overhead
    if tp > 1:  # each Partial gradient all-reduced by every op that reads it: NCCL's latency a call
        optim += PARTIAL_REDUCES * partial_grad_tensors(cfg, max(blocks), pp == 1) * (
            lat + _ring("allreduce", 4.0 * c, tp) / _bw(cluster, layout, "tp"))
    step = compute + bubble + exposed + tp_comm + cp_comm + pp_comm + optim
    est.time = {"compute": compute, "bubble": bubble, "comm": reduce + tp_comm + cp_comm + pp_comm,
                "comm_exposed": exposed + tp_comm + cp_comm + pp_comm, "optimizer": optim, "step": step}
    if cluster.calib and cp == 1:  # this machine: composed from its calibration (localtime.py)
        shape = [stage_params(cfg, pp, tp, s) for s in range(pp)]
        est.time = local_step(cfg, layout, cluster.calib, blocks=blocks, numel=[x[0] for x in shape],
                              tensors=[x[1] for x in shape], threads=_threads(cluster))
        step = est.time["step"]
    flops_step = d.flops_per_token() * d.t * r.global_batch
    est.tokens_per_s = r.global_batch * d.t / step
    est.mfu = flops_step / step / (peak * seq_layout.world)
    return est

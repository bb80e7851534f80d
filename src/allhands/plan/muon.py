"""Muon's price (optim.name=muon, allhands.muon): the hidden matrices keep one momentum buffer
(4 bytes a parameter, where AdamW keeps 8), and each step adds their Newton-Schulz FLOPs, spread
over the ranks training the copy, and the exchange that brings each matrix to its owner and the
results back."""

from __future__ import annotations

from allhands.config import Config
from allhands.plan.cluster import Cluster, ring_bytes
from allhands.plan.decoder import Decoder


def hidden_matrices(d: Decoder, blocks: int, moe_blocks: int) -> list[tuple[int, int]]:
    """The whole (unsharded) matrices Muon takes on a stage of ``blocks`` blocks, ``moe_blocks``
    of them MoE (their attention only: routed experts stay with AdamW)."""
    dense = [(i, o) for i, o, _ in d.matmuls()]
    return dense * (blocks - moe_blocks) + dense[:4] * moe_blocks


def muon_state_saving(mats: list[tuple[int, int]], tp: int, shard: int) -> float:
    """Optimizer-state bytes on one rank that Muon saves against AdamW (4 a hidden parameter)."""
    return 4.0 * sum(i * o for i, o in mats) / tp / shard


def muon_seconds(cfg: Config, mats: list[tuple[int, int]], layout, cluster: Cluster, bw: float) -> float:
    """Newton-Schulz time (its FLOPs at the device's matmul rate, bf16 on GPU, fp32 on CPU) plus
    the exchange: sharded matrices (FSDP, tp) are gathered to their owner and the results sent
    back, each ``(W-1)/W`` of a ``1/W`` share; replicated ones (DDP) only sent back; ZeRO-1's own
    matrices not at all. ``muon_spread=false``: every rank all-gathers and orthogonalizes all."""
    o = cfg.optim
    world = layout.dp * layout.tp
    flops = sum(o.muon_ns_steps * (4 * min(i, j) ** 2 * max(i, j) + 2 * min(i, j) ** 3) for i, j in mats)
    nbytes = 4.0 * sum(i * j for i, j in mats)
    sharded = layout.zero >= 2 or layout.tp > 1
    if layout.zero == 1 and layout.tp == 1:
        world_ns, sent = layout.dp_shard, 0.0  # ZeroRedundancyOptimizer's owners, whole matrices
    elif o.muon_spread:
        world_ns = world
        sent = (2 if sharded else 1) * ring_bytes("allgather", nbytes / world, world)
    else:
        world_ns, sent = 1, ring_bytes("allgather", nbytes, world) if sharded else 0.0
    rate = cluster.peak(cluster.device != "cpu") * cluster.gemm_eff
    return flops / world_ns / rate + (sent / bw + 2 * cluster.latency if sent else 0.0)

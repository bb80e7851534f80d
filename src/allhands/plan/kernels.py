"""What GPU kernels reach: the seconds of a microbatch's matmuls and attention from a cluster's
kernel terms (cluster.py's KERNELS, fitted per GPU generation on published runs: docs/plan.md)."""

from __future__ import annotations

from allhands.plan.cluster import Cluster
from allhands.plan.decoder import Decoder


def matmul_size_factor(d: Decoder, tp: int, k0: float) -> float:
    """How much longer than at ``gemm_eff`` a block's matmuls take, FLOP-weighted: a matmul whose
    smaller weight dimension on this rank is ``k`` runs at ``gemm_eff / (1 + k0 / k)`` (a narrow
    matrix fills fewer tiles per wave and amortises each tile's prologue over a shorter K loop)."""
    if not k0:
        return 1.0
    mats = [(k, n // tp) if col else (k // tp, n) for k, n, col in d.matmuls()] + [(d.c, d.v // tp)]
    weight = sum(k * n for k, n in mats)
    return sum(k * n * (1 + k0 / min(k, n)) for k, n in mats) / weight


def kernel_seconds(cluster: Cluster, peak: float, mm_flops: float, attn_flops: float, attention: str,
                   size: float = 1.0) -> dict[str, float]:
    """Seconds of a microbatch's matmuls (``mm_flops`` at ``gemm_eff`` of peak) and attention
    (``attn_flops``, counted over the full T x T). A fused causal kernel (FlashAttention through
    SDPA; under cp on CUDA FlexAttention with a block mask over the gathered keys,
    parallel/context.py) skips the masked half and runs at ``attn_eff``; ``materialized``
    attention is two batched matmuls over the whole square."""
    if attention == "materialized":
        return {"mm": (mm_flops * size + attn_flops) / (peak * cluster.gemm_eff), "attn": 0.0}
    return {"mm": mm_flops * size / (peak * cluster.gemm_eff),
            "attn": 0.5 * attn_flops / (peak * (cluster.attn_eff or cluster.gemm_eff))}

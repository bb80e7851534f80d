"""Seconds of communication a layout's collectives take on a cluster's links: which link a mesh
dim's group spans (:func:`bandwidth`) and the data-parallel traffic of a step, with the part of it
compute cannot hide (:func:`dp_comm`). Ring collectives: all-reduce 2(n-1)/n B, all-gather and
reduce-scatter (n-1)/n B (cluster.py's ``ring_bytes``)."""

from __future__ import annotations

from allhands.plan.cluster import Cluster, ring_bytes as _ring
from allhands.plan.layout import Layout


def bandwidth(cluster: Cluster, layout: Layout, dim: str) -> float:
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
    ep = layout.ep
    if dim == "dp":  # dp_replicate x dp_shard, adjacent in the mesh
        size, stride = layout.dp, layout.tp * layout.cp
    elif dim in ("ep", "edp"):  # the expert mesh (pp, edp, ep, tp): dp cut into ep-rank groups
        size, stride = (ep, layout.tp) if dim == "ep" else (layout.dp // ep, ep * layout.tp)
    else:
        size, stride = sizes[dim], 1
        for d in order[order.index(dim) + 1:]:
            stride *= sizes[d]
    if size * stride <= cluster.per_node:
        return cluster.intra_bw
    members = max(1, cluster.per_node // stride)  # of the group on one node
    return min(cluster.intra_bw, members * cluster.inter_bw)


def dp_comm(layout: Layout, cluster: Cluster, pbytes: float, tensors: int, units: int, compute: float,
            bf16: bool, overlap: bool = True, reduce_bf16: bool = False, accum: int = 1) -> tuple[float, float]:
    """(seconds of data-parallel communication per step, the part of it backward/forward cannot
    hide) for ``pbytes`` of fp32 parameters in ``tensors`` tensors and ``units`` FSDP units;
    without ``overlap`` the all-reduce runs after backward, all of it exposed; ``reduce_bf16``:
    FSDP reduces gradients in bf16 (parallel.reduce_dtype), half the bytes of fp32; ``accum``
    accumulation steps: FSDP gathers the parameters and reduce-scatters the gradients in each
    (FSDP2's default, and Composer's FULL_SHARD), DDP reduces once (``no_sync`` before the last)."""
    n, lat = layout.dp_shard, cluster.latency
    overlap_share = cluster.overlap
    dp_bw = bandwidth(cluster, layout, "dp_shard" if layout.zero >= 2 else "dp")
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
    hsdp = _ring("allreduce", grad_bytes / n, layout.dp_replicate) / bandwidth(cluster, layout, "dp_replicate")
    reduce = accum * (ag + rs + hsdp + lat * units * (3 if layout.zero == 3 else 2))
    # prefetch hides all but about one unit, at most ``overlap`` of it and no more than the compute
    return reduce, max(reduce - min(overlap_share * reduce, compute), reduce / units)

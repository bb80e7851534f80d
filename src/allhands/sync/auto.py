"""``parallel.sync = "auto"``: measure the link, then choose all-reduce or DiLoCo.

Rule (logged at start): time an all-reduce of a fixed 2 MiB probe over the replicate group
(one warm-up, then the slowest rank's mean of 3), which gives the ring "bus bandwidth"
B = 2 (N-1)/N x probe / t. The gradient all-reduce of a model with P fp32 parameters is then
predicted to take  t_step = 2 (N-1)/N x 4P / B  every step. If t_step > sync.auto_max_comm_s,
synchronous data parallelism would spend most steps waiting on the network, so DiLoCo (with
sync.inner_steps) is chosen; otherwise all-reduce. One replica needs no sync: all-reduce.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from allhands import collective
from allhands.sync.comm import ring_allreduce_bytes

PROBE_BYTES = 2 * 1024 * 1024


def measure_bus_bandwidth(group: dist.ProcessGroup, device: torch.device, reps: int = 3) -> float:
    """Bytes per second of a ring all-reduce over ``group`` (the slowest rank's view)."""
    n = group.size()
    probe = torch.ones(PROBE_BYTES // 4, device=device)
    collective.all_reduce(probe, call="sync=auto probe", group=group)  # warm-up: connections, allocations
    t0 = time.perf_counter()
    for _ in range(reps):
        collective.all_reduce(probe, call="sync=auto probe", group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64, device=device)
    collective.all_reduce(elapsed, op=collective.MAX, call="sync=auto probe", group=group)
    return ring_allreduce_bytes(PROBE_BYTES, n) / max(float(elapsed), 1e-9)


def decide(params: int, n: int, bus_bytes_per_s: float, max_comm_s: float) -> tuple[str, str]:
    """The rule alone: (strategy name, the log line stating the figures and the choice)."""
    if n == 1:
        return "allreduce", "sync=auto: one replica, nothing to communicate: allreduce"
    predicted = ring_allreduce_bytes(4 * params, n) / bus_bytes_per_s
    pick = "diloco" if predicted > max_comm_s else "allreduce"
    return pick, (f"sync=auto: measured bus bandwidth {bus_bytes_per_s * 8 / 1e6:,.0f} Mbit/s over "
                  f"{n} replicas; a {params * 4 / 1e6:.1f} MB gradient all-reduce would take "
                  f"{predicted * 1e3:.1f} ms per step (limit sync.auto_max_comm_s="
                  f"{max_comm_s * 1e3:.0f} ms): {pick}")


def choose(model: nn.Module, group: dist.ProcessGroup, device: torch.device,
           max_comm_s: float) -> tuple[str, str]:
    """Measure the link (all ranks take part and agree), then apply :func:`decide`."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bw = measure_bus_bandwidth(group, device) if group.size() > 1 else float("inf")
    return decide(params, group.size(), bw, max_comm_s)

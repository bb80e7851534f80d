"""The machines a plan is for: nodes x accelerators, each with memory, peak FLOP/s and memory
bandwidth, joined by intra- and inter-node links; presets for A100, H100 and H200 nodes and one
measured on this machine (``local``).

GPU figures are datasheet values (flops.py's table; HBM: A100 80 GB 2.0 TB/s, H100 SXM 3.35 TB/s,
H200 4.8 TB/s). Link figures are per accelerator and per direction, derated to what NCCL's ring
collectives reach: NVLink 3 (A100, 300 GB/s a direction) ~230 GB/s, NVLink 4 (H100/H200,
450 GB/s) ~360 GB/s; between nodes one 200 Gb/s HDR (A100 DGX) or 400 Gb/s NDR (H100/H200 DGX)
InfiniBand port per GPU, ~85% of line rate.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from dataclasses import dataclass

from allhands.errors import ConfigError
from allhands.flops import PEAK_FLOPS, cpu_gemm_peak
from allhands.plan.localtime import cached_calibration

GiB = 2 ** 30


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective over ``n`` ranks: all-reduce 2(n-1)/n of
    ``nbytes``, all-gather and reduce-scatter (n-1)/n."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "allreduce" else 1.0) * (n - 1) / n * nbytes


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    per_node: int
    memory: float  # bytes per accelerator
    peak_bf16: float  # dense FLOP/s per accelerator
    peak_fp32: float
    mem_bw: float  # bytes/s of device memory, for element-wise ops and the optimizer
    intra_bw: float  # bytes/s a direction per accelerator inside a node
    inter_bw: float  # bytes/s a direction per accelerator between nodes
    latency: float = 10e-6  # seconds per collective call
    gemm_eff: float = 0.75  # share of peak that a large model's matmuls reach
    attn_eff: float = 0.0  # share of peak a fused attention kernel reaches on the FLOPs it runs; 0: gemm_eff
    ew_eff: float = 1.0  # share of mem_bw that element-wise and norm kernels reach
    gemm_k0: float = 0.0  # a matmul whose narrower weight dimension is k runs at gemm_eff / (1 + gemm_k0 / k)
    overlap: float = 1.0  # share of FSDP's gathers and reductions that compute can hide
    # measured / predicted throughput over the held-out published runs of this GPU generation
    # (bench/plan.py); (0, 0): unknown (this machine: ``plan --check`` measures it instead)
    interval: tuple[float, float] = (0.0, 0.0)
    op_overhead: float = 5e-6  # seconds per eager op (kernel launch, dispatcher)
    runtime: float = 0.0  # bytes a worker holds besides tensors (CPU: interpreter and libraries)
    device: str = "cuda"
    calib: dict | None = None  # local: calibrate.py's measurements, which localtime.py composes

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def peak(self, bf16: bool) -> float:
        return self.peak_bf16 if bf16 else self.peak_fp32


# What kernels of a GPU generation reach in whole training steps, fitted by ``python bench/plan.py
# --skip-check --fit`` on the fitting half of the published runs it enters (every other row of
# each table; docs/plan.md): Ampere on torchtitan's and llm-foundry's A100 runs and Megatron-LM's
# Table 1, Hopper on torchtitan's and llm-foundry's H100 runs. H200 is a Hopper part with more,
# faster memory: no published H200 run is entered, so it takes Hopper's terms untested.
# ``interval``: the range of measured / predicted tokens/s over the held-out half (2026-12-07).
KERNELS = {
    "ampere": dict(gemm_eff=0.85, attn_eff=0.28, ew_eff=0.52, gemm_k0=571.0, overlap=0.14,
                   interval=(0.83, 1.11)),
    "hopper": dict(gemm_eff=0.72, attn_eff=0.16, ew_eff=0.93, gemm_k0=898.0, overlap=0.03,
                   interval=(0.91, 1.11)),
}


def _gpu(name: str, key: str, memory_gb: float, hbm: float, intra: float, inter: float, gen: str) -> Cluster:
    p = PEAK_FLOPS[key]
    return Cluster(name, 1, 8, memory_gb * 1e9, p["bf16"], p["fp32"], hbm, intra, inter, **KERNELS[gen])


PRESETS = {
    "a100": _gpu("a100", "A100", 80, 2.0e12, 230e9, 21e9, "ampere"),
    "h100": _gpu("h100", "H100", 80, 3.35e12, 360e9, 42e9, "hopper"),
    "h200": _gpu("h200", "H200", 141, 4.8e12, 360e9, 42e9, "hopper"),
}


def _measured_copy_bw() -> float:
    """Bytes/s of a 64 MiB tensor copy (read + write), best of a few."""
    import torch

    a = torch.empty(16 * 2 ** 20)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t0))
    return best


def _measured_op_overhead() -> float:
    """Seconds of one small eager op (dispatcher + kernel on a 16-element tensor), median-ish."""
    import torch

    x = torch.ones(16)
    for _ in range(200):
        x.add(1.0)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        x.add(1.0)
    return (time.perf_counter() - t0) / n


def local_cluster(nproc: int = 2, *, calibrated: bool = True) -> Cluster:
    """This machine as ``nproc`` CPU workers with ``cores // nproc`` threads each: the measured
    GEMM peak (cached, flops.py), memory-copy bandwidth and per-op overhead. With its cached
    calibration (``allhands plan`` measures it once: calibrate.py) gloo's alpha-beta figures,
    the step overheads and the worker's resident set come from it and the step time from
    localtime.py; without, gloo over loopback is taken as 1 GB/s and 100 us a call and
    ``runtime`` as this process's resident set after importing torch."""

    cores = os.cpu_count() or 1
    threads = max(1, cores // nproc)
    peak = cpu_gemm_peak(threads, "fp32") or 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc
    cal = cached_calibration(nproc) if calibrated else None
    latency, link = (cal["allreduce"][0], 1 / max(cal["allreduce"][1], 1e-12)) if cal else (100e-6, 1e9)
    return Cluster("local", 1, nproc, mem, cpu_gemm_peak(threads, "bf16", measure=False) or peak / 4,
                   peak, _measured_copy_bw(), link, link, latency=latency, gemm_eff=1.0,
                   op_overhead=_measured_op_overhead(), runtime=float(cal["runtime"] if cal else rss),
                   device="cpu", calib=cal)


_KEYS = {"gpus": "per_node", "per_node": "per_node", "nodes": "nodes", "mem_gb": "memory",
         "bf16_tflops": "peak_bf16", "fp32_tflops": "peak_fp32", "intra_gbs": "intra_bw",
         "inter_gbs": "inter_bw", "hbm_gbs": "mem_bw", "gemm_eff": "gemm_eff",
         "attn_eff": "attn_eff", "ew_eff": "ew_eff", "gemm_k0": "gemm_k0", "overlap": "overlap"}
_SCALE = {"memory": 1e9, "peak_bf16": 1e12, "peak_fp32": 1e12, "intra_bw": 1e9, "inter_bw": 1e9,
          "mem_bw": 1e9}


def parse_cluster(spec: str, nproc: int = 2) -> Cluster:
    """``PRESET[:NODES][,key=value...]``, e.g. ``h100:16`` (16 nodes of 8 H100), ``local``,
    ``a100:4,gpus=4,inter_gbs=12``. Keys: nodes, gpus, mem_gb, bf16_tflops, fp32_tflops,
    intra_gbs, inter_gbs, hbm_gbs, gemm_eff, attn_eff, ew_eff, gemm_k0, overlap."""
    head, *pairs = [s.strip() for s in spec.split(",") if s.strip()] or [""]
    name, _, nodes = head.partition(":")
    allowed = ", ".join([*PRESETS, "local"])
    if name == "local":
        c = local_cluster(nproc)
    elif name in PRESETS:
        c = PRESETS[name]
    else:
        raise ConfigError(f"--cluster: {name!r} is not a preset; use one of {allowed}, "
                          f"e.g. h100:16 for 16 nodes of 8 H100")
    change: dict = {}
    if nodes:
        pairs.insert(0, f"nodes={nodes}")
    for pair in pairs:
        key, _, raw = pair.partition("=")
        field = _KEYS.get(key.strip())
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if field is None or value <= 0:
            raise ConfigError(f"--cluster: {pair!r} is not KEY=POSITIVE_NUMBER with KEY one of "
                              f"{', '.join(_KEYS)}")
        change[field] = int(value) if field in ("nodes", "per_node") else value * _SCALE.get(field, 1)
    return dataclasses.replace(c, **change)

"""How much of the hardware a run uses: model FLOPs per step (torch's own counter), the
accelerator's peak FLOP/s (``log.peak_tflops``, else the datasheet table, or a measured GEMM peak
on CPU) and their ratio, MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", appendix B) counts the FLOPs the
model needs (forward + backward), not those the hardware ran: activation recomputation is left
out, so MFU compares layouts fairly. The count comes from ``FlopCounterMode`` run on a meta
copy of the model (shapes only: no memory, no time), which counts matmuls and attention; for the
reference GPT and the Llama family it equals the analytic ``6 N + 12 L C T`` per token
(:func:`decoder_flops_per_token`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from allhands.env import cache_dir

# Dense peak FLOP/s of one device from the vendors' datasheets, as {"bf16": tensor-core bf16,
# "fp32": the non-tensor-core fp32 rate, which torch uses unless TF32 is enabled}. Datasheets
# print the tensor rates with 2:4 sparsity, twice the dense ones, which are used here.
#   A100 SXM4 and PCIe (40/80 GB)  bf16 312 T, fp32 19.5 T
#   A10                            bf16 125 T (250 sparse), fp32 31.2 T
#   L4                             bf16 121 T (242 sparse), fp32 30.3 T
#   L40S                           bf16 362 T (733 sparse), fp32 91.6 T
#   H100 SXM5, H800 SXM            bf16 989 T (1,979 sparse), fp32 67 T
#   H100 PCIe, H800 PCIe           bf16 756 T (1,513 sparse), fp32 51 T
#   H100 NVL (94 GB)               bf16 835 T (1,671 sparse), fp32 60 T
#   H200 SXM, GH200                bf16 989 T (1,979 sparse), fp32 67 T
#   H200 NVL                       bf16 835 T (1,671 sparse), fp32 60 T
#   B200 (HGX B200 / 8)            bf16 2.25 P (36 P sparse / 8), fp32 75 T (600 T / 8)
#   GB200 (GB200 NVL72 / 72)       bf16 2.5 P (360 P sparse / 72), fp32 80 T (5,760 T / 72)
#   AMD Instinct MI300X, MI325X    bf16 1,307 T (2,615 sparse), fp32 163.4 T (vector)
# A name matches where the key stands as a whole word in it, longest key first: "H100 NVL" and
# "H100 PCIe" before "H100", and neither "A10" in "A100" nor "H200" in "GH200" nor "B200" in
# "GB200" matches. plan/cluster.py reads "A100", "H100" and "H200" as its nodes' parts.
_SXM_HOPPER = {"bf16": 989e12, "fp32": 67e12}
_NVL_HOPPER = {"bf16": 835e12, "fp32": 60e12}
_PCIE_HOPPER = {"bf16": 756e12, "fp32": 51e12}
_MI300 = {"bf16": 1307.4e12, "fp32": 163.4e12}
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "H100": _SXM_HOPPER,
    "H100 PCIe": _PCIE_HOPPER,
    "H100 NVL": _NVL_HOPPER,
    "H800": _SXM_HOPPER,
    "H800 PCIe": _PCIE_HOPPER,
    "H200": _SXM_HOPPER,
    "H200 NVL": _NVL_HOPPER,
    "GH200": _SXM_HOPPER,
    "B200": {"bf16": 2250e12, "fp32": 75e12},
    "GB200": {"bf16": 2500e12, "fp32": 80e12},
    "MI300X": _MI300,
    "MI325X": _MI300,
}


def accelerator_peak(device_name: str, dtype: str) -> float | None:
    """Datasheet peak of a GPU by its ``torch.cuda.get_device_name`` (None when not in the table)."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", device_name.lower()):
            return PEAK_FLOPS[key][dtype]
    return None


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_gemm_peak(threads: int, dtype: torch.dtype = torch.float32, n: int = 1024,
                      seconds: float = 0.5) -> float:
    """FLOP/s of the best of repeated ``n x n`` matmuls on ``threads`` CPU threads (about
    ``seconds`` long): the rate this machine's BLAS reaches, the CPU's practical peak."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: thread pool, packing buffers
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end or best == 0.0:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


def _peak_key(threads: int, dtype: str) -> str:
    return f"{_cpu_name()}|threads={threads}|{dtype}|torch {torch.__version__}"


def _read_peaks() -> dict[str, float]:
    try:
        return json.loads((cache_dir() / "gemm_peak.json").read_text())
    except (OSError, ValueError):
        return {}


def _keep_peak(key: str, value: float) -> float:
    """Store the larger of ``value`` and the cached figure (re-read just before writing: another
    job may have raised it) and return it. A measurement under load only reads low (other
    processes take cycles, never give them), so the maximum is the best estimate of the peak."""
    path = cache_dir() / "gemm_peak.json"
    cached = _read_peaks()
    cached[key] = max(value, cached.get(key, 0.0))
    try:  # written beside and renamed: concurrent jobs never read half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only home: measured again next time
        pass
    return cached[key]


def cpu_gemm_peak(threads: int, dtype: str = "fp32", *, measure: bool = True) -> float | None:
    """The measured CPU GEMM peak for ``threads`` threads, cached per machine (CPU model), thread
    count, dtype and torch version in ``cache_dir()/gemm_peak.json``; None when not cached and
    ``measure`` is False."""
    key = _peak_key(threads, dtype)
    cached = _read_peaks().get(key)
    if cached is not None or not measure:
        return cached
    return _keep_peak(key, measure_gemm_peak(threads, torch.bfloat16 if dtype == "bf16" else torch.float32))


def raise_cpu_gemm_peak(threads: int, dtype: str, achieved: float) -> float:
    """A run reached ``achieved`` FLOP/s per worker, above the cached peak: that peak was measured
    under load. Measure again and keep the maximum of the cached figure, the new measurement and
    ``achieved`` itself (the model's matmuls ran that fast on these cores, so the peak is at least
    that): the cache only ever rises, and MFU stays at or below 1."""
    measured = measure_gemm_peak(threads, torch.bfloat16 if dtype == "bf16" else torch.float32)
    return _keep_peak(_peak_key(threads, dtype), max(measured, achieved))


def peak_flops(device: torch.device, dtype: str, threads: int,
               peak_tflops: float = 0.0) -> tuple[float | None, str]:
    """(peak FLOP/s of one worker's device, where the figure comes from); ``peak_tflops``
    (``log.peak_tflops``), when > 0, is the figure for any device."""
    if peak_tflops > 0:
        return peak_tflops * 1e12, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return accelerator_peak(name, dtype), f"datasheet {name}"
    return cpu_gemm_peak(threads, dtype), f"measured {dtype} GEMM, {threads} thread(s)"


def decoder_flops_per_token(*, n_layer: int, n_embd: int, seq_len: int, vocab_size: int,
                            n_head: int = 1, n_kv_head: int = 0, head_dim: int = 0,
                            ffn_hidden: int = 0, gated: bool = False) -> int:
    """Analytic training FLOPs per token of a decoder of either family: ``6 N`` for the matmul
    weights N (embeddings are lookups; biases, norms and RoPE are not matmuls) plus attention's
    ``12 L T n_head head_dim`` (QK^T and AV, forward and backward, over the full T x T: PaLM's
    convention, appendix B, which FlopCounterMode follows). Per block N is the projections
    ``C x (n_head + 2 n_kv_head) head_dim`` (q, k, v: grouped-query heads make k and v narrower),
    ``n_head head_dim x C`` (output) and the feed-forward's ``2 C H``, or ``3 C H`` when
    ``gated`` (SwiGLU's gate, up and down); the head adds ``V C``. Defaults: ``n_kv_head`` =
    ``n_head``, ``head_dim`` = ``C / n_head``, ``H`` = 4 C."""
    c = n_embd
    hd = head_dim or c // n_head
    kv = n_kv_head or n_head
    hidden = ffn_hidden or 4 * c
    width = n_head * hd
    block = c * (width + 2 * kv * hd) + width * c + (3 if gated else 2) * c * hidden
    n = n_layer * block + vocab_size * c
    return 6 * n + 12 * n_layer * width * seq_len


def gpt_flops_per_token(*, n_layer: int, n_embd: int, seq_len: int, vocab_size: int) -> int:
    """The reference GPT's :func:`decoder_flops_per_token`: ``6 N + 12 L C T`` with
    N = 12 L C^2 in the blocks + V C in the head."""
    return decoder_flops_per_token(n_layer=n_layer, n_embd=n_embd, seq_len=seq_len,
                                   vocab_size=vocab_size)


def count_flops(build: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """Forward + backward FLOPs of one batch ``(x, y)``, counted by torch's FlopCounterMode on
    a copy of the model built on the meta device (no memory, no arithmetic)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
    if any(not q.is_meta for q in model.parameters()):
        # A model instance passed to allhands.train (not a builder) comes back real: never run
        # the counter's backward on the weights being trained. The run then logs no MFU.
        raise TypeError("the model was not built on the meta device")
    xm, ym = x.to("meta"), y.to("meta")
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(xm), ym).backward()
    return int(counter.get_total_flops())


@dataclass
class StepFlops:
    """A run's FLOPs per step and the peak of its devices, computed once at start; ``fields``
    turns a step time into the metrics record's ``flops_per_step``, ``achieved_flops`` (FLOP/s
    of the whole job) and ``mfu``."""

    per_step: int
    peak: float | None  # of one device
    devices: int
    peak_source: str = ""
    # CPU, the node's leader: called once with the achieved FLOP/s per worker when that exceeds
    # ``peak``; returns the raised peak (raise_cpu_gemm_peak)
    raise_peak: Callable[[float], float] | None = None

    def fields(self, step_time: float) -> dict[str, Any]:
        achieved = self.per_step / max(step_time, 1e-12)
        out: dict[str, Any] = {"flops_per_step": self.per_step, "achieved_flops": achieved}
        if not self.peak:
            return out
        per_device = achieved / self.devices
        if per_device > self.peak and self.raise_peak is not None:
            self.peak, self.raise_peak = self.raise_peak(per_device), None
            self.peak_source += ", raised: a step ran above the cached peak"
            out["peak_raised"] = self.peak
        mfu = per_device / self.peak
        if mfu > 1.0:  # a datasheet peak or another worker's cache: never report above the hardware
            out["mfu_clamped"] = mfu
            mfu = 1.0
        out["mfu"] = mfu
        return out

    def describe(self) -> str:
        peak = f"{self.peak / 1e12:.3g} TFLOP/s per device ({self.peak_source})" if self.peak \
            else f"unknown ({self.peak_source}): no MFU"
        return f"allhands: model FLOPs per step {self.per_step:.4g}; peak {peak}"

    @classmethod
    def start(cls, build: Callable[[], nn.Module], sample: tuple[torch.Tensor, torch.Tensor],
              loss_fn: Callable, *, global_batch: int, device: torch.device, bf16: bool,
              threads: int, devices: int, leader: bool, barrier: Callable[[], None],
              formula: Callable[[], int] | None = None, peak_tflops: float = 0.0) -> "StepFlops | None":
        """Count one sample's FLOPs and find the peak. On CPU the node's ``leader`` measures the
        GEMM peak (when not cached) while the other workers wait in ``barrier``, so that they do
        not compete for the cores it measures. A model that cannot run on meta tensors takes
        ``formula``'s FLOPs per sample (a shipped mixture of experts); without one, None.
        ``peak_tflops`` > 0 (``log.peak_tflops``, alike on every rank) is the peak: nothing is
        measured, looked up or raised."""
        dtype = "bf16" if bf16 else "fp32"
        measured = device.type == "cpu" and not peak_tflops > 0
        if measured:
            if leader:
                cpu_gemm_peak(threads, dtype)
            barrier()
        peak, source = peak_flops(device, dtype, threads, peak_tflops)
        x, y = (t[:1] for t in sample)
        try:
            with torch.random.fork_rng(devices=[]):  # a user builder may draw from the CPU generator
                per_sample = count_flops(build, x, y, loss_fn)
        except (RuntimeError, NotImplementedError, TypeError):  # a model that needs real data
            if formula is None:
                return None
            per_sample = formula()
        raise_peak = functools.partial(raise_cpu_gemm_peak, threads, dtype) \
            if measured and leader else None
        return cls(per_step=per_sample * global_batch, peak=peak, devices=devices, peak_source=source,
                   raise_peak=raise_peak)

"""Synchronous data parallelism: every step's gradients are averaged over all data-parallel
ranks, by the wrapper ``parallelize`` applied (DDP's all-reduce, or FSDP's reduce-scatter and,
for hybrid sharding, all-reduce across replicas); DDP's all-reduce optionally compressed by one
of torch's DDP communication hooks.

With DDP, accumulation micro-steps run under ``no_sync`` so only the last one communicates; DDP
overlaps the bucketed all-reduce with the rest of that backward pass. FSDP, likewise, reduces
only in the last micro-step's backward (the layout's ``_accumulating``, parallel/layout.py).
Every DDP bucket goes through :func:`_metered`, which records the size handed to the collective
and when it was in flight, so bytes and exposed communication are measured in every DDP run
(compressed or not). FSDP's collectives are not metered here (bench/sharding.py counts them).

Compression (``sync.compress``, DDP layouts: parallel.zero 0 or 1):
- ``fp16`` / ``bf16``: torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` (half the bytes;
  the buffer is divided by N before the cast so the sum cannot overflow);
- ``powersgd``: torch's ``powerSGD_hook`` (Vogels et al. 2019, arXiv:1905.13727): rank-r
  factors P (n x r) and Q (m x r) per matrix instead of the n x m gradient, with error feedback
  (the compression residual is added to the next step's gradient) and warm-started Q; its
  memory is checkpointed under ``sync.powersgd`` (sync/powersgd.py), so a resume is exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands.mesh import Mesh
from allhands.sync.base import SyncStrategy
from allhands.sync.comm import CommMeter
from allhands.sync.powersgd import PowerSGDMemory

COMPRESSORS = ("none", "fp16", "bf16", "powersgd")


def _metered(hook: Callable, meter: CommMeter, n: int, payload_of: Callable) -> Callable:
    """Wrap a DDP comm hook: record the bucket's payload and the interval it was in flight."""

    # No annotations on ``run``: DDP rejects a hook whose annotations are not the real classes,
    # and this module's annotations are strings (``from __future__ import annotations``).
    def run(state, bucket):
        i = meter.launched()
        before = state.total_numel_after_compression if isinstance(state, psgd.PowerSGDState) else 0
        fut = hook(state, bucket)
        meter.collective("all_reduce", payload_of(state, bucket, before), n)

        def finished(f: torch.futures.Future) -> torch.Tensor:
            meter.done(i)
            return f.value()

        return fut.then(finished)

    return run


def _bucket_bytes(dtype_size: int | None) -> Callable:
    def payload(state: Any, bucket: dist.GradBucket, before: int) -> float:
        buf = bucket.buffer()
        return buf.numel() * (dtype_size or buf.element_size())
    return payload


def _powersgd_bytes(state: psgd.PowerSGDState, bucket: dist.GradBucket, before: int) -> float:
    # The hook adds (n + m) r per compressed matrix and n m per uncompressed tensor to this
    # counter: exactly the elements of its P, Q and uncompressed all-reduces. During the first
    # start_powerSGD_iter steps it all-reduces the whole bucket and leaves the counter alone.
    buf = bucket.buffer()
    after = state.total_numel_after_compression
    return (after - before if after > before else buf.numel()) * buf.element_size()


class AllReduceSync(SyncStrategy):
    name = "allreduce"
    grads_agree = True

    def __init__(self, bucket_mb: float = 25.0, compress: str = "none", powersgd_rank: int = 4,
                 powersgd_start_step: int = 10, reducer: str = "DDP all-reduce every step"):
        super().__init__()
        self.reducer = reducer  # for the log line: sync.reducer() names the layout's collective
        if compress not in COMPRESSORS:
            raise ValueError(f"unknown compressor {compress!r}")
        self.bucket_mb = bucket_mb
        self.compress = compress
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_step = powersgd_start_step
        self.powersgd: PowerSGDMemory | None = None

    def describe(self) -> str:
        extra = f" rank {self.powersgd_rank}" if self.compress == "powersgd" else ""
        return f"allreduce: {self.reducer} (compression {self.compress}{extra})"

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        # parallelize() already applied DDP or FSDP (reconciles_replicas is False); only DDP
        # takes a communication hook.
        if not isinstance(model, DDP):
            if self.compress != "none":
                raise ValueError("sync.compress needs DDP (parallel.zero 0 or 1)")
            return model
        group = model.process_group
        n = group.size()
        if self.compress == "powersgd":
            # min_compression_rate=2 (torch's default) leaves vectors and near-square small
            # matrices uncompressed, where P and Q would not be smaller than the gradient.
            self.powersgd = PowerSGDMemory(psgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_step, use_error_feedback=True,
                warm_start=True, random_seed=0), model.module)
            state, hook, payload = self.powersgd.state, self.powersgd.hook, _powersgd_bytes
        elif self.compress in ("fp16", "bf16"):
            hook = default_hooks.fp16_compress_hook if self.compress == "fp16" else default_hooks.bf16_compress_hook
            state, payload = group, _bucket_bytes(2)
        else:
            state, hook, payload = group, default_hooks.allreduce_hook, _bucket_bytes(None)
        model.register_comm_hook(state, _metered(hook, self.comm, n, payload))
        return model

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        self.comm.close_step()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.powersgd is None else {"powersgd": self.powersgd.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.powersgd is not None and "powersgd" in state:
            self.powersgd.load_state_dict(state["powersgd"])

    def saved_keys(self, keys: set[str]) -> None:
        if self.powersgd is not None:
            self.powersgd.saved_keys(keys)

"""Replicated data parallelism with torch DDP (bucketed all-reduce overlapped with backward)."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands.mesh import Mesh


def apply_ddp(model: nn.Module, mesh: Mesh, *, bucket_mb: float = 25.0, over: str = "dp") -> DDP:
    """Wrap ``model`` (already on ``mesh.device``) in DDP over the mesh dim ``over``: by default
    ``dp``, all data-parallel ranks (dp_replicate x dp_shard).

    DDP broadcasts rank 0's parameters at construction, so replicas start identical even if a
    user's builder was not seeded.
    """
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=mesh.group(over),
               bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)


def apply_replicate(model: nn.Module, mesh: Mesh, *, over: str = "dp",
                    ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """Replicated data parallelism for a pipeline stage: torch's composable ``replicate`` (built
    on FSDP2), which ``torch.distributed.pipelining`` drives across microbatches. DDP itself
    cannot be: its bucket rebuild sees every parameter once per microbatch and fails an internal
    assertion in the second step (torch 2.13, measured). Parameters become replicated DTensors
    over ``over``; gradients are all-reduced once per schedule step. ``ignored`` are left as they
    are (expert-parallel experts: each rank holds other experts, reduced apart)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(model, mesh=mesh.submesh(over), ignored_params=ignored or None)

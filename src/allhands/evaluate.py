"""Two checks the loop runs between steps: the held-out loss (``run.eval_interval``), and whether
replicas still hold identical parameters (``run.check_sync``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from allhands.data.sampler import collate
from allhands.memory import local
from allhands.mesh import Mesh


def evaluate(layout: Any, ds: Any, sampler: Any, batches: int,
             to_device: Callable[[list[torch.Tensor]], list[torch.Tensor]],
             weigh: Callable[[list[int]], int] = len) -> float:
    """The mean loss over ``batches`` global batches of ``ds`` drawn by ``sampler``, without
    gradients, alike on every rank (``layout``: parallel/layout.py's Layout). ``weigh(indices)``,
    called before each batch's loss: its weight in the mean (samples; unmasked targets for
    the token mean, job.TokenMeanLoss)."""
    mesh = layout.mesh
    layout.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), layout.autocast():
        for b in range(batches):
            idx = sampler.local_micro_batches(b, mesh.dp_rank, mesh.dp_size, 1)[0]
            x, y = to_device(collate(ds, idx))
            weight = weigh(idx)
            loss = layout.eval_loss(x, y)
            if layout.reports_loss:
                total[0] += float(loss) * weight
                total[1] += weight
    layout.train()
    # one contribution per data-parallel rank: from its rank that reports_loss
    dist.all_reduce(total)
    return float(total[0] / total[1])


def param_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter, over this rank's local shard of a DTensor."""
    return torch.stack([local(p).detach().double().sum() for p in model.parameters()])


def check_replicas(parts: list[nn.Module], mesh: Mesh, dim: str, step: int) -> None:
    """Raise when the ranks of mesh dim ``dim`` (those that hold equal parameters) differ."""
    mine = torch.cat([param_checksums(part) for part in parts]).cpu()
    gathered = [torch.empty_like(mine) for _ in range(mesh.size(dim))]
    dist.all_gather(gathered, mine, group=mesh.group(dim))
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            bad = int((other != gathered[0]).nonzero()[0])
            name = [n for part in parts for n, _ in part.named_parameters()][bad]
            raise RuntimeError(f"replicas diverged after step {step}: rank {rank}'s parameter "
                               f"{name!r} differs from rank 0's")

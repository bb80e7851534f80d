"""Two checks the loop runs between steps: the held-out loss (``run.eval_interval``), and whether
replicas still hold identical parameters (``run.check_sync``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from allhands import collective
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
    loss_sum, weight_sum = 0.0, 0  # host numbers: each loss is read once, as a Python float
    with torch.no_grad(), layout.autocast():
        for b in range(batches):
            idx = sampler.local_micro_batches(b, mesh.dp_rank, mesh.dp_size, 1)[0]
            x, y = to_device(collate(ds, idx))
            weight = weigh(idx)
            loss = layout.eval_loss(x, y)
            if layout.reports_loss:
                loss_sum += float(loss) * weight
                weight_sum += weight
    layout.train()
    # one contribution per data-parallel rank: from its rank that reports_loss
    total = torch.tensor([loss_sum, weight_sum], dtype=torch.float64, device=collective.device())
    collective.all_reduce(total, call="evaluate")
    return float(total[0] / total[1])


def param_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter, over this rank's local shard of a DTensor."""
    return torch.stack([local(p).detach().double().sum() for p in model.parameters()])


def check_replicas(parts: list[nn.Module], mesh: Mesh, dim: str, step: int) -> None:
    """Raise when the ranks of mesh dim ``dim`` (those that hold equal parameters) differ."""
    mine = torch.cat([param_checksums(part) for part in parts])  # on the parameters' device: the mesh's
    gathered = [torch.empty_like(mine) for _ in range(mesh.size(dim))]
    collective.all_gather(gathered, mine, call="check_replicas", group=mesh.group(dim))
    gathered = [g.cpu() for g in gathered]
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            bad = int((other != gathered[0]).nonzero()[0])
            name = [n for part in parts for n, _ in part.named_parameters()][bad]
            raise RuntimeError(f"replicas diverged after step {step}: rank {rank}'s parameter "
                               f"{name!r} differs from rank 0's")

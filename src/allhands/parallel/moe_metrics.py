"""What an MoE run adds to a logged step's record in metrics.jsonl: routed (token, expert) pairs
per expert per step, summed over the data-parallel ranks (min, max and the max/mean imbalance
over every expert of every MoE layer; ``moe_load`` the per-layer lists the report draws), the
auxiliary balancing loss (mean over layers), and the expert-parallel all_to_all payload and time
of this rank (mean over ranks), all per step since the last logged one."""

from __future__ import annotations

import torch
import torch.nn as nn

from allhands import collective
from allhands.mesh import Mesh
from allhands.models.moe import moe_layers
from allhands.parallel.expert import comm_stats


def moe_record(parts: list[nn.Module], mesh: Mesh, steps: int) -> dict:
    """The MoE fields (collective over the data-parallel ranks; empty without MoE layers)."""
    layers = [m for part in parts for m in moe_layers(part)]
    if not layers:
        return {}
    load = torch.stack([m.tokens for m in layers]).double()  # (layers, experts)
    for m in layers:
        m.tokens.zero_()
    aux = [float(m.last_aux) for m in layers if m.last_aux is not None]
    sent, secs = comm_stats(parts)
    extra = torch.tensor([sent, secs], dtype=torch.float64, device=load.device)
    if mesh.dp_size > 1:
        collective.all_reduce(load, call="moe_record (loads)", group=mesh.dp_group)
        collective.all_reduce(extra, call="moe_record (all_to_all)", group=mesh.dp_group)
        extra /= mesh.dp_size
    load = load.cpu() / max(steps, 1)
    out = {"moe_tokens_per_expert_min": float(load.min()), "moe_tokens_per_expert_max": float(load.max()),
           "moe_imbalance": float((load.max(1).values / load.mean(1).clamp_min(1e-12)).max()),
           "moe_load": [[round(v, 2) for v in row] for row in load.tolist()]}
    if aux:
        out["moe_aux_loss"] = sum(aux) / len(aux)
    if mesh.size("ep") > 1:
        out["moe_a2a_bytes"] = float(extra[0]) / max(steps, 1)
        out["moe_a2a_time"] = float(extra[1]) / max(steps, 1)
    return out

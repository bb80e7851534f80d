"""What each rank holds: training-state bytes counted from the actual local shards, the ZeRO
paper's expected value, and peak memory.

The paper's formula (Rajbhandari et al. 2020, sec. 5) with mixed-precision Adam is
``(2 + 2 + K) * Psi`` with K = 12. Adapted to what allhands trains with (fp32 parameters and
gradients, AdamW with two fp32 moments, no separate master copy): 4 bytes of parameters,
4 of gradients and K = 8 of optimizer state per parameter, Psi parameters, N = dp_shard ranks:

    zero 0 (DDP): 4 Psi + 4 Psi + 8 Psi        = 16 Psi
    zero 1:       4 Psi + 4 Psi + 8 Psi / N
    zero 2:       4 Psi + (4 + 8) Psi / N
    zero 3:       (4 + 4 + 8) Psi / N

AdamW's per-parameter ``step`` counter (a 4-byte scalar) is not in the formula.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from allhands import collective
from allhands.parallel.zero1 import optimizer_for_checkpoint


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from the
    tensors themselves (local shards). Call between optimizer.step() and zero_grad(), the one
    moment all three exist; FSDP2 has resharded its parameters by then (at-rest size)."""
    params = list(model.parameters())  # tied weights appear once
    opt = optimizer_for_checkpoint(optimizer)
    optim = sum(_nbytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return {"params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optim": optim,
            "numel": sum(_model_parallel_numel(p) for p in params)}


def _model_parallel_numel(p: torch.Tensor) -> int:
    """Psi of this rank's model-parallel share: a DTensor's global count divided by its tp
    shards (the formula then divides by dp_shard itself); under pp ``params`` is the stage's."""
    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    tp = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and i < len(names) and names[i] == "tp":
            tp *= p.device_mesh.size(i)
    return p.numel() // tp


def expected_bytes(numel: int, zero: int, shards: int) -> int:
    """The formula in the module docstring: training-state bytes per rank."""
    psi, n = numel, shards
    return int({0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
                3: 16 * psi / n}[zero])


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): CUDA's peak allocated tensor memory, or on CPU the process's
    peak resident set (ru_maxrss: everything, including the Python interpreter and torch)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "ru_maxrss"


def log_memory(metrics: Any, held: dict[str, int] | None, model: nn.Module, mesh: Any, *,
               zero: int, step: int) -> bool:
    """Gather every rank's state bytes (one all_gather) and log them with the formula's value:
    one metrics.jsonl record and one line per rank on rank 0's stderr. Returns True once done."""
    if held is None:
        return False
    # numel per rank: under tp/pp each rank's model-parallel share differs
    mine = torch.tensor([held["params"], held["grads"], held["optim"], held["numel"]], dtype=torch.float64,
                        device=collective.device())
    gathered = [torch.empty_like(mine) for _ in range(mesh.world_size)]
    collective.all_gather(gathered, mine, call="log_memory")
    rows = [[int(v) for v in g] for g in torch.stack(gathered).tolist()]
    expected_rank = [expected_bytes(r[3], zero, mesh.size("dp_shard")) for r in rows]
    expected = expected_rank[0]
    metrics.log({"step": step, "memory_params_bytes": [r[0] for r in rows],
                 "memory_grads_bytes": [r[1] for r in rows], "memory_optim_bytes": [r[2] for r in rows],
                 "memory_expected_bytes": expected, "memory_expected_bytes_rank": expected_rank,
                 "memory_zero": zero,
                 "memory_measured_at": "after step 1, between optimizer.step and zero_grad"})
    if zero == 2:
        metrics.message("allhands: note: FSDP2 frees the full parameters after backward, so at rest a "
                        "ZeRO-2 rank holds only its parameter shard; the formula's 4 Psi of full "
                        "parameters is held from the end of forward to each block's backward")
    for rank, (pb, gb, ob, _), expected in zip(range(len(rows)), rows, expected_rank):
        metrics.message(f"allhands: rank {rank} holds params {pb / 2**20:.2f} MiB, grads "
                        f"{gb / 2**20:.2f} MiB, optimizer state {ob / 2**20:.2f} MiB = "
                        f"{(pb + gb + ob) / 2**20:.2f} MiB; ZeRO-{zero} formula "
                        f"{expected / 2**20:.2f} MiB")
    return True

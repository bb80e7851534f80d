"""The optimizer and its learning-rate schedule: AdamW (or SGD, or Muon) with weight decay on matrices,
one per pipeline stage stepped as one, and linear warmup then cosine decay."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from allhands.config import Config
from allhands.muon import Muon, muon_matrices


def build_optimizer(model: nn.Module | list[nn.Module], cfg: Config,
                    world: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """AdamW (or plain SGD, the linear case the DiLoCo H=1 test needs, or Muon on the hidden
    matrices with AdamW on the rest); weight decay on matrices only (GPT-2/nanoGPT convention).
    ``model`` may be the list of this rank's pipeline stages. ``world``: Muon's group of the
    ranks training this copy of the model (allhands.muon)."""
    o = cfg.optim
    if isinstance(model, list):
        if len(model) > 1:
            return OptimizerParts([build_optimizer(m, cfg, world) for m in model])
        model = model[0]
    matrices = {id(p) for p in muon_matrices(model)} if o.name == "muon" else set()
    decay, no_decay, hidden = [], [], []
    for p in model.parameters():
        if p.requires_grad:
            (hidden if id(p) in matrices else decay if p.dim() >= 2 else no_decay).append(p)
    groups = by_mesh([{"params": decay, "weight_decay": o.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}])
    if o.name == "sgd":
        # torch 2.13's DTensor has no sharding rule for the fused SGD kernel: fused on plain tensors
        return torch.optim.SGD(groups, lr=o.lr, fused=fusable(groups, dtensors=False))
    if o.name == "muon":
        return Muon([{"params": hidden, "weight_decay": o.weight_decay, "muon": True}, *groups],
                    lr=o.lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps,
                    ns_dtype=o.muon_ns_dtype, spread=o.muon_spread, betas=(o.beta1, o.beta2),
                    eps=o.eps, world=world)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=fusable(groups))


def fusable(groups: list[dict], dtensors: bool = True) -> bool | None:
    """True where torch's fused kernels take every parameter (floating point, on a device that
    has them: CUDA and CPU among them), as torchtitan's default: one kernel per group, and a
    skipped step decided on the device (:func:`skip_on_device`); None leaves torch's choice."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    params = [p for g in groups for p in g["params"]]
    return True if params and all(p.is_floating_point() and p.device.type in devices
                                  and (dtensors or not isinstance(p, DTensor))
                                  for p in params) else None


def skip_on_device(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
    """Make ``optimizer``'s next ``step`` a no-op where ``bad`` (a 0-dim float tensor on the
    device) is 1, decided by its fused kernels without reading ``bad`` on the host (torch's
    ``found_inf``, as GradScaler drives it; the step count is put back too). False, and nothing
    set, where some group does not step fused (Muon; a group loaded from an older checkpoint):
    the caller then decides on the host."""
    parts = getattr(optimizer, "optimizers", None) or [optimizer]
    if not all(type(o) in (torch.optim.AdamW, torch.optim.SGD)
               and all(g.get("fused") for g in o.param_groups) for o in parts):
        return False
    for o in parts:
        o.found_inf, o.grad_scale = bad, None
    return True


def by_mesh(groups: list[dict]) -> list[dict]:
    """``groups`` split so that each holds one kind of tensor: plain, or DTensors of one mesh.

    torch's optimizers step a group with foreach kernels, their default on CUDA, and one foreach
    call over plain tensors and DTensors raises ("_foreach_mul_ got mixed torch.Tensor and
    DTensor"). Expert parallelism mixes them: replicated dense parameters beside experts sharded
    over the ep mesh. Groups of one kind are returned as they are, empty ones included; split
    ones keep their hyper-parameters and drop their empty parts (DCP's flat-key loader indexes
    each group's first parameter). Checkpoints key optimizer state and hyper-parameters by
    parameter name (checkpoint/state.py), so they load under either grouping."""
    if len({_mesh(p) for g in groups for p in g["params"]}) <= 1:
        return groups
    out = []
    for g in groups:
        parts: dict = {}
        for p in g["params"]:
            parts.setdefault(_mesh(p), []).append(p)
        out += [{**g, "params": ps} for ps in parts.values()]
    return out


def _mesh(p: torch.Tensor):
    """A DTensor's device mesh, None for a plain tensor."""
    return p.device_mesh if isinstance(p, DTensor) else None


class OptimizerParts(torch.optim.Optimizer):
    """One AdamW per pipeline stage of this rank (interleaved schedules hold several), stepped
    as one. Its ``param_groups`` are the stages' own group dicts, so one LR scheduler drives all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers: list[torch.optim.Optimizer] = []  # no groups while Optimizer.__init__ adds its own
        super().__init__([q for o in optimizers for g in o.param_groups for q in g["params"]],
                         dict(optimizers[0].defaults))
        self.optimizers = optimizers

    @property
    def param_groups(self):
        # read live: loading a checkpoint (Optimizer.load_state_dict) replaces a stage optimizer's
        # group dicts, and an LR scheduler holding the old ones would set LRs nobody reads
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:  # Optimizer.__init__ assigns its own; stages hold theirs
        pass

    @property
    def state(self):  # every stage's state, e.g. for counting its bytes
        return {p: st for o in self.optimizers for p, st in o.state.items()}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty one; stages hold theirs
        pass

    def step(self, closure=None):  # the stages' optimizers step in turn
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine to ``min_lr_ratio`` at the last step."""
    o, total = cfg.optim, cfg.run.steps

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        span = max(1, total - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f

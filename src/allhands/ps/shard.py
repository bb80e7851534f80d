"""A parameter server's shard as checkpoint state (parameters, optimizer state, version,
embedding rows) and the optimizer that steps it (ps/server.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.checkpoint.stateful import Stateful

from allhands.config import Config
from allhands.errors import ConfigError
from allhands.optim import fusable


def server_optimizer(cfg: Config, decay: list[torch.Tensor], no_decay: list[torch.Tensor],
                     lr: float) -> torch.optim.Optimizer:
    """``auto``: the optim section's optimizer, weight decay on matrices only (as the workers'
    would be); else the named torch.optim class with its defaults and ``lr``."""
    name, o = cfg.ps.optimizer, cfg.optim
    if name == "auto":
        groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        if o.name == "sgd":  # fused as the workers' (optim.fusable), so async on one worker is theirs
            return torch.optim.SGD(groups, lr=lr, fused=fusable(groups, dtensors=False))
        return torch.optim.AdamW(groups, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fusable(groups))
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"ps.optimizer: {name!r} is not a torch.optim optimizer; use auto or a "
                          f"class name such as Adagrad, SGD, Adam")
    return cls(decay + no_decay, lr=lr)


class Shard(Stateful):
    """This server's parameters and optimizer state, for the Checkpointer (keys per server)."""

    def __init__(self, server: Any):
        self.server = server

    def state_dict(self) -> dict[str, Any]:
        s = self.server
        optim = {}
        if s.opt is not None:
            _init_optim_state(s.opt)  # lazily created state: a load needs its shapes
            for p in s.pieces:
                p.grad = None
            optim = {f"{k}.{field}": v for k, p in enumerate(s.pieces)
                     for field, v in s.opt.state[p].items() if isinstance(v, torch.Tensor)}
        return {f"server{s.roles.index}": {"params": s.flat, "version": torch.tensor(s.version),
                                           "optim": optim,
                                           "tables": {str(k): t.state() for k, t in s.tables.items()}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.server
        mine = state[f"server{s.roles.index}"]
        with torch.no_grad():
            s.flat.copy_(mine["params"])
        s.version = int(mine["version"])
        for key, v in mine["optim"].items():
            k, field = key.split(".", 1)
            s.opt.state[s.pieces[int(k)]][field].copy_(v)
        for k, t in s.tables.items():
            t.load(mine["tables"][str(k)])

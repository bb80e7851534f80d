"""What a user brings to a run (model, data, loss, tensor-parallel plan) and the defaults that
stand in for what they leave out: the reference model, the token shards and the LM loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from allhands.config import Config
from allhands.data import load_training_data
from allhands.models.build import build_model, family_config, with_preset

ModelFn = Callable[[Config], nn.Module]
DataFn = Callable[[Config], Any]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Job:
    """What a user brings. ``None`` fields take the reference GPT, token shards and LM loss."""

    model: ModelFn | None = None
    data: DataFn | None = None
    loss: LossFn | None = None
    tp_plan: Any = None  # {fqn: ParallelStyle} or (model, sequence_parallel) -> that; see parallel/tensor.py


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; logits ``(B, T, V)``, targets ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def build_reference_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The model ``cfg.model`` names (the reference GPT or a Llama-family decoder); a preset
    still unresolved is resolved here (models/build.py)."""
    return build_model(family_config(with_preset(cfg.model), vocab_size, cfg.moe))


def build_data(cfg: Config, job: Job):
    """(train, val or None, vocab_size or None)."""
    if job.data is not None:
        out = job.data(cfg)
        train, val = out if isinstance(out, tuple) else (out, None)
        return train, val, None
    return load_training_data(cfg)  # data.path or data.mix

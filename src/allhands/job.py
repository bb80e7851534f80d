"""What a user brings to a run (model, data, loss, tensor-parallel plan) and the defaults that
stand in for what they leave out: the reference model, the token shards and the LM loss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from allhands.config import Config, parse_mix
from allhands.data import load_training_data
from allhands.data.shards import load_meta
from allhands.models.build import build_model, family_config, moe_preset, with_preset

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


# Both default losses only flatten the leading dims, cast and call F.cross_entropy (targets of
# -100 ignored), which torch's loss_parallel computes on logits sharded on the vocabulary; under
# tp the layout hands them such logits (parallel/tensor.py), a user's loss gets them gathered.
lm_loss.vocab_parallel = True  # type: ignore[attr-defined]


class TokenMeanLoss:
    """Next-token cross entropy averaged over the targets that carry loss (not -100) in the
    whole global batch, for data with a loss mask (instruction examples).

    A mean per micro-batch would weight a target by how many others share its micro-batch, and
    averaging per-rank means is not the global mean when ranks hold different numbers of
    unmasked targets. So each loss call returns its sum divided by ``per_call`` = (the step's
    unmasked targets, counted on every rank from the sampler's global batch) / (the loss calls
    whose results the step averages: data-parallel ranks x micro-batches x pipeline
    microbatches). The 1/micro-batches and 1/microbatches scales and the gradient average over
    ranks then give exactly sum / count over the global batch, at any world size."""

    vocab_parallel = True  # takes vocabulary-sharded logits under tp (see lm_loss)

    def __init__(self):
        self.per_call = 1.0

    def begin(self, targets: int, calls: int) -> None:
        """Before a step (or an evaluation batch): its unmasked targets and its loss calls."""
        self.per_call = max(targets, 1) / calls  # a batch without targets: a loss of 0, no NaN

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                               reduction="sum") / self.per_call


def default_loss(train_ds) -> LossFn:
    """The loss for the built-in data: the token mean over unmasked targets for masked data,
    the plain mean otherwise."""
    return TokenMeanLoss() if getattr(train_ds, "masked_targets", False) else lm_loss


def build_reference_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The model ``cfg.model`` names (the reference GPT or a Llama-family decoder); a preset
    still unresolved is resolved here (models/build.py)."""
    fc = family_config(with_preset(cfg.model), vocab_size, moe_preset(cfg.model, cfg.moe))
    if cfg.data.packing == "mask":  # rows of packed documents: the model masks by their end token
        fc = dataclasses.replace(fc, doc_token=document_token(cfg))
    return build_model(fc)


def document_token(cfg: Config) -> int:
    """The end-of-document token id of the job's prepared data (every source of a mix shares it)."""
    path = parse_mix(cfg.data.mix)[0][0] if cfg.data.mix else cfg.data.path
    return int(load_meta(path)["eot"])


def build_data(cfg: Config, job: Job):
    """(train, val or None, vocab_size or None)."""
    if job.data is not None:
        out = job.data(cfg)
        train, val = out if isinstance(out, tuple) else (out, None)
        return train, val, None
    return load_training_data(cfg)  # data.path or data.mix

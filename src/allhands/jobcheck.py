"""What a user hands to ``allhands.train`` (model, data, loss) checked before the first step, each
mistake one line naming it: the API's side of the rule that user errors are not tracebacks.

``model=`` is a builder ``(config) -> nn.Module`` or an ``nn.Module`` instance. An instance is
trained as given: under ``allhands launch`` every rank builds its own, so seed before building it
(DDP broadcasts rank 0's parameters; FSDP and tensor parallel take each rank's as they are).
``data=`` is a builder ``(config) -> dataset or (train, val)``, or those values themselves; a
dataset is map-style (``__len__`` and ``__getitem__``) or an ``IterableDataset``, read as a
stream by the rule in data/iterable.py.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from allhands.data.iterable import StreamSampler, StreamView
from allhands.data.sampler import GlobalSampler
from allhands.errors import ConfigError


class _Given:
    """A builder that returns a value the user passed instead of a builder."""

    def __init__(self, value: Any):
        self.value = value

    def __call__(self, cfg: Any) -> Any:
        return self.value


def _takes(fn: Callable, n: int) -> bool:
    """``fn`` can be called with ``n`` positional arguments (True when its signature is unknown)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # builtins without a signature
        return True
    return True


def _builder(value: Any, name: str, given: bool, returns: str) -> Callable | None:
    """``value`` as a function of the config: itself if it is one, else (``given``) a builder
    that returns it."""
    if value is None:
        return None
    if given:
        return _Given(value)
    if not _takes(value, 1):
        raise ConfigError(f"{name}: the builder {getattr(value, '__name__', value)!r} does not take "
                          f"one argument; it is called with the config: (config) -> {returns}")
    return value


def model_builder(model: Any) -> Callable | None:
    if model is not None and not isinstance(model, nn.Module) and not callable(model):
        raise ConfigError(f"model: {type(model).__name__} is neither an nn.Module nor a builder; "
                          f"pass an nn.Module or a function (config) -> nn.Module")
    return _builder(model, "model", isinstance(model, nn.Module), "nn.Module")


def data_builder(data: Any) -> Callable | None:
    given = isinstance(data, (torch.utils.data.Dataset, tuple, list)) or not callable(data)
    return _builder(data, "data", given, "dataset or (train, val)")


def loss_function(loss: Any) -> Callable | None:
    if loss is None:
        return None
    if not callable(loss) or not _takes(loss, 2):
        raise ConfigError("loss: pass a function (output, target) -> scalar tensor")
    return loss


def checked_model(module: Any) -> nn.Module:
    """The model the builder returned, if it is one that can be trained."""
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model: the builder returned {type(module).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"model: {type(module).__name__} has no trainable parameters (none with "
                          f"requires_grad=True); unfreeze some or pass another model")
    return module


def checked_loss(fn: Callable) -> Callable:
    """``fn`` that fails in one line when it returns what backward cannot start from."""

    def loss(output: Any, target: Any) -> torch.Tensor:
        value = fn(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise ConfigError(f"loss: returned {what}, not a scalar tensor; reduce it, e.g. "
                              f"with .mean()")
        if torch.is_grad_enabled() and not value.requires_grad:
            raise ConfigError("loss: its value does not depend on the model's output (no grad); "
                              "compute it from the output with torch ops, without .detach()/.item()")
        return value

    return loss


def _dataset(ds: Any, name: str) -> Any:
    if isinstance(ds, torch.utils.data.IterableDataset):
        return StreamView(ds, name)
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise ConfigError(f"{name}: {type(ds).__name__} is neither a map-style dataset (__len__ and "
                          f"__getitem__) nor a torch IterableDataset")
    return ds


def checked_data(train: Any, val: Any, global_batch: int) -> tuple[Any, Any]:
    """(train, val) ready for :func:`sampler_for`; a map-style training set must hold one global
    batch (a smaller one would repeat samples inside every step)."""
    train = _dataset(train, "data")
    val = _dataset(val, "data (validation)") if val is not None else None
    if not isinstance(train, StreamView) and len(train) < global_batch:
        raise ConfigError(f"run.global_batch: {global_batch} is more than the {len(train)} training "
                          f"samples; lower run.global_batch or pass more data")
    return train, val


def sampler_for(ds: Any, global_batch: int, seed: int) -> GlobalSampler | None:
    """The step -> indices rule for ``ds`` (None for no or empty validation data)."""
    if isinstance(ds, StreamView):
        return StreamSampler(global_batch)
    return GlobalSampler(len(ds), global_batch, seed) if ds is not None and len(ds) else None


def check_token_data(path: str, seq_len: int, global_batch: int) -> None:
    """Before any worker starts: the prepared tokens hold one global batch of training samples
    (a sample is ``seq_len + 1`` tokens inside one shard, as shards.TokenDataset cuts them)."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
        shards = [int(e["tokens"]) for e in meta["splits"]["train"]]
        examples = sum(int(e["examples"]) for e in meta["splits"]["train"]) \
            if meta.get("kind") == "instruct" else None
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable metadata: the workers' loader names what is wrong with it
    if examples is not None:  # instruction data: one sample per example (data/examples.py)
        if examples < global_batch:
            raise ConfigError(f"data.path: {path!r} holds {examples} training examples, fewer than "
                              f"run.global_batch={global_batch}; add examples or lower "
                              f"run.global_batch")
        return
    samples = sum((n - 1) // seq_len for n in shards if n > seq_len)
    if samples < global_batch:
        raise ConfigError(f"data.path: {path!r} holds {samples} training samples of model.seq_len+1="
                          f"{seq_len + 1} tokens, fewer than run.global_batch={global_batch}; add "
                          f"text, or lower model.seq_len or run.global_batch")

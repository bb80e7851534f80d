"""The Stateful contract's pieces: model + optimizer (``get_state_dict``, any layout), the
train state (step, samples, the data cursor), and every rank's random generators.

Each has ``state_dict()`` / ``load_state_dict()``; the checkpointer saves a dict of them under
fixed keys and knows nothing else about them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimState(Stateful):
    """Model and optimizer through DCP's state_dict helpers (they strip DDP's ``module.``,
    activation checkpointing's wrapper names, and gather nothing: FSDP/TP shards stay DTensors
    that DCP reshards on load).

    Optimizer keys are flat (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): one entry per
    parameter, whichever rank holds it, so a ZeRO-1 rank that owns only some parameters writes
    exactly its entries and every layout reads every other's checkpoint.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    # Parameters and optimizer state change only in ``optimizer.step()``, so an async save may
    # copy them to host memory while the next forward/backward runs (see Checkpointer.save).
    # Buffers may change in forward (BatchNorm statistics), so they are copied at once.
    overlap_until_update = True

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 aliases: dict[str, str] | list[dict[str, str]] | None = None):
        # ``model`` may be the list of this rank's pipeline stages (interleaved schedules), with
        # ``optimizer.optimizers`` one optimizer per stage: the helpers map parameters to FQNs
        # one module at a time. Flat keys make the stages' entries disjoint.
        # ``aliases``: optimizer-state names of tied copies, {local FQN: the unsplit model's FQN}
        # (the last pipeline stage's ``lm_head.weight`` is ``tok_emb.weight`` in one module,
        # which keys a shared parameter's state by its first name); a list: one dict per stage,
        # for a rank holding both copies in two stages (the V pipeline schedules' rank 0).
        self.model, self.optimizer = model, optimizer
        self.aliases = aliases or {}

    def _parts(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, str]]]:
        if isinstance(self.model, list):
            names = self.aliases if isinstance(self.aliases, list) else [self.aliases] * len(self.model)
            return list(zip(self.model, self.optimizer.optimizers, names))
        names = self.aliases[0] if isinstance(self.aliases, list) else self.aliases
        return [(self.model, self.optimizer, names)]

    def state_dict(self) -> dict[str, Any]:
        msd: dict[str, Any] = {}
        osd: dict[str, Any] = {}
        for model, optim, aliases in self._parts():
            m, o = get_state_dict(model, optim, options=self.OPTIONS)
            buffers = {b.untyped_storage().data_ptr() for b in model.buffers() if type(b) is torch.Tensor}
            if buffers:
                m = {k: v.clone() if type(v) is torch.Tensor and v.untyped_storage().data_ptr() in buffers
                     else v for k, v in m.items()}
            msd.update(m)
            osd.update(_pack_param_groups(_rename_optim_keys(o, aliases)))
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = self._parts()
        for model, optim, aliases in parts:
            back = {v: k for k, v in aliases.items()}
            msd, osd = state["model"], _rename_optim_keys(_unpack_param_groups(state["optim"]), back)
            if len(parts) > 1:  # each stage takes its own keys (strict loading stays on)
                mine = set(get_state_dict(model, optim, options=self.OPTIONS)[0])
                msd = {k: v for k, v in msd.items() if k in mine}
                osd = {k: v for k, v in osd.items() if k.split(".", 1)[1].rsplit(".", 1)[0] in mine}
                # Two stages of this rank holding tied copies read the same entries, and
                # Optimizer.load_state_dict keeps a loaded tensor as is: without a copy each
                # it would be one moment tensor both stages' optimizers update in place.
                osd = {k: v.clone() if isinstance(v, torch.Tensor) and
                       k.split(".", 1)[1].rsplit(".", 1)[0] in aliases else v for k, v in osd.items()}
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=self.OPTIONS)


def _pack_param_groups(osd: dict[str, Any]) -> dict[str, Any]:
    """``param_groups.<fqn>.<leaf>`` scalars -> one ``param_groups.<fqn>`` list of
    ``[leaf, value]`` pairs per parameter (a list of scalars is one DCP item).

    DCP writes every non-tensor leaf as its own ``torch.save``; for AdamW that is ~12 scalars
    per parameter (lr, betas, eps, ... , initial_lr), 572 of the 781 items of the benchmark GPT's
    state, and most of the CPU an async save costs the training ranks (BENCHMARKS.md). Packed
    per parameter, the keys stay per FQN, so every layout still reads every other's checkpoint.
    """
    out: dict[str, Any] = {}
    groups: dict[str, list] = {}
    for key, value in osd.items():
        if key.startswith("param_groups."):
            fqn, leaf = key[len("param_groups."):].rsplit(".", 1)
            groups.setdefault(f"param_groups.{fqn}", []).append([leaf, value])
        else:
            out[key] = value
    out.update({k: sorted(v, key=lambda pair: pair[0]) for k, v in groups.items()})
    return out


def _unpack_param_groups(osd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in osd.items():
        if key.startswith("param_groups.") and isinstance(value, list):
            out.update({f"{key}.{leaf}": v for leaf, v in value})
        else:
            out[key] = value
    return out


def _rename_optim_keys(osd: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state.<fqn>.<leaf>`` / ``param_groups.<fqn>.<leaf>`` with ``fqn`` renamed by ``names``."""
    if not names:
        return osd
    out = {}
    for key, value in osd.items():
        kind, rest = key.split(".", 1)
        fqn, leaf = rest.rsplit(".", 1)
        out[f"{kind}.{names.get(fqn, fqn)}.{leaf}"] = value
    return out


class SchedulerState(Stateful):
    """A ``LambdaLR`` by its step count alone. The scheduler's own state dict holds one base and
    last LR per parameter group, and the group count follows the layout (a pipeline rank with
    two stages has two optimizers' groups): resuming under another schedule or stage count
    would zip a short list. The LRs are the lambdas' values at the restored step."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.scheduler.last_epoch, "_step_count": self.scheduler._step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch, s._step_count = int(state["last_epoch"]), int(state["_step_count"])
        s._last_lr = [base * f(s.last_epoch) for base, f in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, s._last_lr):
            group["lr"] = lr


class TrainState(Stateful):
    """Completed steps and the data cursor (a step count is the whole cursor: see sampler.py)."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0
        self.nonfinite_skips = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.samples),
                "nonfinite_skips": torch.tensor(self.nonfinite_skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples = int(state["samples"])
        self.nonfinite_skips = int(state["nonfinite_skips"])


class RNGState(Stateful):
    """Python, NumPy, torch CPU (and CUDA) generators of this rank, stored as tensors only.

    Each rank saves under its own key ``rank<R>`` so DCP does not deduplicate them as
    replicated; no pickled object is needed to restore them.
    """

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        version, py_state, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": torch.tensor(py_state, dtype=torch.int64),
            "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
            "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
            "numpy_rest": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state[self.key]
        torch.set_rng_state(s["torch"])
        has_gauss, gauss = s["python_gauss"].tolist()
        random.setstate((3, tuple(int(v) for v in s["python"].tolist()), gauss if has_gauss else None))
        pos, np_has_gauss, np_gauss = s["numpy_rest"].tolist()
        np.random.set_state(("MT19937", s["numpy_keys"].numpy().astype(np.uint32), int(pos),
                             int(np_has_gauss), float(np_gauss)))
        if "cuda" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state(s["cuda"])


def seed_rank(seed: int, rank: int) -> None:
    """Per-rank generators for dropout and user code: distinct per rank, reproducible per job."""
    s = seed * 7919 + 1 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)

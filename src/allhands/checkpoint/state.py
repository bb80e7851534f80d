"""The Stateful contract's pieces: model + optimizer (``get_state_dict``, any layout), the
train state (step, samples, the data cursor), and every rank's random generators.

Each has ``state_dict()`` / ``load_state_dict()``; the checkpointer saves a dict of them under
fixed keys and knows nothing else about them.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
# The name map get_state_dict applies to every key (private, stable since torch 2.2); used once
# per run to learn the maps, whose result is checked against get_state_dict's own (_learn_keys).
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.tensor import DTensor
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
            keys = _KEYS.get(optim)
            if keys is not None and keys is not False and keys.model() is not model:
                keys = None
            fast = _fast_state_dict(model, optim, keys, aliases) if keys else None
            if fast is None:
                m, o = get_state_dict(model, optim, options=self.OPTIONS)
                if keys is not False and optim.state:  # (re)learn the maps; False: no fast path
                    _KEYS[optim] = _learn_keys(model, optim, m, o)
                buffers = {b.untyped_storage().data_ptr() for b in model.buffers() if type(b) is torch.Tensor}
                m = {k: v.clone() if type(v) is torch.Tensor and v.untyped_storage().data_ptr() in buffers
                     else v for k, v in m.items()}
                o = _pack_param_groups(_rename_optim_keys(o, aliases))
            else:
                m, o = fast
                m = {k: v.clone() if k in keys.buffers else v for k, v in m.items()}
            msd.update(m)
            osd.update(o)
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


@dataclass
class _Keys:
    """What ``get_state_dict`` computes on every call and what never changes while the model's
    keys and the optimizer's parameters stay the same: the DCP key of each ``model.state_dict()``
    key (DDP's ``module.``, compile's ``_orig_mod.``, activation checkpointing's wrapper names
    dropped) and of each optimizer parameter index. Finding them walks every module per
    parameter: 3.4 ms of the training thread per save for the benchmark GPT's 52 parameters,
    against 0.3 ms for the state dicts themselves (torch 2.13)."""

    model: Callable[[], torch.nn.Module | None]  # a weak reference
    raw: tuple[str, ...]
    fqn: dict[str, str]
    params: list[torch.Tensor]
    pid_fqn: dict[int, str]
    buffers: frozenset[str]


# Learned key maps per optimizer (the trainer builds a ModelOptimState per save); False: none.
_KEYS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Keys | bool] = weakref.WeakKeyDictionary()


def _optim_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


def _fast_state_dict(model: torch.nn.Module, optim: torch.optim.Optimizer, keys: _Keys,
                     aliases: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``get_state_dict(model, optim, flatten_optimizer_state_dict=True)`` from the learned key
    maps, or None where they may not hold (other keys or parameters, no optimizer state yet:
    ``get_state_dict`` would initialise it with a zero step). With ``aliases``: the optimizer
    part as ``ModelOptimState`` stores it, renamed and with packed parameter groups."""
    raw = model.state_dict()
    params = _optim_params(optim)
    if (tuple(raw) != keys.raw or not optim.state or len(params) != len(keys.params)
            or any(a is not b for a, b in zip(params, keys.params))):
        return None
    sd = optim.state_dict()
    if any(pid not in keys.pid_fqn for pid in sd["state"]):
        return None
    name = keys.pid_fqn if aliases is None else {pid: aliases.get(f, f) for pid, f in keys.pid_fqn.items()}
    o: dict[str, Any] = {}
    for pid, st in sd["state"].items():
        _flatten(st, f"state.{name[pid]}", o)
    for group in sd["param_groups"]:
        leaves = sorted([k, v] for k, v in group.items() if k != "params")
        for pid in group["params"]:
            if pid not in name:
                return None
            if aliases is None:
                o.update((f"param_groups.{name[pid]}.{k}", v) for k, v in leaves)
            else:  # _pack_param_groups's form
                o[f"param_groups.{name[pid]}"] = [list(pair) for pair in leaves]
    return {keys.fqn[k]: v for k, v in raw.items()}, o


def _flatten(d: dict[Any, Any], prefix: str, out: dict[str, Any]) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _flatten(v, f"{prefix}.{k}", out)
        else:
            out[f"{prefix}.{k}"] = v


def _learn_keys(model: torch.nn.Module, optim: torch.optim.Optimizer, m: dict[str, Any],
                o: dict[str, Any]) -> _Keys | bool:
    """The key maps behind ``get_state_dict``'s answer ``m, o``, kept only if the fast path gives
    that same answer: the same keys, every tensor the same storage, view and placements, every
    other value equal. False (never try again) for anything else, e.g. FSDP1's flat parameters."""
    raw = model.state_dict()
    fqns = {k: _get_fqns(model, k) for k in raw}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        found = _get_fqns(model, name)
        if len(found) == 1:
            names.setdefault(id(p), next(iter(found)))
    params = _optim_params(optim)
    if any(len(f) != 1 for f in fqns.values()):
        return False
    pid_fqn = {pid: names[id(p)] for pid, p in enumerate(params) if id(p) in names}
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers() if type(b) is torch.Tensor}
    keys = _Keys(weakref.ref(model), tuple(raw), {k: next(iter(f)) for k, f in fqns.items()}, params, pid_fqn,
                 frozenset(k for k, v in m.items() if type(v) is torch.Tensor
                           and v.untyped_storage().data_ptr() in buffers))
    fast = _fast_state_dict(model, optim, keys)
    if fast is None or not (_same(fast[0], m) and _same(fast[1], o)):
        return False
    return keys


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def ident(v: Any) -> Any:
        local = v.to_local() if isinstance(v, DTensor) else v
        return (type(v), v.shape, v.dtype, local.untyped_storage().data_ptr(), local.stride(),
                local.storage_offset(), getattr(v, "placements", None))

    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or ident(x) != ident(y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


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

    fresh = True  # state_dict() builds new tensors and numbers: an async save need not copy them

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

    fresh = True  # state_dict() builds new tensors and numbers: an async save need not copy them

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

    fresh = True  # state_dict() builds new tensors and numbers: an async save need not copy them

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

"""Initial weights without the whole model: a family's constructor runs on the meta device under
:class:`InitRecord`, which notes every random draw and fill it makes, in order; each rank then
replays the record on the CPU from the generator state the constructor started with, and keeps
only the elements of the parameters it holds (its FSDP shard, tensor-parallel slice, pipeline
stage, experts). The values are bit for bit those of the model built whole in one process from
the same seed, under every layout: the replay draws the numbers the eager constructor draws.

Why a parameter can be replayed a chunk at a time (torch's CPU kernels,
ATen/native/cpu/DistributionTemplates.h): ``uniform_`` draws one number per element in memory
order; ``normal_`` of 16 or more elements draws one uniform number per element, then turns each
run of 16 into normals (Box-Muller) on its own, redrawing the last 16 when the size is not a
multiple of 16. Chunks of whole rows that are multiples of 16 elements, the last one at least 16,
draw the same numbers as one call. So a rank holds its shards plus one chunk at a time, whatever
the size of the largest parameter. A generator cannot skip ahead: every rank draws every
number, one pass over the model's draws, as building it whole did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

CHUNK_NUMEL = 1 << 22  # elements replayed at a time: 16 MiB of float32
# segments wrappers add to parameter names (activation checkpointing, torch.compile)
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
_aten = torch.ops.aten
_DRAWS = {_aten.uniform_.default: ("uniform", ("from", "to"), (0.0, 1.0)),
          _aten.normal_.default: ("normal", ("mean", "std"), (0.0, 1.0))}
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}


def local_block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(the tensor this rank holds, its slice of the global tensor or None when it is whole)."""
    if not hasattr(t, "device_mesh"):  # a plain tensor, not a DTensor
        return t, None
    # Imported here, for start-up time: torch.distributed.tensor adds about half a second to
    # `import allhands.models`, which only a model cut into DTensors needs. DCP's own helper for
    # where a DTensor's local block sits (it handles uneven FSDP shards); torch has no public one.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def clean_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _key(t: torch.Tensor) -> int:
    # the storage, not the Python object: nn.Parameter(t) is a new tensor over t's storage
    return t.untyped_storage()._cdata


@dataclass
class _Op:
    kind: str  # uniform, normal or fill
    target: torch.Tensor  # the meta tensor written, kept alive so that its key stays unique
    args: tuple[float, ...]


class InitRecord(TorchDispatchMode):
    """Notes the writes a constructor on the meta device makes: random draws from the global
    generator (``uniform_``, ``normal_``) and fills, on whole tensors. Any other random op, or a
    draw from a generator of its own, cannot be replayed and is named in ``unsupported``."""

    def __init__(self):
        super().__init__()
        self.rng = torch.get_rng_state()  # the constructor's first draw starts here
        self.ops: list[_Op] = []
        self.unsupported: list[str] = []
        self.other_writes: set[int] = set()  # tensors changed in a way the replay cannot repeat

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        meta = target is not None and target.is_meta
        if func in _DRAWS and meta:
            kind, names, defaults = _DRAWS[func]
            given = [args[1 + i] if len(args) > 1 + i else kwargs.get(n, d)
                     for i, (n, d) in enumerate(zip(names, defaults))]
            if kwargs.get("generator") is not None or not _whole(target):
                self.unsupported.append(f"{func} with its own generator or on part of a tensor")
            self.ops.append(_Op(kind, target, tuple(float(a) for a in given)))
        elif func in _FILLS and meta and _whole(target):
            self.ops.append(_Op("fill", target, (float(args[1]) if len(args) > 1 else 0.0,)))
        elif torch.Tag.nondeterministic_seeded in func.tags:
            self.unsupported.append(str(func))
        elif meta and func._schema.is_mutable:
            self.other_writes.add(_key(target))
        return out


def _whole(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of a tensor of ``shape`` whose draws, one range at a time, are
    those of one draw of the whole tensor."""
    if len(shape) == 0 or math.prod(shape) < 16:
        return [(0, shape[0] if shape else 1)]
    rows, row = shape[0], math.prod(shape[1:]) or 1
    unit = 16 // math.gcd(row, 16)  # rows in a multiple of 16 elements
    step = max(unit, CHUNK_NUMEL // row // unit * unit)
    out, r = [], 0
    while r < rows:
        end = min(rows, r + step)
        if 0 < (rows - end) * row < 16:  # a tail under 16 elements joins this chunk
            end = rows
        out.append((r, end))
        r = end
    return out


def _draw(op: _Op, g: torch.Generator, rows: tuple[int, int]) -> torch.Tensor:
    t = op.target
    block = torch.empty((rows[1] - rows[0], *t.shape[1:]) if t.dim() else (), dtype=t.dtype)
    if op.kind == "uniform":
        return block.uniform_(*op.args, generator=g)
    return block.normal_(*op.args, generator=g)


def _store(local: torch.Tensor, index: tuple[slice, ...] | None, r0: int,
           block: torch.Tensor | float) -> int:
    """Write into ``local`` (the block ``index`` of a global tensor; None: all of it) the part it
    holds of ``block``, rows ``r0 ..`` of the global tensor, or a fill value; returns how many
    elements it wrote."""
    if not isinstance(block, torch.Tensor):
        local.fill_(block)
        return local.numel()
    if local.dim() == 0:
        local.copy_(block)
        return 1
    want = index[0] if index else slice(0, local.shape[0])
    a, z = max(r0, want.start), min(r0 + block.shape[0], want.stop)
    if a >= z:
        return 0
    rest = (slice(None), *index[1:]) if index else (slice(None),)
    out = local[a - want.start:z - want.start]
    out.copy_(block[a - r0:z - r0][rest])
    return out.numel()


def _shared_slots(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) slots of each parameter held in more than one place."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    return [s for s in slots.values() if len(s) > 1]


def materializer(model: nn.Module, record: InitRecord,
                 device: torch.device | str) -> Callable[[nn.Module], nn.Module]:
    """For ``model``, built whole on the meta device under ``record``, the function that
    allocates a part cut from it (a stage, FSDP or tensor-parallel shards) on ``device``, its
    shards only, and fills it with the values the model built whole in one process gets."""
    if record.unsupported:
        raise RuntimeError(f"{type(model).__name__}'s constructor draws with {record.unsupported[0]}, "
                           f"which a model built on the meta device cannot replay")
    # by the names of the whole model: a stage or a shard no longer holds the recorded tensors
    key_of = {clean_name(n): _key(p) for n, p in model.named_parameters(remove_duplicate=False)}
    last = {_key(op.target): i for i, op in enumerate(record.ops)}

    @torch.no_grad()
    def materialize(part: nn.Module) -> nn.Module:
        tied = _shared_slots(part)
        part.to_empty(device=device)
        for (owner, name), *others in tied:  # to_empty gives each slot a Parameter of its own
            for m, n in others:
                m._parameters[n] = owner._parameters[name]
        for m in part.modules():  # buffers computed from the config (the RoPE table, MoE counts)
            if callable(getattr(m, "init_buffers", None)):
                m.init_buffers()
        wanted: dict[int, list[tuple[torch.Tensor, tuple[slice, ...] | None]]] = {}
        for name, p in part.named_parameters():
            key = key_of[clean_name(name)]
            if key not in last or key in record.other_writes:
                raise RuntimeError(f"{clean_name(name)}: its constructor's initialisation cannot be "
                                   f"replayed (none recorded, or a write other than a fill or draw)")
            wanted.setdefault(key, []).append(local_block(p))
        g = torch.Generator()
        g.set_state(record.rng)
        for i in range(max((last[k] for k in wanted), default=-1) + 1):
            op = record.ops[i]
            keep = wanted.get(_key(op.target), ()) if last[_key(op.target)] == i else ()
            if op.kind == "fill":
                for local, index in keep:
                    _store(local, index, 0, op.args[0])
                continue
            for rows in _chunks(tuple(op.target.shape)):  # every draw, kept or not
                block = _draw(op, g, rows)
                for local, index in keep:
                    _store(local, index, rows[0], block)
        return part

    return materialize

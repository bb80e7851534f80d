"""Embedding tables moved by row under the parameter server: a worker's ``nn.Embedding`` /
``nn.EmbeddingBag`` keeps no weight, fetches the rows its batch uses at forward, and pushes
(row ids, gradient rows); a server keeps its row range of the table with row-wise optimizer
state and updates only the rows it was sent (DistBelief's and Li et al.'s sparse pushes).

Which parameters are tables (``ps.sparse``): ``auto`` takes the weight of every Embedding /
EmbeddingBag whose weight no other module uses (a weight tied to an output head has a dense
gradient), without ``max_norm`` (which renormalises the whole weight in place); a comma list of
parameter names marks those instead (each must satisfy the same conditions); ``none`` disables.

A model may build a table on the meta device (``nn.Embedding(n, d, device="meta")``): no worker
ever allocates it, and the servers draw their rows from N(0, ``ps.row_init_std``), seeded by
blocks of rows so the values do not depend on the number of servers. A table built with values
is sent to the servers once (by worker 0) and dropped on the workers.

The server's optimizer steps the touched rows with the torch optimizer's own code (a parameter
holding the gathered rows, its state gathered from the row-wise state) and scatters them back:
*lazy* semantics, as torch's ``SparseAdam`` and TensorFlow's LazyAdam. An untouched row keeps its
value and its state, whereas a dense optimizer would still decay its moments and apply weight
decay to it; the table's step count (Adam's bias correction) counts the table's updates. For
Adagrad without weight decay (DistBelief's choice) and for plain SGD this is exactly the dense
update (a zero gradient changes neither the row nor its state); for AdamW it is the dense update
whenever every row is touched each step, and otherwise the lazy variant.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import _init_optim_state

from allhands.errors import ConfigError

TABLE_TYPES = (nn.Embedding, nn.EmbeddingBag)
INIT_BLOCK = 4096  # rows per seeded block of a table the servers draw


@dataclasses.dataclass(eq=False)
class Table:
    """A worker's handle on one table: its shape and the rows fetched since the last push."""

    name: str
    rows: int
    dim: int
    values: torch.Tensor | None  # the initial table to send the servers, or None (meta: they draw it)
    index: int = 0  # position among the model's tables
    fetch: Callable[["Table", torch.Tensor], torch.Tensor] | None = None
    touched: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)

    def take_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of the rows used since the last call, as (sorted unique ids, rows)."""
        if not self.touched:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        ids = torch.cat([i for i, _ in self.touched])
        grads = torch.cat([r.grad if r.grad is not None else torch.zeros_like(r) for _, r in self.touched])
        self.touched = []
        return coalesce(ids, grads)


def coalesce(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of repeated ids; ids come back sorted and unique."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    if len(uniq) == len(ids) and bool((uniq == ids).all()):
        return ids, rows
    return uniq, rows.new_zeros(len(uniq), rows.shape[1]).index_add_(0, inv, rows)


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, attr))
    return out


def detach_tables(model: nn.Module, spec: str) -> list[Table]:
    """Turn the tables ``spec`` names (see the module docstring) into row-fetching modules, in
    place, and return them in parameter order. Idempotent: tables already detached are returned."""
    found = {id(m._ps_table): m._ps_table for m in model.modules() if hasattr(m, "_ps_table")}
    if spec == "none":
        return list(found.values())
    owners = _owners(model)
    wanted = None if spec == "auto" else {s.strip() for s in spec.split(",") if s.strip()}
    names = dict(model.named_parameters())
    for name in sorted(wanted - set(names)) if wanted else []:
        raise ConfigError(f"ps.sparse: {name!r} is not a parameter of the model; use auto, none or "
                          f"names such as {next(iter(names), 'emb.weight')!r}")
    for name, p in names.items():
        if wanted is not None and name not in wanted:
            continue
        mods = owners[id(p)]
        ok = all(isinstance(m, TABLE_TYPES) and attr == "weight" and m.max_norm is None for m, attr in mods)
        if not ok:
            if wanted is not None:
                raise ConfigError(f"ps.sparse: {name!r} is not the weight of an nn.Embedding or "
                                  f"nn.EmbeddingBag used by no other module and without max_norm; "
                                  f"leave it out or use ps.sparse=auto")
            continue
        t = Table(name, p.shape[0], p.shape[1], None if p.is_meta else p.detach())
        for m, _ in mods:
            del m._parameters["weight"]
            m._ps_table = t
            m.forward = types.MethodType(_bag_forward if isinstance(m, nn.EmbeddingBag) else _forward, m)
        found[id(t)] = t
    tables = list(found.values())
    for i, t in enumerate(tables):
        t.index = i
    return tables


def _rows(m: nn.Module, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """The rows ``input`` uses (fetched), ``input`` renumbered into them, and the padding row."""
    t: Table = m._ps_table
    ids, inv = torch.unique(input, return_inverse=True)
    rows = t.fetch(t, ids)
    if torch.is_grad_enabled() and m.training:
        rows.requires_grad_(True)
        t.touched.append((ids, rows))
    pad = None
    if m.padding_idx is not None:
        hit = (ids == m.padding_idx).nonzero()
        pad = int(hit[0]) if len(hit) else None
    return rows, inv, pad


def _forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    rows, inv, pad = _rows(self, input)
    return F.embedding(inv, rows, pad, None, self.norm_type, self.scale_grad_by_freq, False)


def _bag_forward(self: nn.EmbeddingBag, input: torch.Tensor, offsets: torch.Tensor | None = None,
                 per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    rows, inv, pad = _rows(self, input)
    return F.embedding_bag(inv, rows, offsets, None, self.norm_type, self.scale_grad_by_freq,
                           self.mode, False, per_sample_weights, self.include_last_offset, pad)


def draw_rows(start: int, stop: int, dim: int, std: float, seed: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a table drawn from N(0, std): block ``b`` of INIT_BLOCK rows from
    its own seeded generator, so any server count draws the same table."""
    out = torch.empty(stop - start, dim)
    for b in range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1) if stop > start else ():
        g = torch.Generator().manual_seed((seed * 1_000_003 + b) % 2**63)
        block = torch.randn(INIT_BLOCK, dim, generator=g) * std
        lo, hi = max(start, b * INIT_BLOCK), min(stop, (b + 1) * INIT_BLOCK)
        out[lo - start:hi - start] = block[lo - b * INIT_BLOCK:hi - b * INIT_BLOCK]
    return out


class RowShard:
    """A server's rows ``[start, stop)`` of one table, with row-wise optimizer state."""

    def __init__(self, start: int, stop: int, rows: torch.Tensor,
                 make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.start, self.stop, self.rows, self.make_opt = start, stop, rows, make_opt
        self.slot = nn.Parameter(torch.zeros(0, rows.shape[1]))  # the group's param between steps
        self.opt = make_opt([self.slot])
        # the optimizer's state for every row as torch initialises it: one zero-gradient step at
        # lr 0 of a one-row probe (torch's own initialisation: zeros, or Adagrad's
        # initial_accumulator_value), broadcast to the rows; the rest (the step count) is shared
        probe = nn.Parameter(torch.zeros(1, rows.shape[1]))
        opt = make_opt([probe])
        _init_optim_state(opt)
        init = opt.state[probe]
        self.fields = {k: v.expand_as(rows).clone() for k, v in init.items()
                       if isinstance(v, torch.Tensor) and v.shape == probe.shape}
        self.shared = {k: torch.zeros_like(v) for k, v in init.items() if k not in self.fields}
        self.stepped = False  # before the first update torch creates the state (step 0) itself

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids - self.start]

    def param(self, ids: torch.Tensor, grad: torch.Tensor) -> nn.Parameter:
        """The rows ``ids`` (global) as a parameter holding ``grad``, for clipping and ``step``."""
        q = nn.Parameter(self.lookup(ids))
        q.grad = grad
        return q

    @torch.no_grad()
    def step(self, q: nn.Parameter, ids: torch.Tensor, lr: float) -> None:
        local = ids - self.start
        group = self.opt.param_groups[0]
        group["params"], group["lr"] = [q], lr
        if self.stepped:
            self.opt.state[q] = {**{k: v[local] for k, v in self.fields.items()}, **self.shared}
        self.opt.step()
        state = self.opt.state.pop(q, {})  # plain SGD keeps none
        group["params"], self.stepped = [self.slot], True
        self.rows[local] = q.detach()
        for k, v in state.items():
            if k in self.fields:
                self.fields[k][local] = v
            else:
                self.shared[k] = v

    def state(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, "start": torch.tensor(self.start),
                **{f"state.{k}": v for k, v in {**self.fields, **self.shared}.items()}}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.rows.copy_(state["rows"])
        for k, v in state.items():
            if k.startswith("state."):
                name = k[len("state."):]
                (self.fields if name in self.fields else self.shared)[name].copy_(v)
        self.stepped = True

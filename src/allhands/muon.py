"""Muon on the hidden matrices, AdamW on everything else, with the orthogonalization spread over
the ranks that hold the matrices.

The update rule is ``torch.optim.Muon``'s: a momentum buffer (Nesterov by default), five quintic
Newton-Schulz iterations, decoupled weight decay ``lr * weight_decay``, and the Moonlight learning
rate adjustment (``lr * 0.2 * sqrt(max(A, B))``, torch's ``adjust_lr_fn="match_rms_adamw"``), which
gives the update AdamW's RMS, so one ``optim.lr`` and ``optim.weight_decay`` serve both halves.
Only the Newton-Schulz arithmetic dtype is ours to pick: torch always runs it in bfloat16; here
``ns_dtype`` is bfloat16 on CUDA and float32 on CPU by default (bfloat16 matmuls are slow on CPU,
and float32 lets a sharded run match one process to rounding).

Newton-Schulz needs a whole matrix, while under FSDP2 (ZeRO-2/3, HSDP) or tp a rank holds a piece
of each. Each matrix gets one owner among the ``world`` ranks (greedily by its Newton-Schulz cost,
so every rank orthogonalizes about the same share, as Moonlight's distributed Muon and Dion do):
one ``all_to_all`` brings the owner the pieces it lacks, it orthogonalizes its matrices, a second
``all_to_all`` sends every rank its piece of each result. Replicated matrices (DDP) need only the
second. ``spread=False`` is the plain alternative, kept to measure the difference: every rank
gathers every matrix and orthogonalizes all of them.

``world`` is the group of every rank that trains this copy of the model (the mesh's non-pipeline
dims, without ``dp_replicate`` under DiLoCo-style sync); None means a DTensor's own 1-D mesh, or
this rank alone (ZeRO-1's local optimizer, whose matrices are whole and its own).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from allhands import collective

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization (``_zeropower_via_newtonschulz``) in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def moonlight_lr(lr: float, shape: torch.Size) -> float:
    """Moonlight's scaling: the update's RMS matches AdamW's (torch's "match_rms_adamw")."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The hidden matrices Muon takes: every ``nn.Linear`` weight but the output head
    (``lm_head``) and any weight shared with an embedding (tied heads)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out, seen = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head":
            p = mod.weight
            if p.requires_grad and p.dim() == 2 and id(p) not in embedded and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _piece(p: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's piece of ``p``: (global offset, local shape)."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return (0, 0), tuple(p.shape)


def _cut(full: torch.Tensor, key) -> torch.Tensor:
    (r, c), (h, w) = key
    return full[r:r + h, c:c + w]


class Muon(torch.optim.Optimizer):
    """One optimizer over two kinds of param groups: ``muon=True`` groups (2-D matrices) step by
    Muon, the others by torch's AdamW (the same dicts and state, so its keys are AdamW's)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "auto",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, spread: bool = True,
                 muon: bool = False, world: dist.ProcessGroup | None = None):
        # ``muon``: the default of a group without the key (a constructor argument, so that
        # ZeRO-1, which rebuilds the optimizer from its arguments, keeps every group's own)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, spread=spread, muon=muon,
                        betas=betas, eps=eps, amsgrad=False, maximize=False, foreach=None,
                        capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=True)
        super().__init__(params, defaults)
        for g in self.param_groups:
            if g["muon"] and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon groups take 2-D matrices only")
        self.world = world  # not a default: it is no hyper-parameter and no checkpoint holds it
        self._adamw = torch.optim.AdamW([torch.zeros(1)], lr=lr)  # steps the other groups
        self._plans: dict = {}
        # this rank's share, cumulative: matrices orthogonalized, their Newton-Schulz FLOPs and
        # the bytes it sent for the gathers and the scatters
        self.stats = {"matrices": 0, "ns_flops": 0, "bytes_sent": 0, "steps": 0}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        others = [g for g in self.param_groups if not g["muon"]]
        if others:  # torch's AdamW on the same group dicts and the same state
            self._adamw.param_groups, self._adamw.state = others, self.state
            self._adamw.step()
        items = []  # (param, its local update, group)
        for g in self.param_groups:
            if not g["muon"]:
                continue
            for p in g["params"]:
                if p.grad is None and self.world is None and not isinstance(p, DTensor):
                    continue  # alone, a matrix without a gradient is skipped like torch's Muon
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                buf = _local(st["momentum_buffer"])
                grad = _local(p.grad) if p.grad is not None else torch.zeros_like(buf)
                buf.lerp_(grad, 1 - g["momentum"])
                items.append((p, grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf.clone(), g))
        if items:
            self.stats["steps"] += 1
            for (p, _, g), o in zip(items, self._orthogonalize(items)):
                lp = _local(p)
                lp.mul_(1 - g["lr"] * g["weight_decay"])
                lp.add_(o.to(lp.dtype), alpha=-moonlight_lr(g["lr"], p.shape))
        return loss

    # -- the orthogonalization, spread over the world
    def _dtype(self, g: dict, device: torch.device) -> torch.dtype:
        name = g["ns_dtype"]
        if name == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, name)

    def _orthogonalize(self, items) -> list[torch.Tensor]:
        by_world: dict = {}
        for i, (p, _, _) in enumerate(items):
            w = self.world
            if w is None and isinstance(p, DTensor):
                if p.device_mesh.ndim != 1:
                    raise ValueError("Muon: a matrix on a multi-dimensional mesh needs the world "
                                     "group of its ranks (allhands.optim.build_optimizer passes it)")
                w = p.device_mesh.get_group()
            by_world.setdefault(w, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(items)
        for w, idx in by_world.items():
            sub = [items[i] for i in idx]
            if w is None or dist.get_world_size(w) == 1:
                res = [self._ns(u, g) for _, u, g in sub]
            else:
                res = self._exchange(w, sub)
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def _ns(self, full: torch.Tensor, g: dict) -> torch.Tensor:
        m, n = full.shape
        self.stats["matrices"] += 1
        self.stats["ns_flops"] += g["ns_steps"] * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3)
        return newton_schulz(full, g["ns_steps"], self._dtype(g, full.device)).to(full.dtype)

    def _plan(self, w: dist.ProcessGroup, params: list[torch.Tensor], spread: bool) -> dict:
        key = (id(w), tuple(id(p) for p in params), spread)
        if key in self._plans:
            return self._plans[key]
        n, me = dist.get_world_size(w), dist.get_rank(w)
        mine = [_piece(p) for p in params]
        # every rank's pieces as integers (no pickled peer data): (row, col, rows, cols) a matrix
        flat = torch.tensor([[*o, *s] for o, s in mine], dtype=torch.int64,
                            device=_local(params[0]).device).reshape(len(params), 4)
        got = [torch.empty_like(flat) for _ in range(n)]
        collective.all_gather(got, flat, call="muon plan", group=w)
        metas = [[((int(a), int(b)), (int(c), int(d))) for a, b, c, d in t.tolist()] for t in got]
        for k, p in enumerate(params):  # the distinct pieces must tile the matrix
            keys = {metas[r][k] for r in range(n)}
            if sum(h * wd for _, (h, wd) in keys) != p.numel() or tuple(_local(p).shape) != mine[k][1]:
                raise ValueError(f"Muon cannot gather a matrix laid out as {getattr(p, 'placements', None)}"
                                 f" (shape {tuple(p.shape)}); use AdamW (optim.name=adamw) for this layout")
        cost = [0] * n
        owner = []
        for k in sorted(range(len(params)), key=lambda k: (-params[k].numel(), k)):
            m, c = params[k].shape
            o = min(range(n), key=lambda r: (cost[r], r))
            cost[o] += min(m, c) ** 2 * max(m, c)
            owner.append((k, o))
        owner = dict(owner)
        owners = {k: (list(range(n)) if not spread else [owner[k]]) for k in range(len(params))}
        send = [[] for _ in range(n)]  # gather: (k) whose piece this rank sends to each rank
        recv = [[] for _ in range(n)]  # gather: (k, piece key) this rank receives from each
        for k in range(len(params)):
            holders: dict = {}
            for r in range(n):
                holders.setdefault(metas[r][k], []).append(r)
            for o in owners[k]:
                for piece, rs in holders.items():
                    if o in rs:
                        continue
                    src = rs[o % len(rs)]
                    if src == me:
                        send[o].append(k)
                    if o == me:
                        recv[src].append((k, piece))
        plan = dict(n=n, me=me, metas=metas, owners=owners, send=send, recv=recv)
        self._plans[key] = plan
        return plan

    def _exchange(self, w: dist.ProcessGroup, sub) -> list[torch.Tensor]:
        params = [p for p, _, _ in sub]
        spread = all(g["spread"] for _, _, g in sub)
        plan = self._plan(w, params, spread)
        n, me, metas = plan["n"], plan["me"], plan["metas"]
        ups = [u.float() for _, u, _ in sub]
        dev = ups[0].device
        # gather: every owner gets the pieces of its matrices that it lacks
        recvd = _all_to_all(w, [[ups[k].reshape(-1) for k in plan["send"][d]] for d in range(n)],
                            [[math.prod(piece[1]) for _, piece in plan["recv"][s]] for s in range(n)],
                            dev, self.stats)
        full = {}
        for k, (p, _, _) in enumerate(sub):
            if me in plan["owners"][k]:
                f = torch.empty(tuple(p.shape), dtype=torch.float32, device=dev)
                _cut(f, metas[me][k]).copy_(ups[k])
                full[k] = f
        for s in range(n):
            for (k, piece), t in zip(plan["recv"][s], recvd[s]):
                _cut(full[k], piece).copy_(t.view(piece[1]))
        done = {k: self._ns(f, sub[k][2]) for k, f in full.items()}
        out: list[torch.Tensor | None] = [None] * len(sub)
        for k, f in done.items():
            out[k] = _cut(f, metas[me][k])
        if spread:  # scatter: every rank gets its piece of every matrix another rank owned
            mine = sorted(done)
            theirs = [[k for k in range(len(sub)) if plan["owners"][k][0] == s] if s != me else []
                      for s in range(n)]
            back = _all_to_all(
                w, [[_cut(done[k], metas[d][k]).reshape(-1) for k in mine] if d != me else []
                    for d in range(n)],
                [[math.prod(metas[me][k][1]) for k in theirs[s]] for s in range(n)], dev, self.stats)
            for s in range(n):
                for k, t in zip(theirs[s], back[s]):
                    out[k] = t.view(metas[me][k][1])
        return out


def _all_to_all(w, sends: list[list[torch.Tensor]], recv_sizes: list[list[int]], dev, stats) -> list:
    """One ``all_to_all_single`` of flat float32 pieces: ``sends[d]`` go to rank d; returns, per
    source rank, the received pieces of ``recv_sizes[s]`` elements each."""
    in_splits = [sum(t.numel() for t in ts) for ts in sends]
    out_splits = [sum(s) for s in recv_sizes]
    flat = [t for ts in sends for t in ts]
    inp = torch.cat(flat) if flat else torch.empty(0, device=dev)
    out = torch.empty(sum(out_splits), device=dev)
    collective.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, call="muon exchange", group=w)
    stats["bytes_sent"] += 4 * sum(x for r, x in enumerate(in_splits) if r != dist.get_rank(w))
    res, at = [], 0
    for sizes in recv_sizes:
        pieces = []
        for s in sizes:
            pieces.append(out[at:at + s])
            at += s
        res.append(pieces)
    return res

"""DiLoCo and local SGD: replicas train alone for H steps, then reconcile once.

DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1): every replica group runs H inner
steps with its own optimizer (the trainer's AdamW) on its own data; then the groups average
their pseudo-gradient  Delta = theta_anchor - theta_local  (one all-reduce over the
``dp_replicate`` mesh dimension) and an outer optimizer applies it to the anchor (Nesterov SGD,
lr 0.7, momentum 0.9 in the paper). Local SGD / model averaging (Stich 2019; Lin et al. 2020)
is the special case "anchor minus the averaged Delta", i.e. the mean of the replicas.

Inner steps are local: the model is not wrapped in DDP across ``dp_replicate``; so the bytes
per step are 1/H of synchronous data parallelism. With plain SGD inside, H=1 and an outer SGD
with lr 1 and no momentum, one round is exactly a synchronous SGD step (tests/test_lowcomm.py).

Inside a replica the ``dp_shard`` ranks are DDP (parallel.zero 0) or FSDP2 ``fully_shard`` over
``dp_shard`` alone (zero 2/3: the replicate dim is DiLoCo's, not HSDP's). Under FSDP every rank
works on its local shards (``DTensor.to_local()``): rank (r, s) holds the same slice of every
parameter as rank (r', s), so the anchor, the outer momentum and the pseudo-gradient are sharded
like the parameters and the outer all-reduce over ``dp_replicate`` moves 1/S of the model per
rank (1/H of what HSDP's per-step all-reduce across replicas would). The checkpoint holds the
anchor and momentum as DTensors of the parameters' layout, so DCP reshards them when dp_shard
changes on resume.

The outer payload can be compressed: fp16/bf16 (cast after dividing by N, all-reduce), or int8
with one fp32 scale per chunk of 2048 values (all-gather of the int8 codes, decoded and averaged
locally, because an int8 sum would overflow). The anchor and the outer momentum are
checkpointed under ``sync``. Only parameters are reconciled; buffers stay per replica.

Warm-up (``sync.sync_warmup_steps`` = W): the first W steps are synchronous data parallelism
(each step's gradients averaged before the optimizer step), then the rounds start from the
common model, as in post-local SGD (Lin et al. 2020, arXiv:1808.07217) and as DiLoCo itself
starts from a synchronously pre-trained model: the first rounds from a random init move the
replicas far apart, and the outer momentum amplifies that (an eval-loss spike in bench/lowcomm.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands import collective
from allhands.mesh import Mesh
from allhands.sync.base import SyncStrategy

OUTER_COMPRESSORS = ("none", "fp16", "bf16", "int8")
INT8_CHUNK = 2048


def replicate_group(mesh: Mesh) -> dist.ProcessGroup:
    """The one mesh lookup of this module: the outer sync spans the dp_replicate dimension;
    inside a replica (dp_shard > 1) parallelize() applies DDP (the replica's ranks move alike)
    or FSDP over dp_shard (each rank moves its shard)."""
    return mesh.group("dp_replicate")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: an FSDP shard's local tensor (a view of FSDP's sharded
    storage, so writing into it updates the parameter), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a DTensor laid out like ``param``, sharing its storage,
    for the checkpoint: DCP then writes each shard once and reshards on load. Plain otherwise."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _fqn(name: str, model: nn.Module) -> str:
    """A parameter's name in the plain model (the checkpoint's key, whatever the layout): without
    DDP's ``module.`` and activation checkpointing's wrapper segment (FSDP2 renames nothing)."""
    if isinstance(model, DDP) and name.startswith("module."):
        name = name[len("module."):]
    return name.replace("_checkpoint_wrapped_module.", "")


class DiLoCoSync(SyncStrategy):
    name = "diloco"
    reconciles_replicas = True  # parallelize() leaves dp_replicate to the outer sync

    def __init__(self, *, inner_steps: int, total_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True, compress: str = "none",
                 average: bool = False, warmup_steps: int = 0):
        super().__init__()
        if compress not in OUTER_COMPRESSORS:
            raise ValueError(f"unknown outer compressor {compress!r}")
        self.h, self.total = inner_steps, total_steps
        self.warmup = warmup_steps
        self.step = 0  # completed steps, as last told by after_step (checkpointed)
        self.outer_lr, self.momentum, self.nesterov = outer_lr, outer_momentum, outer_nesterov
        self.compress = compress
        self.average = average
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        self.inner: torch.optim.Optimizer | None = None
        self._load_inner = True  # see saved_keys
        # Replica mode (replica/heal.py): the outer average over the quorum of replica groups
        # instead of the dp_replicate group; it returns None when a member failed in the round,
        # which every member then discards (``discarded``) instead of applying.
        self.outer_reduce: Any = None
        self.discarded = False

    def describe(self) -> str:
        how = ("model averaging" if self.average else
               f"outer SGD lr {self.outer_lr} momentum {self.momentum}"
               f"{' nesterov' if self.nesterov and self.momentum else ''}")
        warm = f"; synchronous for the first {self.warmup} steps" if self.warmup else ""
        return f"{self.name}: sync every {self.h} steps ({how}; payload {self.compress}{warm})"

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        self.group = replicate_group(mesh)
        self.n = self.group.size()
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.names = [_fqn(k, model) for k, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            # Replicas must start equal (DDP would broadcast); one broadcast at start only, of
            # this rank's shards: its replicate group holds the same slices.
            shards = [_local(p) for p in self.params]
            flat = torch.cat([t.detach().reshape(-1).float() for t in shards])
            collective.broadcast(flat, call="diloco start", group=self.group, group_src=0)
            for t, v in zip(shards, flat.split([t.numel() for t in shards])):
                t.copy_(v.view_as(t))
            # fp32 anchors whatever the parameter dtype: the outer update is a small difference.
            # Plain tensors of this rank's shard: the outer optimizer is local arithmetic.
            self.anchor = [t.detach().float().clone() for t in shards]
        if not self.average:
            self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.momentum,
                                         nesterov=self.nesterov and self.momentum > 0)
            if self.momentum > 0:
                # Zero buffers now, so a resume finds tensors of the right shape to load into
                # (SGD would otherwise create them at the first step; μ·0 + g is the same).
                for a in self.anchor:
                    self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        return model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner = optimizer

    def in_sync(self, step: int) -> bool:
        return step <= self.warmup or step % self.h == 0 or step >= self.total

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        if last and self.step < self.warmup:
            return self._average_gradients_after()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _average_gradients_after(self):
        yield  # the backward of the step's last micro-batch has run
        # FSDP has reduce-scattered within the replica by now: p.grad is this rank's shard.
        for p in self.params:
            if p.grad is None:  # unused here, maybe not on another replica: it takes part as 0
                p.grad = _like(torch.zeros_like(_local(p)), p)
        grads = [_local(p.grad) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]) / self.n  # (sum local numel,) fp32
        t0 = time.perf_counter()
        self.comm.collective("all_reduce", flat.numel() * 4, self.n)
        collective.all_reduce(flat, call="diloco warm-up", group=self.group)
        self.comm.blocking(time.perf_counter() - t0)
        for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(avg.view_as(g))

    def after_step(self, step: int) -> None:
        self.step = step
        if step < self.warmup:
            return
        if step == self.warmup:
            with torch.no_grad():  # replicas are identical here: the rounds start from them
                for a, p in zip(self.anchor, self.params):
                    a.copy_(_local(p))
        elif self.in_sync(step):
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        sizes = [a.numel() for a in self.anchor]
        # Pseudo-gradient of this rank's shards, flattened: (sum of local numels,) fp32.
        delta = torch.cat([(a - _local(p).float()).reshape(-1) for a, p in zip(self.anchor, self.params)])
        t0 = time.perf_counter()
        avg = self._average(delta) if self.outer_reduce is None else self.outer_reduce(delta)
        self.comm.blocking(time.perf_counter() - t0)
        if avg is None:  # replica mode: the round is discarded by every member of the quorum
            self.discarded = True
            return
        for a, g in zip(self.anchor, avg.split(sizes)):
            if self.outer is None:
                a.sub_(g.view_as(a))
            else:
                a.grad = g.view_as(a)
        if self.outer is not None:
            self.outer.step()
            for a in self.anchor:
                a.grad = None
        for p, a in zip(self.params, self.anchor):
            _local(p).copy_(a)

    def replica_state(self) -> list[torch.Tensor]:
        """The outer state a replica group's heal sends: the anchor (the global model) and the
        outer momentum, this rank's shards."""
        momentum = [self.outer.state[a]["momentum_buffer"] for a in self.anchor] if (
            self.outer is not None and self.momentum > 0) else []
        return self.anchor + momentum

    def _average(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of ``x`` (flat fp32) over the replicate group, through the chosen payload."""
        n = self.n
        if self.compress == "int8":
            return self._average_int8(x)
        dtype = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.compress]
        buf = (x / n).to(dtype)  # divide first: a half-precision sum of N terms cannot overflow
        self.comm.collective("all_reduce", buf.numel() * buf.element_size(), n)
        collective.all_reduce(buf, call="diloco outer", group=self.group)
        return buf.float()

    def _average_int8(self, x: torch.Tensor) -> torch.Tensor:
        n, numel = self.n, x.numel()
        pad = (-numel) % INT8_CHUNK
        chunks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT8_CHUNK)  # (C, 2048)
        scale = (chunks.abs().amax(dim=1) / 127.0).clamp_min(1e-30)          # (C,)
        codes = torch.round(chunks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.comm.collective("all_gather", codes.numel() + scale.numel() * 4, n)
        all_codes = [torch.empty_like(codes) for _ in range(n)]
        all_scales = [torch.empty_like(scale) for _ in range(n)]
        collective.all_gather(all_codes, codes, call="diloco outer (int8)", group=self.group)
        collective.all_gather(all_scales, scale, call="diloco outer (int8)", group=self.group)
        total = torch.zeros_like(chunks)
        for c, s in zip(all_codes, all_scales):  # same order on every rank: identical results
            total += c.float() * s[:, None]
        return (total / n).reshape(-1)[:numel]

    # -- checkpoint: anchors and outer momentum by parameter name (identical on every replica;
    # DTensors laid out like the parameters under FSDP), and each replica's inner optimizer state
    # under its own key: the ``model`` key's optimizer state is saved once for all replicas (DCP
    # deduplicates it), but inner AdamW moments differ per replica, and an exact resume needs
    # each one back.
    def _inner_state(self) -> dict[str, torch.Tensor]:
        if self.inner is None:
            return {}
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.inner)  # AdamW creates its moments lazily; a resume needs shapes
        out = {}
        for k, p in zip(self.names, self.params):
            for field, v in self.inner.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    # A copy: the ``model`` key hands DCP these very tensors too, and on load
                    # its (one replica's) values would land in them after ours.
                    out[f"{k}.{field}"] = v.detach().clone()
        return out

    def saved_keys(self, keys: set[str]) -> None:
        # A replica that did not exist when the checkpoint was saved (resumed with more
        # dp_replicate) starts from the inner state the ``model`` key restored, one replica's.
        self._load_inner = any(k.startswith(f"sync.inner.{self._replica_key()}.") for k in keys)

    def _replica_key(self) -> str:
        return f"replica{dist.get_rank(self.group)}"

    def state_dict(self) -> dict[str, Any]:
        named = list(zip(self.names, self.anchor, self.params))
        state: dict[str, Any] = {"anchor": {k: _like(a, p) for k, a, p in named},
                                 "step": torch.tensor(self.step)}
        if self.outer is not None and self.momentum > 0:
            state["momentum"] = {k: _like(self.outer.state[a]["momentum_buffer"], p) for k, a, p in named}
        inner = self._inner_state() if self._load_inner else {}
        if inner:
            state["inner"] = {self._replica_key(): inner}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_inner = True
        for k, a in zip(self.names, self.anchor):
            a.copy_(_local(state["anchor"][k]))
        self.step = int(state["step"])
        if "momentum" in state and self.outer is not None:
            for k, a in zip(self.names, self.anchor):
                self.outer.state[a]["momentum_buffer"].copy_(_local(state["momentum"][k]))
        mine = state.get("inner", {}).get(self._replica_key(), {})
        for k, p in zip(self.names, self.params):
            for field, v in self.inner.state.get(p, {}).items() if self.inner else ():
                if f"{k}.{field}" in mine and isinstance(v, torch.Tensor):
                    v.copy_(mine[f"{k}.{field}"])


class LocalSGDSync(DiLoCoSync):
    """Model averaging every H steps: DiLoCo's round with the mean of the replicas as result."""

    name = "local_sgd"

    def __init__(self, *, inner_steps: int, total_steps: int, compress: str = "none",
                 warmup_steps: int = 0):
        super().__init__(inner_steps=inner_steps, total_steps=total_steps, compress=compress,
                         average=True, warmup_steps=warmup_steps)

"""The layout applied in one place: this rank's model parts, parallelized and with their
optimizer, behind the few calls the training loop makes, so the loop never asks which layout runs.

:func:`build_layout` does, in torchtitan's order (``parallelize_llama``, then its
``build_optimizers``): pipeline split (the stages are what every later strategy cuts) ->
per part :func:`parallelize` (TP -> activation checkpointing -> FSDP2 or DDP) and the sync
strategy's ``wrap`` -> the pipeline schedule over the wrapped stages -> the optimizer over the
parts' parameters -> ZeRO-1 (an optimizer wrapper). The loop still calls the strategy itself
(``micro_step``, ``attach_optimizer``, ``after_step``) at its fixed points.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from allhands.config import Config, pp_microbatches, pp_stages_per_rank
from allhands.memory import log_memory, state_bytes
from allhands.mesh import Mesh
from allhands.models.moe import set_aux_scale, update_expert_bias
from allhands.optim import build_optimizer
from allhands.parallel.expert import reduce_expert_grads
from allhands.parallel.context import ContextParallel
from allhands.parallel.fsdp import no_gradient_sync
from allhands.parallel.parallelize import clip_grad_norm, parallelize
from allhands.parallel.pipeline import Pipeline, build_pipeline, clip_grads, global_grad_norm
from allhands.parallel.tensor import local_loss, loss_context
from allhands.parallel.zero1 import apply_zero1, optimizer_for_checkpoint
from allhands.sync.base import SyncStrategy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Precision:
    """Where bf16 comes from. Under FSDP (zero 2/3) it is FSDP2's MixedPrecisionPolicy: bf16
    compute over fp32 shards, gradients reduced in ``reduce_dtype``. Replicated layouts (zero
    0/1, whose DDP has no such policy) run forward/backward under autocast over fp32 parameters."""

    param_dtype: torch.dtype | None = None   # FSDP's compute dtype; None: the parameters' own
    reduce_dtype: torch.dtype | None = None  # FSDP's gradient-reduction dtype
    autocast: bool = False


def choose_precision(precision: str, device_type: str, zero: int, reduce_dtype: str) -> Precision:
    """``run.precision`` (``auto``: bf16 on CUDA, fp32 elsewhere) under ZeRO stage ``zero``."""
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
    if not bf16:
        return Precision()
    if zero >= 2:
        return Precision(torch.bfloat16, torch.float32 if reduce_dtype == "fp32" else torch.bfloat16)
    return Precision(autocast=True)


def replica_dim(zero: int) -> str:
    """The mesh dim whose ranks hold equal parameters: sharded layouts (zero 2/3) hold equal
    shards only across ``dp_replicate``; replicated ones are equal across all of ``dp``."""
    return "dp_replicate" if zero >= 2 else "dp"


@dataclass
class Layout:
    """This rank's model parts and optimizer under the configured layout.

    ``parts``: the modules whose parameters are trained (one, or this rank's pipeline stages),
    parallelized in place; ``model``: what the strategy and checkpoints address (the wrapped
    module, or the list of wrapped stages); ``optimizer``: over ``parts`` (ZeRO-1 applied).
    """

    parts: list[nn.Module]
    model: nn.Module | list[nn.Module]
    optimizer: torch.optim.Optimizer
    mesh: Mesh
    loss_fn: LossFn
    zero: int
    precision: Precision
    pipeline: Pipeline | None = None
    cp: ContextParallel | None = None  # parallel.cp > 1: this rank's part of every sequence
    vocab_parallel: bool = False  # the loss runs on vocabulary-sharded logits (parallel/tensor.py)

    @property
    def replica_dim(self) -> str:
        return replica_dim(self.zero)

    @property
    def reports_loss(self) -> bool:
        """This rank holds the loss (last pipeline stage) and is the one of its tp group to report it."""
        return ((self.pipeline is None or self.pipeline.has_last) and self.mesh.local_rank("tp") == 0
                and self.mesh.local_rank("cp") == 0)

    def loss_splits(self) -> int:
        """Into how many loss calls this layout cuts each micro-batch: the pipeline's
        microbatches, times the cp ranks that each hold a part of every sample."""
        return (self.pipeline.n_microbatches if self.pipeline is not None else 1) * self.mesh.size("cp")

    def autocast(self) -> ContextManager:
        """The context forward/backward and evaluation run in (bf16 autocast or nothing)."""
        if self.precision.autocast:
            return torch.autocast(self.mesh.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                         on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         last: bool = True) -> torch.Tensor | None:
        """Forward and backward of one micro-batch, its loss scaled by ``scale``; returns that
        loss, or None on a rank without the last stage. ``on_loss`` sees the loss before
        backward (fault injection); a pipeline's schedule computes its loss inside and skips it.
        ``last``: the step's last micro-batch, whose backward reduces the gradients of all of
        them (:meth:`_accumulating`)."""
        # MoE auxiliary losses get the weight of the loss they join (models/moe.py: AuxLoss)
        per_chunk = scale / self.pipeline.n_microbatches if self.pipeline is not None else scale
        for part in self.parts:
            set_aux_scale(part, per_chunk)
        if self.pipeline is not None:
            # the schedule runs this rank's stages over parallel.pp_microbatches chunks
            return self.pipeline.step(x, y, loss_scale=scale)
        # torch's loss_parallel rule: the backward of a vocabulary-parallel loss inside it too
        with self._accumulating(last), loss_context(self.vocab_parallel):
            loss = self._loss(self.model, x, y) * scale
            if on_loss is not None:
                loss = on_loss(loss)
            loss.backward()
        return loss.detach() if self.cp is None else self.cp.mean(loss)

    def _accumulating(self, last: bool) -> ContextManager:
        """Around a micro-batch before the step's last: its gradients accumulate where they are,
        with no collective, and the last backward reduces the sum once: DDP's ``no_sync``, and
        FSDP2's ``set_requires_gradient_sync(False)`` (torch's docs: accumulation without
        communication, at the memory of unsharded gradients until then; torchtitan's chunked
        loss does the same over its head's chunks). A pipeline's schedule reduces at the end of
        each of its runs itself (torch.distributed.pipelining's ``perform_reduce_grad``), so it
        is left alone."""
        if last or self.pipeline is not None:
            return contextlib.nullcontext()
        if isinstance(self.model, DDP):
            return self.model.no_sync()
        return no_gradient_sync(self.parts)

    def after_backward(self) -> None:
        """After the step's last backward: tied copies on different stages sum their gradients."""
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads()
        if self.mesh.size("ep") > 1 and self.zero < 2:
            reduce_expert_grads(self.parts, self.mesh)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) the norm of the whole model's gradient; returns it."""
        params = [q for part in self.parts for q in part.parameters()]
        if self.pipeline is None and self.mesh.size("tp") == 1 and self.mesh.size("ep") == 1:
            return clip_grad_norm(params, max_norm if max_norm > 0 else math.inf)
        # the norm of the whole model: over tp/FSDP shards (mixed meshes) and pipeline stages
        pp_group = self.mesh.group("pp") if self.pipeline is not None else None
        skip = self.pipeline.norm_duplicates() if self.pipeline is not None else set()
        norm = global_grad_norm(params, pp_group=pp_group, skip=skip)
        clip_grads(params, max_norm, norm)
        return norm

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The unscaled loss of one batch without gradients (None on a rank without the last stage)."""
        if self.pipeline is not None:
            return self.pipeline.eval(x, y)
        with loss_context(self.vocab_parallel):
            loss = self._loss(self.parts[0], x, y)
        return loss if self.cp is None else self.cp.mean(loss)

    def _loss(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``module``'s loss on a batch, a plain tensor; under cp on this rank's part of each
        sequence, with attention over all of it (parallel/context.py)."""
        if self.cp is None:
            return local_loss(self.loss_fn(module(x), y))
        x, y, kw = self.cp.shard(x, y)
        with self.cp.attention():
            return local_loss(self.loss_fn(module(x, **kw), y))

    def train(self) -> None:
        """Back to training after :meth:`eval`. A forward without backward leaves the FSDP units
        that keep their parameters gathered after forward (the head, the root; every unit under
        ZeRO-2) gathered, and the next forward would use those copies even if the shards were
        loaded in between (a replica group's heal, a resume): they are resharded here."""
        for part in self.parts:
            part.train()
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def eval(self) -> None:
        for part in self.parts:
            part.eval()

    def checkpoint_parts(self) -> tuple[Any, torch.optim.Optimizer, dict[str, str] | None]:
        """``(model, optimizer, aliases)`` for ``checkpoint.ModelOptimState``: under ZeRO-1 the
        rank's local optimizer (see parallel/zero1.py), under a pipeline the optimizer-state
        names of tied copies. Call it at each save or load (ZeRO-1 copies the current LR then)."""
        aliases = self.pipeline.optimizer_aliases() if self.pipeline is not None else None
        return self.model, optimizer_for_checkpoint(self.optimizer), aliases

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (memory.py)."""
        module = self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)
        return state_bytes(module, self.optimizer)

    def log_memory(self, metrics: Any, held: dict[str, int] | None, step: int) -> bool:
        """memory.log_memory against this layout's ZeRO formula; True once logged."""
        return log_memory(metrics, held, self.parts[0], self.mesh, zero=self.zero, step=step)


def build_layout(cfg: Config, mesh: Mesh, model: nn.Module, strategy: SyncStrategy,
                 loss_fn: LossFn, tp_plan: Any = None,
                 load: Callable[[nn.Module], Any] | None = None) -> Layout:
    """Cut ``model`` for this rank and build its optimizer. ``model`` is whole: on the meta
    device, or on ``mesh.device`` initialised alike on every rank; under pp it becomes this
    rank's last stage. ``load(part)``: allocates and fills each cut part (this rank's stage, its
    DTensor shards), inside parallelize (after FSDP, before DDP) and before the strategy wraps
    it, so a strategy's snapshot (DiLoCo's anchor) holds the loaded weights."""
    p = cfg.parallel
    prec = choose_precision(cfg.run.precision, mesh.device.type, p.zero, p.reduce_dtype)
    # The default losses take logits sharded on the vocabulary (job.py); a user's loss, and a
    # pipeline's (its schedule runs backward outside loss_parallel), get them gathered.
    vocab_parallel = (mesh.size("tp") > 1 and mesh.size("pp") == 1
                      and bool(getattr(loss_fn, "vocab_parallel", False)))
    pipeline = None
    parts = [model]
    if mesh.size("pp") > 1:
        pipeline = build_pipeline(
            model, pp_rank=mesh.local_rank("pp"), pp_size=mesh.size("pp"),
            group=mesh.group("pp"), schedule=p.pp_schedule,
            n_microbatches=pp_microbatches(p, mesh.size("pp")),
            stages_per_rank=pp_stages_per_rank(p),
            split_points=[s.strip() for s in p.pp_split.split(",")] if p.pp_split else None,
            tied_group=mesh.pp_ends_group() if mesh.size("pp") > 2 else None)
        parts = pipeline.modules
    def cut(part: nn.Module) -> nn.Module:
        out = parallelize(part, mesh, zero=p.zero, ac=p.ac, bucket_mb=p.bucket_mb,
                          param_dtype=prec.param_dtype, reduce_dtype=prec.reduce_dtype,
                          replicate=not strategy.reconciles_replicas,
                          sequence_parallel=p.tp_sequence_parallel, tp_plan=tp_plan,
                          loss_parallel=vocab_parallel, pipeline_stage=pipeline is not None,
                          compile=cfg.run.compile,
                          compile_backend=cfg.run.compile_backend, materialize=load)
        return strategy.wrap(out, mesh)

    wrapped = [cut(part) for part in parts]
    if pipeline is not None:
        pipeline.modules = wrapped
        pipeline.start(mesh.device, loss_fn)
    cp = None
    if mesh.size("cp") > 1:  # the model masks documents by this token (data.packing=mask)
        cp = ContextParallel(mesh, doc_token=getattr(getattr(model, "cfg", None), "doc_token", -1))
    world = mesh.model_group(not strategy.reconciles_replicas) if cfg.optim.name == "muon" else None
    optimizer = build_optimizer(parts, cfg, world)
    if cfg.moe.n_experts and cfg.moe.balance == "bias":
        # DeepSeek-V3's bias step after each update, on loads summed over the data ranks
        optimizer.register_step_post_hook(
            lambda *_: [update_expert_bias(part, mesh.dp_group if mesh.dp_size > 1 else None)
                        for part in parts])
    if p.zero == 1:
        optimizer = apply_zero1(optimizer, mesh)
    if mesh.device.type == "cuda":  # the logged peak is the training's, not the start-up's
        torch.cuda.reset_peak_memory_stats(mesh.device)
    return Layout(parts, wrapped[0] if len(wrapped) == 1 else wrapped, optimizer, mesh, loss_fn,
                  p.zero, prec, pipeline, cp, vocab_parallel)

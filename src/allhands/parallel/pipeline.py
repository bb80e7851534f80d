"""Pipeline parallelism on ``torch.distributed.pipelining``: split, stages, schedule.

Split (torchtitan's manual split). A model is a sequence of *units*: its top-level children in
registration order, with ``nn.ModuleList`` / ``nn.ModuleDict`` children expanded into their
entries (GPT: ``tok_emb, pos_emb, drop, blocks.0 .. blocks.L-1, ln_f, lm_head``). Split points
are the FQNs of the units that begin stages 1, 2, ...; the shipped families (GPT, Llama) compute balanced
ones (:func:`balanced_split`), a user model names them (``parallel.pp_split``). A stage
is the whole model (a copy of it for all but a rank's last stage) with every unit of the other
stages deleted: an attribute becomes ``None`` and a container entry (also a top-level
``nn.Sequential``'s) is removed *by key*, so the remaining parameters keep
their FQNs and a stage's state dict is a subset of the full model's; one DCP checkpoint loads
under any pp degree. The model's ``forward`` must therefore skip absent parts (see
``GPT.forward``) and a stage's input is the previous stage's output.

Stages map to ranks looped: stage ``s`` runs on pp rank ``s % pp``, so with ``v`` stages per
rank (Interleaved 1F1B, Narayanan et al. 2021) rank ``r`` holds ``r, r + pp, ..., r + (v-1)pp``.
The V schedules (ZB-V, Qi et al. 2024 section 6; DualPipeV, DeepSeek-V3 2024) hold two stages per
rank folded into a V: rank ``r`` holds ``r`` and ``2 pp - 1 - r``, so rank 0 runs the first and
the last stage (torch's ``generate_stage_to_rank_mapping(style="v")``). Whatever the placement,
a stage keeps the unsplit model's FQNs, so checkpoints move between schedules unchanged.

Zero-bubble schedules (Interleaved ZB, ZB-V, DualPipeV) split each backward into the input
gradient (sent upstream at once) and the weight gradient (run later, in the bubble). torch's
stage does the split itself (``backward_one_chunk(full_backward=False)`` then
``backward_weight_one_chunk``) and runs FSDP's / replicate's gradient reduction once after the
last weight gradient (``perform_reduce_grad``), so they compose with FSDP stages (measured:
ZB-V at pp=2 x dp_shard=2 under ZeRO-2 trains what one process trains).

Tied parameters whose copies land on different stages (GPT's ``tok_emb``/``lm_head``: first
and last stage) are kept equal as Megatron-LM does: both copies start from the same weights,
their gradients are summed over the two ranks after backward (:meth:`Pipeline.sync_tied_grads`)
and the optimizer updates both the same way. The global gradient norm counts the pair once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from allhands import collective
from allhands.config.pipeline import PP_SCHEDULE_CLASSES, PP_SCHEDULES, SINGLE_STAGE, V_SCHEDULES
from allhands.models import GPT, Llama
from allhands.parallel.tensor import _tied_groups

SCHEDULES = PP_SCHEDULES
MULTI_STAGE = set(PP_SCHEDULES) - set(SINGLE_STAGE)


# --------------------------------------------------------------------------- splitting


def units(model: nn.Module) -> list[str]:
    """The model's units in order (see the module doc)."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend(f"{name}.{key}" for key in child._modules)
        else:
            out.append(name)
    return out


def check_split_points(all_units: list[str], points: list[str], n_stages: int) -> list[int]:
    """Indices in ``all_units`` where stages 1..n-1 begin; ValueError names the bad point."""
    if len(points) != n_stages - 1:
        raise ValueError(f"parallel.pp_split: {n_stages} pipeline stages need {n_stages - 1} split "
                         f"points, got {len(points)} ({', '.join(points) or 'none'})")
    starts = []
    for p in points:
        if p not in all_units:
            raise ValueError(f"parallel.pp_split: {p!r} is not a unit of the model; units are "
                             f"{', '.join(all_units)}")
        starts.append(all_units.index(p))
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ValueError(f"parallel.pp_split: split points {', '.join(points)} must be distinct, in "
                         f"model order, and not the first unit {all_units[0]!r}")
    return starts


def stage_units(model: nn.Module, points: list[str], n_stages: int) -> list[list[str]]:
    all_units = units(model)
    bounds = [0, *check_split_points(all_units, points, n_stages), len(all_units)]
    return [all_units[bounds[s]:bounds[s + 1]] for s in range(n_stages)]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _delete_unit(model: nn.Module, unit: str) -> None:
    parent_name, _, key = unit.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if parent_name or isinstance(model, _CONTAINERS):
        # by key, so the remaining entries keep their FQNs ("blocks.3" stays "blocks.3") and a
        # container's own forward (nn.Sequential's loop) runs just what is left
        del parent._modules[key]
    else:
        setattr(model, key, None)


def build_stage_module(model: nn.Module, keep: list[str], reuse: bool = False) -> nn.Module:
    """``model`` holding only the units ``keep``: a deep copy of it, or with ``reuse`` the model
    itself, cut down. A model on the meta device copies no weights; a real one copied would
    hold its units twice until the caller drops it, so the last stage a rank builds reuses it."""
    stage = model if reuse else copy.deepcopy(model)
    for unit in units(stage):
        if unit not in keep:
            _delete_unit(stage, unit)
    return stage


def stage_ids_of(pp_rank: int, pp: int, stages_per_rank: int, schedule: str = "1f1b") -> list[int]:
    """The stages rank ``pp_rank`` holds: looped, or folded into a V for the V schedules."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def tied_across_stages(model: nn.Module, per_stage: list[list[str]]) -> list[list[tuple[int, str]]]:
    """Groups of (stage, FQN) sharing one tensor in ``model`` but placed on different stages."""
    def stage_of(fqn: str) -> int:
        for s, us in enumerate(per_stage):
            if any(fqn == u or fqn.startswith(u + ".") for u in us):
                return s
        raise AssertionError(fqn)

    out = []
    for names in _tied_groups(model):
        placed = {stage_of(n): n for n in reversed(names)}  # one FQN per stage
        if len(placed) > 1:
            out.append(sorted(placed.items()))
    return out


# --------------------------------------------------------------------------- running


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them.

    ``modules`` are the stage modules the caller parallelizes further (TP first, then FSDP/DDP)
    before :meth:`start` wraps them in ``PipelineStage`` s and builds the schedule.
    """

    modules: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    pp_rank: int
    pp_size: int
    schedule_name: str
    n_microbatches: int
    group: dist.ProcessGroup
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    tied_group: dist.ProcessGroup | None = None
    schedule: object = None
    eval_schedule: object = None
    loss_scale: float = 1.0

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def start(self, device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        # Imported here, for start-up time: pipelining imports torch._dynamo, about half a second
        # of every worker's start that a job without pipeline stages does not need.
        from torch.distributed.pipelining import PipelineStage, schedules

        def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Mean over equal microbatches = the batch mean the single process takes. Scaling
            # the loss, not the gradients: with scale_grads=True the schedule would divide every
            # .grad after each step, including what earlier accumulation steps left there.
            return loss_fn(out, target) * (self.loss_scale / self.n_microbatches)

        def build(stage_cls):
            stages = [stage_cls(m, s, self.n_stages, device, group=self.group)
                      for m, s in zip(self.modules, self.stage_ids)]
            cls = getattr(schedules, PP_SCHEDULE_CLASSES[self.schedule_name])
            return cls(stages if self.schedule_name in MULTI_STAGE else stages[0],
                       n_microbatches=self.n_microbatches, loss_fn=scaled_loss, scale_grads=False)

        class ForwardOnlyStage(PipelineStage):
            # torch 2.13's V schedules hand the input gradient from one stage to the other on the
            # same rank even in eval(), when there is none, and fail ("can't steal_bwd_input if
            # this stage doesn't have backward", measured); without backward there is nothing to hand
            def get_local_bwd_output(self, mb_index):
                return super().get_local_bwd_output(mb_index) if self.has_backward else ()

            def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
                if self.has_backward:
                    super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        # Training and evaluation get a schedule (and stage wrappers) each over the same modules:
        # one schedule switched between eval and step re-runs its shape inference at every switch.
        self.schedule, self.eval_schedule = build(PipelineStage), build(ForwardOnlyStage)

    def _call(self, run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        target = y if self.has_last else None
        run(*args, target=target, losses=losses if self.has_last else None)
        if not self.has_last:
            return None
        return torch.stack([l.detach() for l in losses]).sum()  # each already / n_microbatches

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor | None:
        """Forward and backward of one batch in microbatches; the loss on the last stage's rank,
        else None. Gradients accumulate into the stage parameters."""
        self.loss_scale = loss_scale
        return self._call(self.schedule.step, x, y)

    def eval(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        self.loss_scale = 1.0
        return self._call(self.eval_schedule.eval, x, y)

    # -- tied parameters across stages
    def _local_tied(self) -> list[tuple[int, str]]:
        mine = []
        for group in self.tied:
            for stage, fqn in group:
                if stage in self.stage_ids:
                    mine.append((stage, fqn))
        return mine

    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied copies over the first- and last-stage ranks."""
        for group in self.tied:
            holders = [(s, fqn) for s, fqn in group if s in self.stage_ids]
            if not holders:
                continue
            grads = [_param(self.modules[self.stage_ids.index(s)], fqn).grad for s, fqn in holders]
            if any(g is None for g in grads):
                continue
            grad = grads[0]
            if len(holders) == len(group):  # every copy on this rank (the V schedules' rank 0)
                for g in grads[1:]:
                    grad.add_(g)
            else:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                collective.all_reduce(local, call="sync_tied_grads", group=self.tied_group or self.group)
            # the other copies on this rank take the summed gradient
            for g in grads[1:]:
                g.copy_(grad)

    def optimizer_aliases(self) -> list[dict[str, str]]:
        """Per stage of this rank, {FQN of a tied copy: the FQN the unsplit model keys its
        optimizer state by (the first stage's)}. Every copy but the first is renamed, also one
        whose first-stage twin is on this rank in another stage (the V schedules' rank 0): the
        checkpoint then holds one entry per parameter of the unsplit model, whatever the placement."""
        out: list[dict[str, str]] = [{} for _ in self.stage_ids]
        for group in self.tied:
            first_fqn = group[0][1]
            for s, fqn in group[1:]:
                if s in self.stage_ids:
                    out[self.stage_ids.index(s)][fqn] = first_fqn
        return out

    def norm_duplicates(self) -> set[int]:
        """ids of parameters whose gradient is counted on another stage (the last copies)."""
        skip = set()
        for group in self.tied:
            first_stage = group[0][0]
            for s, fqn in group:
                if s != first_stage and s in self.stage_ids:
                    skip.add(id(_param(self.modules[self.stage_ids.index(s)], fqn)))
        return skip


def _param(module: nn.Module, fqn: str) -> nn.Parameter:
    inner = getattr(module, "module", module)  # DDP keeps the stage under .module
    mod_name, _, p_name = fqn.rpartition(".")
    return getattr(inner.get_submodule(mod_name) if mod_name else inner, p_name)


def build_pipeline(model: nn.Module, *, pp_rank: int, pp_size: int, group: dist.ProcessGroup,
                   schedule: str, n_microbatches: int, stages_per_rank: int = 1,
                   split_points: list[str] | None = None,
                   tied_group: dist.ProcessGroup | None = None) -> Pipeline:
    """Cut ``model`` into ``pp_size * stages_per_rank`` stages and keep this rank's; ``model``
    itself becomes the last of them. Built on the meta device, each stage is allocated only
    after the cut (parallel/layout.py), with just its own units.

    ``split_points``: FQNs of the units that begin stages 1.. (None: the model's own
    ``pipeline_split_points(n_stages)``; a GPT's or Llama's default: :func:`balanced_split`). ``tied_group``: the group of the ranks holding the
    first and the last stage (None: ``group``, which is exactly those two ranks when pp=2).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule: {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if schedule not in MULTI_STAGE and stages_per_rank != 1:
        raise ValueError(f"parallel.pp_stages_per_rank: {schedule} runs one stage per rank; "
                         f"use interleaved1f1b for {stages_per_rank}")
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(f"parallel.pp_stages_per_rank: {schedule} runs exactly 2 stages per rank, "
                         f"got {stages_per_rank}")
    n_stages = pp_size * stages_per_rank
    if split_points is None:
        auto = getattr(model, "pipeline_split_points", None)
        if auto is None and isinstance(model, (GPT, Llama)):  # a shipped family: equal blocks per stage
            auto = lambda n: balanced_split(len(model.blocks), n)  # noqa: E731
        if auto is None:
            raise ValueError(f"parallel.pp_split: the model {type(model).__name__} has no automatic "
                             f"split; name the {n_stages - 1} units that begin stages 1.. "
                             f"(units: {', '.join(units(model))})")
        split_points = auto(n_stages)
    per_stage = stage_units(model, split_points, n_stages)
    ids = stage_ids_of(pp_rank, pp_size, stages_per_rank, schedule)
    tied = tied_across_stages(model, per_stage)
    # a tied pair split over two ranks (not both on this one, as the V schedules' rank 0 holds it)
    holds_tied = any(set(dict(g)) & set(ids) and not set(dict(g)) <= set(ids) for g in tied)
    if holds_tied and pp_size > 2 and tied_group is None:
        raise ValueError("tied parameters on the first and last stage need tied_group, the group of "
                         "those two ranks (Mesh.pp_ends_group), when pp > 2")
    # the model itself becomes this rank's last stage, so no copy of it outlives the split
    modules = [build_stage_module(model, per_stage[s], reuse=i == len(ids) - 1)
               for i, s in enumerate(ids)]
    return Pipeline(modules, ids, n_stages, pp_rank, pp_size, schedule, n_microbatches, group,
                    tied=tied, tied_group=tied_group)


def balanced_split(n_layers: int, n_stages: int, prefix: str = "blocks") -> list[str]:
    """Split points giving each stage ``n_layers / n_stages`` blocks (earlier stages get the
    remainder; the embedding and the head ride with the first and last stage)."""
    if n_stages > n_layers:
        raise ValueError(f"parallel.pp: {n_stages} stages need at least as many layers, "
                         f"the model has {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    points, start = [], 0
    for s in range(n_stages - 1):
        start += base + (1 if s < extra else 0)
        points.append(f"{prefix}.{start}")
    return points


def global_grad_norm(params: list[nn.Parameter], *, pp_group: dist.ProcessGroup | None = None,
                     skip: set[int] = frozenset(), norm_type: float = 2.0) -> torch.Tensor:
    """The gradient norm of the whole model, as one process would compute it, as a 0-dim tensor
    on the gradients' device: no host sync (the loop reads it only on a step that logs).

    DTensor gradients (TP, FSDP) contribute their full-tensor norm (``full_tensor`` sums the
    partial squares over the sharded mesh dims); plain ones their local norm; then the squares
    are summed over the pipeline stages (torchtitan's ``clip_grad_norm_`` does the same).
    """
    by_mesh = _by_mesh(params, skip)
    # summed where the stages reduce it (a stage without gradients takes part too)
    if pp_group is not None:
        dev = collective.device(pp_group)
    else:
        dev = next((_local(p.grad).device for ps in by_mesh.values() for p in ps), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for ps in by_mesh.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], norm_type)
        total = total + (_local_full(n).float() ** norm_type).to(dev)
    if pp_group is not None:
        collective.all_reduce(total, call="global_grad_norm", group=pp_group)
    return total ** (1.0 / norm_type)


def _by_mesh(params: list[nn.Parameter], skip: set[int] = frozenset()) -> dict[object, list[nn.Parameter]]:
    """The parameters of ``params`` with a gradient (less ``skip``), one list per DTensor mesh
    of the gradient (None: plain tensors): torch's foreach kernels refuse a list that mixes them
    (expert parallelism)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p)
    return by_mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "device_mesh") else t


def _local_full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "device_mesh") else t


def clip_grads(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as ``clip_grad_norm_`` does:
    on the device, by torch's ``clip_grads_with_norm_`` (foreach where the device has it), one
    call per mesh, with no host sync."""
    if max_norm <= 0 or not math.isfinite(max_norm):
        return
    for ps in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total_norm)

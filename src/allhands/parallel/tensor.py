"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) on DTensor's ``parallelize_module``.

A plan maps module FQNs to DTensor parallel styles. The reference GPT's is :func:`gpt_tp_plan`
(modelled on torchtitan's ``models/llama3/parallelize.py``), the Llama family's
:func:`llama_tp_plan` (``FAMILY_PLANS`` picks one by model class); a user model can define a ``tp_plan(sequence_parallel: bool) -> dict`` method the same way, or pass ``plan=`` here
(``allhands.train(..., tp_plan=...)``). Per block, with tp ranks and sequence parallel on
(Korthikanti et al. 2022), the residual stream between modules is a local ``(B, T/tp, C)``:

    ln1 (SequenceParallel) -> all-gather T -> qkv (column: local heads) -> attention on
    n_head/tp heads -> proj (row) -> reduce-scatter T -> + residual; the same for ln2 -> fc -> proj

so each block costs two all-gathers and two reduce-scatters of ``(B, T, C)`` forward (the same
bytes as Megatron's two all-reduces) and LayerNorm activations are stored once per tp group.

Parameters tied before parallelizing (GPT's ``tok_emb``/``lm_head``) are tied again afterwards,
provided the plan gives them the same placement (the embedding is row-wise and the head
column-wise: both shard the vocabulary dim 0), so their gradients accumulate into one DTensor.

Vocabulary-parallel loss (``loss_parallel=True``, as torchtitan trains under tp): the head's
output stays a DTensor ``(B, T, V)`` sharded on the vocabulary, each rank holding
``(B, T, V/tp)``, and the cross entropy runs on the shards inside torch's ``loss_parallel()``
(:func:`loss_context`): an all-reduce of the row max and of the sum of exponentials, ``(B, T)``
each, and one of the target's logit, instead of all-gathering ``(B, T, V)`` logits to every rank
and computing the same loss tp times (2.1 GB of fp32 logits per 8k-token sequence at a 128k
vocabulary).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel.style import distribute_module

from allhands.models import GPT, Llama
from allhands.models.moe import MoE

TPPlan = dict[str, ParallelStyle]
PlanFn = Callable[[nn.Module, bool], TPPlan]


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors and hand its output on in ``output_layout``.

    For small modules that no style covers but whose parameters must still be DTensors, so that
    gradient clipping and FSDP see one kind of parameter: GPT's learned position embedding,
    whose ``(T, C)`` output is cut to this rank's ``(T/tp, C)`` sequence slice when the residual
    stream is sequence-parallel. The parameters are identical on every rank already (same seed),
    so ``from_local`` needs no broadcast. Backward of the Replicate -> Shard cut is an
    all-gather of the gradient, which gives every rank the full (identical) weight gradient.
    """

    def __init__(self, *, output_layout=Replicate(), use_local_output: bool = True):
        super().__init__()
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _replicate(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False),
                                     requires_grad=param.requires_grad))

    def _inputs(self, mod, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                     for t in inputs)

    def _output(self, mod, out, mesh):
        if self.output_layout != Replicate():
            out = out.redistribute(placements=[self.output_layout])
        return out.to_local() if self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._inputs, self._output)


class LocalReplicate(ReplicateParallel):
    """A module computed whole on every tp rank, on plain tensors: the MoE layer, whose routing,
    sorting and scattering have no DTensor rules. Its parameters become replicated DTensors
    (one kind of parameter for clipping and FSDP), which it reads as local tensors
    (models/moe.py ``local``); its input is gathered from ``layout`` (the residual stream's) to
    the whole tensor and its output cut back to ``layout``. Every rank computes the same, so
    each holds the full, identical gradient of every parameter and of its input."""

    def __init__(self, layout):
        super().__init__(output_layout=layout)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        for m in module.modules():  # distribute_module replicates buffers too: the routing
            for key, buf in m._buffers.items():  # counts and bias stay plain, alike on every rank
                if isinstance(buf, DTensor):
                    m._buffers[key] = buf.to_local()
        return module

    def _inputs(self, mod, inputs, mesh):
        x, *rest = inputs  # the norm before it hands a DTensor on (SequenceParallel)
        whole = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [self.output_layout],
                                                                    run_check=False)
        return (whole.redistribute(placements=[Replicate()]).to_local(), *rest)

    def _output(self, mod, out, mesh):
        out = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
        return super()._output(mod, out, mesh)


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """FQNs of parameters that share one tensor, e.g. [["tok_emb.weight", "lm_head.weight"]]."""
    by_id: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            names = by_id.setdefault(id(p), [])
            if fqn not in names:
                names.append(fqn)
    return [names for names in by_id.values() if len(names) > 1]


def _get_param(model: nn.Module, fqn: str) -> nn.Parameter:
    mod_name, _, p_name = fqn.rpartition(".")
    return getattr(model.get_submodule(mod_name), p_name)


def gpt_tp_plan(model: GPT, sequence_parallel: bool = True, *,
                loss_parallel: bool = False) -> TPPlan:
    """The reference GPT's plan, the default for a GPT (torchtitan llama3's, with a learned position embedding).

    Shapes with sequence parallel on, per rank: tok_emb out ``(B, T/tp, C)`` (row-wise over the
    vocabulary: each rank looks up its vocabulary rows, then a reduce-scatter over T);
    qkv/fc out ``(B, T, 3C/tp)`` / ``(B, T, 4C/tp)``; lm_head in ``(B, T, C)`` (all-gathered),
    out (:func:`head_style`) ``(B, T, V/tp)`` for a vocabulary-parallel loss, else ``(B, T, V)``
    replicated. ``model`` may be a pipeline stage: absent parts are left out of the plan.
    """
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    plan: dict = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        plan["pos_emb"] = ReplicateParallel(output_layout=Shard(0) if sp else Replicate())
    for name in model.blocks.keys():
        b = f"blocks.{name}"
        norm = SequenceParallel() if sp else ReplicateParallel(use_local_output=False)
        plan.update({
            f"{b}.ln1": norm,
            f"{b}.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            f"{b}.attn.qkv": ColwiseParallel(),
            f"{b}.attn.proj": RowwiseParallel(output_layouts=seq),
            f"{b}.ln2": SequenceParallel() if sp else ReplicateParallel(use_local_output=False),
            f"{b}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            f"{b}.mlp.fc": ColwiseParallel(),
            f"{b}.mlp.proj": RowwiseParallel(output_layouts=seq),
        })
    if getattr(model, "lm_head", None) is not None:
        plan["ln_f"] = SequenceParallel() if sp else ReplicateParallel(use_local_output=False)
        plan["lm_head"] = head_style(seq, loss_parallel)
    return plan


def llama_tp_plan(model: Llama, sequence_parallel: bool = True, *,
                  loss_parallel: bool = False) -> TPPlan:
    """The Llama family's plan (torchtitan's ``models/llama3`` and ``models/qwen3`` parallelize).

    Per block, with sequence parallel on: attn_norm/mlp_norm SequenceParallel over T; q/k/v
    column-wise, so each rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value
    heads (whole grouped-query groups: tp must divide ``n_kv_heads``, checked before start),
    outputs ``(B, T, heads/tp * hd)``; o_proj row-wise with a reduce-scatter over T; gate/up
    column-wise ``(B, T, H/tp)``, down row-wise. Qwen3's q_norm/k_norm act on each local head
    ``(B, T, heads/tp, hd)``: a SequenceParallel over the head dim (2) makes their weight a
    replicated DTensor whose gradient, a partial sum over each rank's heads, is reduced over
    tp like the other norms' (torchtitan's qwen3 does the same). The RoPE tables are plain
    buffers of the root: each block gets the full ``(T, hd)`` cos/sin, since attention runs on
    the all-gathered sequence. An MoE feed-forward runs whole on every tp rank
    (:class:`LocalReplicate`): its experts are split by ``parallel.ep``, not by tp.
    ``model`` may be a pipeline stage: absent parts are left out."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()

    def norm(dim: int = 1) -> ParallelStyle:
        return SequenceParallel(sequence_dim=dim) if sp else ReplicateParallel(use_local_output=False)

    plan: dict = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    for name, block in model.blocks.items():
        b = f"blocks.{name}"
        # (x, cos, sin): only the hidden state is redistributed; the RoPE tables pass through
        # attention's inputs: x, and the RoPE tables and the document mask (or None), left as they are
        gather = PrepareModuleInput(input_layouts=(seq, None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None))
        plan.update({
            f"{b}.attn_norm": norm(),
            f"{b}.attn": gather,
            f"{b}.attn.q_proj": ColwiseParallel(),
            f"{b}.attn.k_proj": ColwiseParallel(),
            f"{b}.attn.v_proj": ColwiseParallel(),
            f"{b}.attn.o_proj": RowwiseParallel(output_layouts=seq),
            f"{b}.mlp_norm": norm(),
        })
        if isinstance(block.mlp, MoE):  # whole on every tp rank; ep splits its experts
            plan[f"{b}.mlp"] = LocalReplicate(seq)
        else:
            plan.update({
                f"{b}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp.gate_proj": ColwiseParallel(),
                f"{b}.mlp.up_proj": ColwiseParallel(),
                f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=seq),
            })
        if block.attn.q_norm is not None:
            # local heads in, local heads out: the local (B, T, heads/tp, hd) is Shard(2)
            plan[f"{b}.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan[f"{b}.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if getattr(model, "lm_head", None) is not None:
        plan["norm"] = norm()
        plan["lm_head"] = head_style(seq, loss_parallel)
    return plan


def head_style(seq, loss_parallel: bool) -> ColwiseParallel:
    """The output head, column-wise over the vocabulary, its input all-gathered from ``seq``.
    ``loss_parallel``: its output stays the vocabulary-sharded DTensor ``(B, T, V/tp)`` for
    :func:`loss_context` (torchtitan v0.2.0's ``parallelize_llama``: ``output_layouts=Shard(-1)``,
    ``use_local_output=False``; later releases run the same algorithm in a function of their
    own); else it is all-gathered to a plain ``(B, T, V)`` on every rank, for a loss that needs
    the whole vocabulary (a user's)."""
    if loss_parallel:
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())


def loss_context(enabled: bool) -> ContextManager:
    """torch's ``loss_parallel()`` when ``enabled``: ``F.cross_entropy`` on logits sharded on the
    class dim computes on the shards. Forward and backward both run inside it (torch's rule:
    its backward ops are replaced too). It swaps only the log-softmax and nll-loss ops of
    DTensors, so the model's own forward and backward may run inside it as well."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss from :func:`loss_context` as a plain tensor: there it is a DTensor replicated over
    tp (every rank holds the whole value), which the loop adds to plain tensors."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


# The default plan of each model class allhands ships (a model's own tp_plan method wins).
# Each also takes ``loss_parallel=`` (keyword), which a user's plan function does not.
FAMILY_PLANS: dict[type, Callable[..., TPPlan]] = {GPT: gpt_tp_plan, Llama: llama_tp_plan}


def resolve_plan(model: nn.Module, plan: TPPlan | PlanFn | None, sequence_parallel: bool,
                 loss_parallel: bool = False) -> TPPlan:
    """The plan to use: an explicit dict, a callable ``(model, sequence_parallel)``, or the
    model's own ``tp_plan(sequence_parallel)`` method (a shipped family's default:
    ``FAMILY_PLANS``). ``loss_parallel``: a shipped family's head keeps its vocabulary-sharded
    output (:func:`head_style`); a user's plan decides its head itself."""
    if plan is None:
        own = getattr(model, "tp_plan", None)
        family = next((fn for cls, fn in FAMILY_PLANS.items() if isinstance(model, cls)), None)
        if own is None and family is not None:
            return family(model, sequence_parallel, loss_parallel=loss_parallel)
        if own is None:
            raise ValueError(f"parallel.tp: the model {type(model).__name__} has no tensor-parallel "
                             "plan; give it a tp_plan(sequence_parallel) method or pass "
                             "allhands.train(..., tp_plan={fqn: ParallelStyle}) (see README)")
        return own(sequence_parallel)
    if callable(plan):
        return plan(model, sequence_parallel)
    return dict(plan)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
             plan: TPPlan | PlanFn | None = None, loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` with ``plan`` (see :func:`resolve_plan`).
    ``loss_parallel``: the loss takes vocabulary-sharded logits (:func:`loss_context`).

    Must run first, before activation checkpointing and FSDP/DDP (torchtitan's order): FSDP then
    shards the DTensor parameters further over the data-parallel dims (2-D parameters).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tp mesh, got {tp_mesh.ndim} dims")
    styles = resolve_plan(model, plan, sequence_parallel, loss_parallel)
    missing = [fqn for fqn in styles if _find(model, fqn) is None]
    if missing:
        raise ValueError(f"parallel.tp: the TP plan names modules the model does not have: "
                         f"{', '.join(missing)}; use FQNs from model.named_modules()")
    tied = _tied_groups(model)
    parallelize_module(model, tp_mesh, styles)
    for names in tied:
        first = _get_param(model, names[0])
        for other in names[1:]:
            p = _get_param(model, other)
            if p is first:
                continue
            layout = lambda t: t.placements if isinstance(t, DTensor) else "a plain tensor"  # noqa: E731
            if layout(p) != layout(first) or p.shape != first.shape:
                raise ValueError(
                    f"model.tie_embeddings: the TP plan gives tied parameters {names[0]!r} "
                    f"({layout(first)}) and {other!r} ({layout(p)}) different layouts; give both "
                    f"the same sharding or set model.tie_embeddings=false")
            mod_name, _, p_name = other.rpartition(".")
            setattr(model.get_submodule(mod_name), p_name, first)
    return model


def _find(model: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def tp_summary(model: nn.Module) -> dict[str, Any]:
    """Local vs global parameter counts, for the start-of-run log line."""
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"local_params": local, "global_params": total}

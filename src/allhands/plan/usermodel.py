"""A user's model planned before launch: built on the meta device from ``MODULE:BUILDER`` (the
Python API's builder, ``(config) -> nn.Module``: no memory, no arithmetic), with its parameters
counted, its forward + backward FLOPs counted by torch's FlopCounterMode and the bytes autograd
saves for backward (its activations) summed with saved-tensor hooks, per sample; every
data-parallel layout of a cluster (DDP, ZeRO-1/2/3, hybrid) is then estimated from those figures.

Tensor and pipeline parallelism need a plan or a split of the model the planner cannot infer, so
a user model is planned over data-parallel layouts only.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from allhands.config import Config
from allhands.errors import ConfigError
from allhands.jobcheck import checked_model
from allhands.plan.cluster import Cluster
from allhands.plan.estimate import Estimate, Layout, dp_comm, train_state
from allhands.plan.search import format_plan, layouts, to_row

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_builder(spec: str) -> Callable[[Config], nn.Module]:
    """``module:function`` imported (the current directory first on the path, as ``python -m``
    does), or a one-line ConfigError naming what is missing."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"--model: {spec!r} is not MODULE:BUILDER, e.g. mymodels:build for a "
                          f"function build(config) -> nn.Module in mymodels.py")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"--model: cannot import {module!r} ({e}); run from its directory or add "
                          f"it to PYTHONPATH") from None
    fn = getattr(found, name, None)
    if not callable(fn):
        raise ConfigError(f"--model: {module} has no function {name!r}; pass MODULE:BUILDER")
    return fn


def parse_input(spec: str, cfg: Config) -> tuple[tuple[int, ...], torch.dtype]:
    """``DIMxDIM...[:DTYPE]`` of one sample (default dtype float32), or token ids of
    ``model.seq_len`` when ``spec`` is empty."""
    if not spec:
        return (cfg.model.seq_len,), torch.int64
    dims, _, dtype = spec.partition(":")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1 or (dtype and dtype not in DTYPES):
        raise ConfigError(f"--input: {spec!r} is not one sample's shape DIMxDIM...[:DTYPE], e.g. "
                          f"3x32x32 or 128:int64; DTYPE one of {', '.join(DTYPES)}")
    return shape, DTYPES[dtype or "float32"]


@dataclass
class ModelShape:
    """What the planner needs of a model, per sample."""

    params: int
    tensors: int
    flops: int  # forward + backward FLOPs of one sample (FlopCounterMode)
    activations: float  # bytes autograd keeps for backward, one sample, parameters excluded
    largest_child: int  # parameters of the largest direct child: FSDP2's largest gathered unit
    units: int  # direct children and the root: the collectives' call count under FSDP2

    def describe(self) -> str:
        return (f"model: {self.params:,} parameters in {self.tensors} tensors; per sample "
                f"{self.flops:.4g} FLOPs (forward + backward) and {self.activations / 2**20:.3g} MiB "
                f"of activations (counted on the meta device)")


def measure(build: Callable[[Config], nn.Module], cfg: Config, shape: tuple[int, ...],
            dtype: torch.dtype) -> ModelShape:
    """Build the model on the meta device and run one sample's forward and backward there."""
    from torch.utils.flop_counter import FlopCounterMode  # start-up time: only plans count FLOPs

    try:
        with torch.device("meta"):
            model = build(cfg)
    except Exception as e:  # the user's code: any failure is theirs to fix, named in one line
        raise ConfigError(f"--model: building it on the meta device failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}; the builder must take the "
                          f"config and create tensors without reading their values") from None
    model = checked_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    owned = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # the tensors kept alive, so that ids are not reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in owned and id(base) not in owned:  # weights saved for backward are not activations
            saved[id(t)] = t
        return t

    x = torch.zeros((1, *shape), dtype=dtype, device="meta")
    try:
        with FlopCounterMode(display=False) as counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()
    except (RuntimeError, NotImplementedError, TypeError, IndexError) as e:
        raise ConfigError(f"--model: the model does not run one sample of shape {list(shape)} "
                          f"({str(e).splitlines()[0][:120]}); pass the sample's shape with --input") from None
    children = [sum(p.numel() for p in c.parameters()) for c in model.children()] or [0]
    return ModelShape(params=sum(p.numel() for p in params), tensors=len(params),
                      flops=int(counter.get_total_flops()),
                      activations=float(sum(t.numel() * t.element_size() for t in saved.values())),
                      largest_child=max(children), units=len(children) + 1)


def estimate_user(shape: ModelShape, cfg: Config, layout: Layout, cluster: Cluster, bf16: bool) -> Estimate:
    """Per-rank memory and step time of a data-parallel ``layout`` of the measured model, as
    estimate.py does for the reference GPT: the state by ZeRO stage, the measured activations
    times the per-rank batch (halved in bf16), matmul FLOPs at ``gemm_eff`` of peak and the
    data-parallel collectives on the links their mesh dims span."""
    r = cfg.run
    est = Estimate(layout)
    mb = r.global_batch / (layout.dp * r.micro_batches)
    p = 4.0 * shape.params
    state = train_state(layout, p, shape.tensors, 8 if cfg.optim.name == "adamw" else 0)
    est.state_rank.append(sum(state.values()))
    gathered = {0: p / 2 if bf16 else 0.0, 1: p / 2 if bf16 else 0.0, 2: p / (2 if bf16 else 1),
                3: 2 * 4.0 * shape.largest_child / (2 if bf16 else 1)}[layout.zero]
    acts = shape.activations * mb / (2 if bf16 else 1)
    est.memory = {**state, "activations": acts, "buffers": gathered + cluster.runtime}
    est.memory["total"] = sum(est.memory.values())
    usable = cluster.memory * (0.9 if cluster.device == "cuda" else 0.8)
    if est.memory["total"] > usable:
        est.reason = (f"needs {est.memory['total'] / 2**30:.1f} GiB per rank, {usable / 2**30:.1f} "
                      f"GiB usable of {cluster.memory / 2**30:.1f}")
    peak = cluster.peak(bf16)
    compute = shape.flops * mb * r.micro_batches / (peak * cluster.gemm_eff)
    reduce, exposed = dp_comm(layout, cluster, p, shape.tensors, shape.units, compute, bf16)
    optim = 28.0 * shape.params / max(1, layout.dp_shard if layout.zero else 1) / cluster.mem_bw
    step = compute + exposed + optim
    est.time = {"compute": compute, "bubble": 0.0, "comm": reduce, "comm_exposed": exposed,
                "optimizer": optim, "step": step}
    est.tokens_per_s = r.global_batch / step  # samples/s: a user's sample need not be tokens
    est.mfu = shape.flops * r.global_batch / step / (peak * layout.world)
    return est


def plan_user(shape: ModelShape, cfg: Config, cluster: Cluster, bf16: bool) -> list[Estimate]:
    """Every data-parallel layout of ``cluster.world`` ranks for the measured model, fastest
    feasible first (search.plan's order)."""
    out = [estimate_user(shape, cfg, lay, cluster, bf16)
           for lay in layouts(cfg, cluster.world, cluster.per_node, compile_options=(False,), ac_options=("none",))
           if lay.tp == 1 and lay.pp == 1]
    out.sort(key=lambda e: (not e.feasible, e.time["step"], e.layout.name()))
    return out


def plan_command(cfg: Config, model: str, sample: str, cluster: Cluster, *, top: int, as_json: bool) -> str:
    """``allhands plan --model MODULE:BUILDER [--input SHAPE]``'s output: the measured model, then
    its layouts (a table, or JSON)."""
    shape = measure(load_builder(model), cfg, *parse_input(sample, cfg))
    bf16 = cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and cluster.device == "cuda")
    estimates = plan_user(shape, cfg, cluster, bf16)
    if as_json:
        return json.dumps({"cluster": {k: v for k, v in vars(cluster).items() if k != "calib"},
                           "model": vars(shape), "layouts": [to_row(e) for e in estimates]})
    return shape.describe() + " (tok/s below: samples/s)\n" + format_plan(estimates, cluster, top=top)

"""The optimizer's foreach kernels under expert parallelism, forced on CPU.

torch's optimizers default to foreach kernels on CUDA only (``_default_to_fused_or_foreach``),
so a GPU run takes a path the CPU suite never takes. Under ep the parameters are plain tensors
(or FSDP's DTensors on the dense mesh) and the experts' DTensors on the expert mesh; a foreach
kernel over one list of both raises ("_foreach_mul_ got mixed torch.Tensor and DTensor"). Here
every worker forces foreach (AdamW now steps fused, optim.py, over the same groups; SGD over
DTensors keeps foreach), and ep=2 must still train to the single-process reference's parameters. The gradient norm of the clip (parallel/pipeline.py ``global_grad_norm``) takes
``_foreach_norm`` on CPU already (torch 2.13's ``clip_grad`` counts the CPU in its foreach
default), one call per mesh."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from allhands.job import Job, build_reference_model
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.optim import build_optimizer
from allhands.parallel.pipeline import clip_grads, global_grad_norm

from conftest import tiny_config
from test_expert_parallel import MOE
from test_parity import assert_matches_reference
from test_step_cost import HostReads


def _foreach_always(params, differentiable, use_fused=False):
    return False, not differentiable


def _mesh(t: torch.Tensor):
    return t.device_mesh if isinstance(t, DTensor) else None


def force_foreach() -> None:
    """What torch picks on CUDA, on this process: the optimizers' foreach kernels (their modules
    bind the chooser by name, so each is replaced where it is read)."""
    for name in ("torch.optim.optimizer", "torch.optim.adam", "torch.optim.sgd"):
        importlib.import_module(name)._default_to_fused_or_foreach = _foreach_always


def foreach_model(cfg) -> nn.Module:
    """The reference model, built in a worker that forces foreach before its optimizer exists."""
    force_foreach()
    return build_reference_model(cfg, 257)


@pytest.mark.parametrize("label,extra", [
    ("ep2 ddp adamw", ["parallel.ep=2"]),
    ("ep2 fsdp zero3 adamw", ["parallel.ep=2", "parallel.dp_shard=2", "parallel.zero=3"]),
    ("ep2 ddp sgd", ["parallel.ep=2", "optim.name=sgd", "optim.lr=0.5"]),
])
def test_foreach_optimizer_under_expert_parallelism_matches_single_process(token_dir, tmp_path,
                                                                            label, extra):
    # AdamW with weight decay: both of its groups, on both meshes
    cfg = tiny_config(token_dir, tmp_path / "run", *MOE, "optim.name=adamw", "optim.lr=1e-2",
                      "optim.weight_decay=0.1", *extra)
    done = train_job(cfg, LaunchSpec(nproc=2, max_restarts=0), job=Job(model=foreach_model))
    got = assert_matches_reference(done, label)
    assert any("experts" in k for k in got)


def test_param_groups_hold_one_kind_of_tensor_each(token_dir, tmp_path, monkeypatch):
    """The grouping alone, in this process: a model whose parameters are plain tensors and
    DTensors of two meshes gets one group per (weight-decay choice, mesh), hyper-parameters kept,
    and AdamW's foreach kernels step them."""
    cfg = tiny_config(token_dir, tmp_path / "run")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dense = init_device_mesh("cpu", (1,), mesh_dim_names=("dense",))
        expert = init_device_mesh("cpu", (1, 1), mesh_dim_names=("edp", "ep"))["ep"]
        m = nn.Module()
        m.plain_w, m.plain_b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
        m.dense_w = nn.Parameter(DTensor.from_local(torch.ones(2, 2), dense, [Shard(0)]))
        m.dense_b = nn.Parameter(DTensor.from_local(torch.ones(2), dense, [Replicate()]))
        m.expert_w = nn.Parameter(DTensor.from_local(torch.ones(2, 2, 2), expert, [Shard(0)]))
        opt = build_optimizer(m, cfg)
        kinds = []
        for g in opt.param_groups:
            meshes = {_mesh(p) for p in g["params"]}
            assert len(meshes) == 1 and g["params"]
            kinds.append((g["weight_decay"], meshes.pop()))
        assert len(set(kinds)) == len(kinds) == 5
        assert {g["weight_decay"] for g in opt.param_groups} == {cfg.optim.weight_decay, 0.0}
        assert sum(len(g["params"]) for g in opt.param_groups) == 5
        adam = importlib.import_module("torch.optim.adam")
        monkeypatch.setattr(adam, "_default_to_fused_or_foreach", _foreach_always)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(opt.state[p]["exp_avg"] is not None for p in m.parameters())
        # the clip's norm (ep layouts: parallel/pipeline.py) calls _foreach_norm per mesh
        seen = []
        norm_all = torch._foreach_norm
        monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **kw: (
            seen.append({_mesh(t) for t in ts}),
            norm_all(ts, *a, **kw))[1])
        norm = global_grad_norm(list(m.parameters()))
        assert len(seen) == 3 and all(len(kinds) == 1 for kinds in seen), seen
        assert torch.allclose(norm, torch.tensor(20.0).sqrt())  # 4 + 2 + 4 + 2 + 8 ones
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_the_clip_of_mixed_meshes_stays_on_the_device(max_norm):
    """The clip of tp, pp and ep layouts (parallel/pipeline.py): the norm over plain tensors and
    DTensors of two meshes, then the scaling, read nothing back to the host (a GPU step would
    stall on it), and scale as torch's ``clip_grad_norm_`` does on the same values."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dense = init_device_mesh("cpu", (1,), mesh_dim_names=("dense",))
        expert = init_device_mesh("cpu", (1, 1), mesh_dim_names=("edp", "ep"))["ep"]
        torch.manual_seed(0)
        values = [torch.randn(3, 4), torch.randn(4), torch.randn(2, 3, 4)]
        params = [nn.Parameter(torch.zeros(3, 4)),
                  nn.Parameter(DTensor.from_local(torch.zeros(4), dense, [Replicate()])),
                  nn.Parameter(DTensor.from_local(torch.zeros(2, 3, 4), expert, [Shard(0)]))]
        for p, v in zip(params, values):
            p.grad = v.clone() if not isinstance(p, DTensor) else DTensor.from_local(
                v.clone(), p.device_mesh, p.placements)
        reference = [nn.Parameter(torch.zeros_like(v)) for v in values]
        for p, v in zip(reference, values):
            p.grad = v.clone()
        want = torch.nn.utils.clip_grad_norm_(reference, max_norm)
        with HostReads() as seen:
            norm = global_grad_norm(params)
            clip_grads(params, max_norm, norm)
        assert seen.reads == 0
        assert torch.allclose(norm, want)
        for p, r in zip(params, reference):
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            assert torch.equal(g, r.grad), (max_norm, g, r.grad)
    finally:
        dist.destroy_process_group()

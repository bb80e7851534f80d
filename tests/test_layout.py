"""The layout's decisions (where bf16 comes from, which ranks must hold equal parameters), its
one-process step against a plain module, and the loop's ignorance of the layout.

The multi-process layouts (pipeline, TP, FSDP, ZeRO-1) run through the same calls in the parity
tests (test_parity.py, test_tp_pp.py, test_sharding.py), which compare with one process.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

from allhands.config import apply_override
from allhands.job import build_reference_model, lm_loss
from allhands.mesh import Mesh
from allhands.optim import build_optimizer
from allhands.parallel.layout import Precision, build_layout, choose_precision, replica_dim
from allhands.sync import AllReduceSync

from conftest import ROOT, tiny_config


def test_replica_dim_is_dp_when_replicated_and_dp_replicate_when_sharded():
    assert [replica_dim(z) for z in (0, 1, 2, 3)] == ["dp", "dp", "dp_replicate", "dp_replicate"]


@pytest.mark.parametrize("precision,device,zero,reduce,expected", [
    ("fp32", "cuda", 3, "fp32", Precision()),
    ("auto", "cpu", 2, "fp32", Precision()),
    # replicated layouts (DDP has no mixed-precision policy): autocast over fp32 parameters
    ("bf16", "cpu", 0, "fp32", Precision(autocast=True)),
    ("auto", "cuda", 1, "bf16", Precision(autocast=True)),
    # FSDP: its MixedPrecisionPolicy, gradients reduced in parallel.reduce_dtype; no autocast
    ("auto", "cuda", 2, "fp32", Precision(torch.bfloat16, torch.float32)),
    ("bf16", "cpu", 3, "bf16", Precision(torch.bfloat16, torch.bfloat16)),
])
def test_bf16_is_fsdp_policy_under_sharding_and_autocast_otherwise(precision, device, zero, reduce,
                                                                   expected):
    assert choose_precision(precision, device, zero, reduce) == expected


def test_the_loop_does_not_branch_on_the_layout():
    """trainer.py names no pipeline, pp degree or ZeRO stage: parallel/layout.py decides them."""
    text = (ROOT / "src" / "allhands" / "trainer.py").read_text()
    found = re.findall(r"\bpipeline\b|\bpp\b|\.zero\b|\bzero\s*(?:[<>=!]=?|\))", text)
    assert not found, f"trainer.py branches on the layout: {found}"


@pytest.fixture
def one_rank():
    assert not dist.is_initialized()
    mesh = Mesh.build(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo",
                      dp_replicate=1, timeout_s=30)
    yield mesh
    mesh.destroy()


@pytest.mark.parametrize("zero", [0, 1])
def test_one_rank_layout_steps_like_a_plain_module(one_rank, token_dir, tmp_path, zero):
    """A world of one: the layout's step (scaled loss, the on_loss hook, clip, AdamW, ZeRO-1 over
    one rank) leaves exactly the parameters a hand-written step leaves, and the checkpoint gets
    ZeRO-1's local optimizer, not the wrapper."""
    cfg = tiny_config(token_dir, tmp_path / "run", f"parallel.zero={zero}", "optim.grad_clip=0.05",
                      "parallel.dp_replicate=1")
    torch.manual_seed(0)
    model = build_reference_model(cfg, 96)
    ref = copy.deepcopy(model)
    layout = build_layout(cfg, one_rank, model, AllReduceSync(), lm_loss)
    assert layout.reports_loss and layout.replica_dim == "dp" and layout.parts == [model]
    x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)

    loss = layout.forward_backward(x, y, 0.5, on_loss=lambda l: l * 2)  # 2 * 0.5: the batch mean
    layout.after_backward()
    norm = layout.clip(cfg.optim.grad_clip)
    layout.optimizer.step()

    ref_opt = build_optimizer(ref, cfg)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optim.grad_clip)
    ref_opt.step()
    assert torch.equal(loss, ref_loss.detach()) and torch.equal(norm, ref_norm)
    assert float(norm) > cfg.optim.grad_clip  # the clip did act
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    _, optim, aliases = layout.checkpoint_parts()
    assert aliases is None and type(optim) is torch.optim.AdamW
    assert (optim is layout.optimizer) == (zero == 0)
    held = layout.state_bytes()
    n = sum(p.numel() for p in ref.parameters())
    assert held["params"] == held["grads"] == 4 * n and held["optim"] >= 8 * n


def test_bf16_on_a_replicated_layout_runs_under_autocast(one_rank, token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.precision=bf16", "parallel.dp_replicate=1")
    layout = build_layout(cfg, one_rank, build_reference_model(cfg, 96), AllReduceSync(), lm_loss)
    with layout.autocast():
        assert torch.is_autocast_enabled("cpu")
    apply_override(cfg, "run.precision=fp32")
    plain = build_layout(cfg, one_rank, build_reference_model(cfg, 96), AllReduceSync(), lm_loss)
    with plain.autocast():
        assert not torch.is_autocast_enabled("cpu")

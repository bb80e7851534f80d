"""The core invariant of data parallelism: N workers on the same global batches end with the
same parameters as one process training on whole global batches (fp32, rel. diff <= 1e-5)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from allhands.checkpoint import committed, load_weights
from allhands.data import GlobalSampler, load_training_data
from allhands.data.sampler import collate
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.job import build_reference_model, lm_loss
from allhands.models.moe import update_expert_bias
from allhands.optim import build_optimizer, lr_lambda

from conftest import tiny_config


def reference_params(cfg, shares: int = 1) -> dict[str, torch.Tensor]:
    """Plain single-process torch: one forward/backward over each whole global batch, or over
    each of its ``shares`` equal slices with each loss weighted 1/shares (replica mode's rule)."""
    train, _, vocab = load_training_data(cfg)  # data.path or data.mix
    torch.manual_seed(cfg.run.seed)
    model = build_reference_model(cfg, vocab)
    if cfg.checkpoint.init_from:  # as the trainer does, before training
        load_weights(model, cfg.checkpoint.init_from)
    opt = build_optimizer(model, cfg)
    # moe.balance=bias: DeepSeek-V3's bias step after each update, on this whole batch's loads
    # (parallel/layout.py registers it so; a model without such layers is left alone)
    opt.register_step_post_hook(lambda *_: update_expert_bias(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    sampler = GlobalSampler(len(train), cfg.run.global_batch, cfg.data.seed)
    for step in range(cfg.run.steps):
        for share in range(shares):
            x, y = collate(train, sampler.local_micro_batches(step, share, shares, 1)[0])
            (lm_loss(model(x), y) * (1.0 / shares)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained_params(cfg) -> dict[str, torch.Tensor]:
    _, path = committed(Path(cfg.run.dir) / "checkpoints")[-1]
    model = build_reference_model(cfg, load_training_data(cfg)[2])
    return load_weights(model, path).state_dict()


def max_rel_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def assert_resume_bit_exact(cfg, nproc: int, tmp_path: Path, drop_step: int, label: str):
    """Train ``cfg`` on ``nproc`` workers; resume a copy of its run directory without the
    checkpoint of ``drop_step``; the resumed run's final parameters must equal the uninterrupted
    run's bit for bit. Returns the finished config and the uninterrupted parameters."""
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    full = Path(done.run.dir)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step-{drop_step:08d}")
    train_job(cfg, LaunchSpec(nproc=nproc), resume=str(cut))
    a = trained_params(done)
    done.run.dir = str(cut)
    b = trained_params(done)
    done.run.dir = str(full)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after {label}"
    assert [s for s, _ in committed(cut / "checkpoints")][-1] == cfg.run.steps
    return done, a


def assert_matches_reference(done, label: str, tol: float = 1e-5) -> dict[str, torch.Tensor]:
    """The trained parameters of the finished job ``done`` (its last checkpoint, resharded into
    one plain module) equal the single-process reference's within ``tol`` (relative), and the
    model really moved: parity is not two copies of the initialisation. Returns them."""
    ref = reference_params(done)
    got = trained_params(done)
    assert set(got) == set(ref)
    diff = max_rel_diff(got, ref)
    assert diff <= tol, f"{label}: relative difference {diff:.2e}"
    torch.manual_seed(done.run.seed)
    init = build_reference_model(done, 257).state_dict()
    assert max_rel_diff(got, init) > 1e-3, f"{label}: the model did not train"
    return got


@pytest.mark.parametrize("nproc,micro", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_data_parallel_matches_single_process(token_dir, tmp_path, nproc, micro):
    cfg = tiny_config(token_dir, tmp_path / "run", f"run.micro_batches={micro}", "run.check_sync=true")
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    assert_matches_reference(done, f"{nproc} workers x {micro} micro-batches")

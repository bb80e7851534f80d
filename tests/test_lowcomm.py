"""Communicating less: DiLoCo and local SGD against an in-process simulation of their
replicas, the algebraic special case DiLoCo(H=1, SGD inside, outer SGD lr 1) == synchronous SGD,
compressed all-reduce against uncompressed, and the bytes the meters count against the analytic
volume of each strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from allhands.config import validate
from allhands.data import GlobalSampler, load_token_splits
from allhands.data.sampler import collate
from allhands.errors import ConfigError
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.job import build_reference_model, lm_loss
from allhands.optim import build_optimizer, lr_lambda

from conftest import tiny_config
from test_parity import assert_resume_bit_exact, max_rel_diff, reference_params, trained_params


def n_params(cfg) -> int:
    _, _, meta = load_token_splits(cfg.data.path, cfg.model.seq_len)
    torch.manual_seed(cfg.run.seed)
    return sum(p.numel() for p in build_reference_model(cfg, meta["vocab_size"]).parameters())


def step_records(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def simulate_rounds(cfg, n: int) -> dict[str, torch.Tensor]:
    """N replicas in one process, each with its own inner optimizer on its own slice of every
    global batch; every H steps the pseudo-gradients are averaged and applied to the anchor by
    the outer optimizer (or the replicas are averaged, for local SGD). Written from the papers'
    pseudo-code, not from sync/diloco.py."""
    s = cfg.sync
    train, _, meta = load_token_splits(cfg.data.path, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.global_batch, cfg.data.seed)
    replicas = []
    for _ in range(n):
        torch.manual_seed(cfg.run.seed)
        m = build_reference_model(cfg, meta["vocab_size"])
        opt = build_optimizer(m, cfg)
        replicas.append((m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))))
    anchor = [p.detach().clone() for p in replicas[0][0].parameters()]
    outer = torch.optim.SGD(anchor, lr=s.outer_lr, momentum=s.outer_momentum,
                            nesterov=s.outer_nesterov and s.outer_momentum > 0)
    for step in range(cfg.run.steps):
        for r, (m, _, _) in enumerate(replicas):
            idx = sampler.local_micro_batches(step, r, n, 1)[0]
            x, y = collate(train, idx)
            lm_loss(m(x), y).backward()
        if step < s.sync_warmup_steps:  # synchronous: every replica steps on the mean gradient
            for ps in zip(*(m.parameters() for m, _, _ in replicas)):
                mean = sum(p.grad for p in ps) / n
                for p in ps:
                    p.grad = mean.clone()
        for m, opt, sched in replicas:
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.optim.grad_clip or float("inf"))
            opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        if step + 1 == s.sync_warmup_steps:
            with torch.no_grad():
                for a, p in zip(anchor, replicas[0][0].parameters()):
                    a.copy_(p)
        elif step + 1 > s.sync_warmup_steps and ((step + 1) % s.inner_steps == 0
                                                 or step + 1 == cfg.run.steps):
            with torch.no_grad():
                locals_ = [list(m.parameters()) for m, _, _ in replicas]
                for i, a in enumerate(anchor):
                    delta = sum(a - ps[i] for ps in locals_) / n
                    if cfg.parallel.sync == "local_sgd":
                        a.sub_(delta)
                    else:
                        a.grad = delta
                if cfg.parallel.sync == "diloco":
                    outer.step()
                for ps in locals_:
                    for p, a in zip(ps, anchor):
                        p.copy_(a)
    names = [k for k, _ in replicas[0][0].named_parameters()]
    return dict(zip(names, (a.detach() for a in anchor)))


@pytest.mark.parametrize("mode,warmup", [("diloco", 0), ("local_sgd", 0), ("diloco", 2)])
def test_rounds_match_simulated_replicas(token_dir, tmp_path, mode, warmup):
    # AdamW inside, rounds of H=2 plus a short last round (steps=5), after `warmup` synchronous
    # steps; check_sync verifies that after every sync all replicas hold identical parameters
    # (and only then: in between they differ by construction). bytes: one full payload per
    # round, i.e. 1/H per step; one per step during the warm-up.
    cfg = tiny_config(token_dir, tmp_path / "run", f"parallel.sync={mode}", "sync.inner_steps=2",
                      "run.steps=5", "run.check_sync=true", "log.interval=2",
                      f"sync.sync_warmup_steps={warmup}")
    done = train_job(cfg, LaunchSpec(nproc=2))
    ref = simulate_rounds(done, 2)
    got = trained_params(done)
    diff = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"{mode}: relative difference to the simulated replicas {diff:.2e}"
    torch.manual_seed(done.run.seed)
    assert max_rel_diff(got, build_reference_model(done, 257).state_dict()) > 1e-3
    # The replicas really trained apart between syncs: a synchronous run ends elsewhere.
    assert max_rel_diff(got, reference_params(done)) > 1e-4

    size = 4 * n_params(done)  # fp32 pseudo-gradient, one all-reduce per round
    recs = {r["step"]: r for r in step_records(done.run.dir)}
    assert recs[2]["comm_bytes"] == pytest.approx(size if warmup else size / 2)  # 1 round / H steps
    assert recs[4]["comm_bytes"] == pytest.approx(size / 2)
    assert recs[5]["comm_bytes"] == pytest.approx(size)      # the last step always syncs
    assert recs[4]["comm_wire_bytes"] == pytest.approx(size / 2 * 2 * (2 - 1) / 2)


@pytest.mark.parametrize("nproc,layout", [
    (3, []),
    # DDP inside each of 2 replicas (dp_shard=2), the outer sync across them over dp_replicate
    (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
])
def test_diloco_h1_with_sgd_inside_is_synchronous_sgd(token_dir, tmp_path, nproc, layout):
    # Delta_r = lr g_r, anchor - 1 x mean(Delta_r) = theta - lr mean(g_r): one synchronous SGD
    # step, exactly, when nothing non-linear acts per replica (no clipping; SGD is linear).
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=diloco", "sync.inner_steps=1",
                      "sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.outer_nesterov=false",
                      "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0", "run.check_sync=true",
                      *layout)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    ref = reference_params(done)  # plain single-process SGD on whole global batches
    got = trained_params(done)
    diff = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"DiLoCo(H=1, SGD) vs synchronous SGD: relative difference {diff:.2e}"
    torch.manual_seed(done.run.seed)
    assert max_rel_diff(got, build_reference_model(done, 257).state_dict()) > 1e-3


def update_error(got: dict, ref: dict, init: dict) -> float:
    """||got - ref|| / ||ref - init|| over all parameters: how far a compressed run lands from
    the uncompressed one, as a fraction of how far training moved the model."""
    num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float((ref[k] - init[k]).pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


# Stated tolerances after 6 steps (2 of them plain warm-up for PowerSGD), as update_error
# against the uncompressed single-process reference. Adam normalises each coordinate, so a
# compression error on a near-zero gradient becomes an lr-sized step: the errors are far above
# the gradients' own relative rounding (bf16: 2^-8) but stay a small part of the update.
COMPRESSION_TOL = {"none": 1e-4, "bf16": 0.03, "powersgd": 0.2}


@pytest.mark.parametrize("compress", ["none", "bf16", "powersgd"])
def test_compressed_allreduce_stays_close(token_dir, tmp_path, compress):
    cfg = tiny_config(token_dir, tmp_path / "run", f"sync.compress={compress}", "run.steps=6",
                      "sync.powersgd_start_step=2", "sync.powersgd_rank=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    ref = reference_params(done)
    got = trained_params(done)
    torch.manual_seed(done.run.seed)
    init = build_reference_model(done, 257).state_dict()
    err = update_error(got, ref, init)
    print(f"{compress}: update error {err:.3e}")
    assert err <= COMPRESSION_TOL[compress], f"{compress}: update error {err:.2e}"

    # Bytes: every step all-reduces each fp32 gradient once (DDP buckets hold them all), in
    # half precision for bf16; PowerSGD sends P (n x r) and Q (m x r) for each matrix it
    # compresses and the rest as is, after the plain warm-up steps.
    size = 4 * n_params(done)
    recs = step_records(done.run.dir)
    if compress == "none":
        assert all(r["comm_bytes"] == size for r in recs)
        assert all(r["comm_wire_bytes"] == pytest.approx(size * 2 * (2 - 1) / 2) for r in recs)
    elif compress == "bf16":
        assert all(r["comm_bytes"] == size // 2 for r in recs)
    else:
        assert [r["comm_bytes"] for r in recs[:2]] == [size, size]
        torch.manual_seed(done.run.seed)
        model = build_reference_model(done, 257)
        expect = 0
        for p in model.parameters():
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            r = min(rows, cols, 2)
            compressed = p.dim() > 1 and (rows + cols) * r * 2 < rows * cols  # min rate 2
            expect += 4 * ((rows + cols) * r if compressed else p.numel())
        assert all(r["comm_bytes"] == expect for r in recs[2:]), (expect, recs[2]["comm_bytes"])
        assert expect < size / 2
    for r in recs:
        assert 0 <= r["comm_exposed"] <= r["comm_time"] + 1e-9
        assert 0 <= r["comm_exposed_frac"] <= 1.0


def test_lowcomm_config_errors(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "r", "parallel.sync=diloco", "sync.inner_steps=3",
                      "checkpoint.interval=4")
    with pytest.raises(ConfigError, match=r"^checkpoint.interval: .*multiple of sync.inner_steps=3"):
        validate(cfg)
    cfg = tiny_config(token_dir, tmp_path / "r", "parallel.sync=diloco", "sync.compress=bf16")
    with pytest.raises(ConfigError, match=r"^sync.compress: .*outer_compress"):
        validate(cfg)
    cfg = tiny_config(token_dir, tmp_path / "r", "sync.outer_compress=int4")
    with pytest.raises(ConfigError, match=r"^sync.outer_compress: 'int4' is not allowed"):
        validate(cfg)


def test_diloco_resume_is_exact(token_dir, tmp_path):
    # Stopped after the first round and resumed: the anchor, the outer momentum and each
    # replica's own inner AdamW moments come back, so the second round matches bit for bit.
    cfg = tiny_config(token_dir, tmp_path / "full", "parallel.sync=diloco", "sync.inner_steps=2",
                      "run.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=5")
    assert_resume_bit_exact(cfg, 2, tmp_path, drop_step=4, label="resume")


def test_auto_rule():
    from allhands.sync.auto import decide

    # 2.5M parameters, 2 replicas: 10 MB per rank per step. At 100 Mbit/s (12.5 MB/s) that is
    # 0.8 s > 50 ms: DiLoCo. At 100 Gbit/s, 0.8 ms: all-reduce.
    name, line = decide(2_500_000, 2, 12.5e6, 0.05)
    assert name == "diloco" and "800.0 ms" in line and "100 Mbit/s" in line
    assert decide(2_500_000, 2, 12.5e9, 0.05)[0] == "allreduce"
    assert decide(2_500_000, 1, 1.0, 0.05)[0] == "allreduce"

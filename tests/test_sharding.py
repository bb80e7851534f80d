"""Sharded layouts train the same model as one process: ZeRO-1 (ZeroRedundancyOptimizer over
DDP), ZeRO-2/3 (FSDP2) and hybrid sharding (HSDP), each against the single-process reference on
the same global batches; and their checkpoints load under other layouts and world sizes."""

from __future__ import annotations

import pytest
import torch

from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference, max_rel_diff, reference_params, trained_params

# Tolerance: 1e-5 (the issue allows 1e-4), measured 5e-7 to 9e-7 after 4 steps. Not tighter,
# and not bit-exact like resume, because sharded layouts sum the same gradients in another order
# (reduce-scatter over flat shards, a second all-reduce across replicas under HSDP, the gradient
# norm as a sum of per-shard partial norms): fp32 rounding differs at ~1e-7 per step, and Adam's
# division by sqrt(v) amplifies it in near-zero gradient entries. A real sharding bug (a wrong
# shard, a missing reduction, a mis-scaled clip) shows up at 1e-2 or more.
TOL = 1e-5

# Activation checkpointing rides along: recomputing a block must not change its gradients.
LAYOUTS = {
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero=1"]),
    "zero2+selective_ac": (2, ["parallel.dp_shard=2", "parallel.zero=2", "parallel.ac=selective"]),
    "zero3+micro": (2, ["parallel.dp_shard=2", "parallel.zero=3", "run.micro_batches=2"]),
    "hybrid+block_ac": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3",
                            "parallel.ac=block"]),
}


# The start-up line names the collective that really reconciles gradients in each layout.
SYNC_LINES = {
    "zero1": "sync: allreduce: DDP all-reduce every step (ZeRO-1: optimizer state sharded)",
    "zero2+selective_ac": "sync: allreduce: FSDP reduce-scatter every step (ZeRO-2)",
    "zero3+micro": "sync: allreduce: FSDP reduce-scatter every step (ZeRO-3)",
    "hybrid+block_ac": "sync: allreduce: FSDP reduce-scatter + all-reduce across dp_replicate (HSDP) "
                       "every step (ZeRO-3)",
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_layout_matches_single_process(token_dir, tmp_path, layout, capfd):
    nproc, extra = LAYOUTS[layout]
    cfg = tiny_config(token_dir, tmp_path / "run", "run.check_sync=true", *extra)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    assert f"allhands: {SYNC_LINES[layout]} (compression none)" in capfd.readouterr().err
    assert_matches_reference(done, layout, TOL)
    _check_memory_record(tmp_path / "run", done, nproc)


def _check_memory_record(run_dir, cfg, nproc):
    """The memory line of metrics.jsonl: one figure per rank, counted from the local shards,
    within 5% of the ZeRO formula (stage 2 at rest: FSDP2 has resharded, so stage 3's)."""
    import json

    from allhands.memory import expected_bytes

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mem = [x for x in lines if "memory_params_bytes" in x]
    assert len(mem) == 1 and len(mem[0]["memory_params_bytes"]) == nproc
    zero = cfg.parallel.zero
    psi = sum(p.numel() for p in reference_model(cfg).parameters())
    expected = expected_bytes(psi, 3 if zero == 2 else zero, 2)
    assert mem[0]["memory_expected_bytes"] == expected_bytes(psi, zero, 2)
    for rank in range(nproc):
        held = sum(mem[0][f"memory_{k}_bytes"][rank] for k in ("params", "grads", "optim"))
        assert 0.95 <= held / expected <= 1.05, (rank, held, expected)
    steps = [x for x in lines if "loss" in x]
    assert all(len(x["peak_mem_bytes_rank"]) == nproc and min(x["peak_mem_bytes_rank"]) > 0
               for x in steps)


def reference_model(cfg):
    from allhands.job import build_reference_model

    return build_reference_model(cfg, 257)


def _bf16_reference(cfg, ranks: int) -> dict[str, torch.Tensor]:
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) written out in one
    process: fp32 parameters and AdamW; each step, each of ``ranks`` slices of the global batch
    through a copy of the model whose parameters are cast to bf16 (a tied pair stays one
    tensor), its bf16 gradients cast to fp32 and averaged in fp32; clip and update in fp32.
    One thread, as the job's workers (run.threads=1): a bf16 GEMM's rounding depends on how
    its sums are split."""
    import copy

    from allhands.data import GlobalSampler, load_training_data
    from allhands.data.sampler import collate
    from allhands.job import build_reference_model, lm_loss
    from allhands.optim import build_optimizer, lr_lambda

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, _, vocab = load_training_data(cfg)
        torch.manual_seed(cfg.run.seed)
        model = build_reference_model(cfg, vocab)
        opt = build_optimizer(model, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        sampler = GlobalSampler(len(train), cfg.run.global_batch, cfg.data.seed)
        for step in range(cfg.run.steps):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for rank in range(ranks):
                low = copy.deepcopy(model)
                for p in low.parameters():
                    p.data = p.data.to(torch.bfloat16)
                x, y = collate(train, sampler.local_micro_batches(step, rank, ranks, 1)[0])
                lm_loss(low(x), y).backward()
                for g, p in zip(grads, low.parameters()):
                    assert p.grad.dtype == torch.bfloat16
                    g += p.grad.float() / ranks
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def test_bf16_mixed_precision_under_zero3_trains(token_dir, tmp_path):
    """FSDP2's MixedPrecisionPolicy on CPU: bf16 compute, fp32 shards, reduction and checkpoint.
    The trained parameters are the bf16 reference's (_bf16_reference: measured 5e-6 after 3
    steps) and far from the fp32 reference's (measured 4e-2, where fp32 layouts stay under
    1e-5); an fp32 run misses the bf16 reference by 4e-2, bf16 gradients reduced in bf16 by
    2e-3."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.dp_shard=2", "parallel.zero=3",
                      "run.precision=bf16", "run.steps=3", "data.eval_batches=1", "run.threads=1")
    done = train_job(cfg, LaunchSpec(nproc=2))
    losses = _eval_losses(tmp_path / "run")
    params = trained_params(done)
    assert all(v.dtype == torch.float32 for v in params.values())
    diff = max_rel_diff(params, _bf16_reference(done, 2))
    assert diff <= 1e-4, f"bf16 reference: relative difference {diff:.2e}"
    diff = max_rel_diff(params, reference_params(done))
    assert diff >= 1e-3, f"fp32 reference: relative difference only {diff:.2e}"
    assert losses[-1] < losses[0]


def _eval_losses(run_dir) -> list[float]:
    import json

    return [json.loads(line)["eval_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"eval_loss"' in line]


def test_checkpoint_loads_under_other_layouts_and_world_sizes(token_dir, tmp_path):
    """Saved under ZeRO-3 on 2 ranks at step 3; the reference continues that layout to step 5.
    Copies continue on 1 process (world size 1) and under ZeRO-1 on 2 ranks; ZeRO-1's step-4
    checkpoint continues under ZeRO-2. DCP reshards the parameters and the Adam moments each
    time, so every leg reaches the reference's parameters and eval loss at step 5, as far as
    fp32 sums allow. (Every leg keeps run.steps=5: the schedule depends on it.)"""
    import json
    import shutil

    from allhands.checkpoint import load_weights
    from allhands.job import build_reference_model

    zero = {k: ["parallel.dp_shard=2", f"parallel.zero={k}"] for k in (1, 2, 3)}
    common = ["run.steps=5", "checkpoint.interval=1", "checkpoint.keep_last=5", "run.eval_interval=1"]
    saved = tmp_path / "saved"
    train_job(tiny_config(token_dir, saved, *zero[3], *common), LaunchSpec(nproc=2))
    for step in (4, 5):  # "stopped" after step 3
        shutil.rmtree(saved / "checkpoints" / f"step-{step:08d}")

    def resume(src, name, nproc, layout, drop=()):
        run = tmp_path / name
        shutil.copytree(src, run)
        for step in drop:
            shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
        done = train_job(tiny_config(token_dir, run, *layout, *common), LaunchSpec(nproc=nproc),
                         resume=str(run))
        evals = {json.loads(line)["step"]: json.loads(line)["eval_loss"]
                 for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval_loss"' in line}
        params = load_weights(build_reference_model(done, 257),
                              run / "checkpoints" / "step-00000005").state_dict()
        return run, params, evals[5]

    _, ref_params, ref_eval = resume(saved, "ref", 2, zero[3])
    _, single_params, single_eval = resume(saved, "single", 1, [])
    z1, z1_params, z1_eval = resume(saved, "zero1", 2, zero[1])
    _, z2_params, z2_eval = resume(z1, "zero1-then-zero2", 2, zero[2], drop=(5,))
    for name, params, ev in [("1 process", single_params, single_eval),
                             ("zero1 on 2", z1_params, z1_eval),
                             ("zero1 -> zero2 on 2", z2_params, z2_eval)]:
        diff = max_rel_diff(params, ref_params)
        assert diff <= TOL, f"{name}: parameters at step 5 differ by {diff:.2e}"
        assert abs(ev - ref_eval) <= 1e-5 * ref_eval, f"{name}: eval loss {ev} vs {ref_eval}"


def test_export_then_import_round_trips_exactly(token_dir, tmp_path, cli_env):
    import subprocess

    from safetensors.torch import load_file

    from allhands.checkpoint.export import load_weights
    from allhands.job import build_reference_model
    from conftest import ALLHANDS

    src = tmp_path / "src"
    done = train_job(tiny_config(token_dir, src, "parallel.dp_shard=2", "parallel.zero=3",
                                 "run.steps=2"), LaunchSpec(nproc=2))
    out = tmp_path / "model.safetensors"
    r = subprocess.run([*ALLHANDS, "export", str(src), "--out", str(out)], capture_output=True,
                       text=True, env=cli_env, timeout=120)
    assert r.returncode == 0, r.stderr
    exported = load_file(str(out))
    trained = trained_params(done)
    assert set(exported) == set(trained)
    for k in trained:
        assert torch.equal(exported[k], trained[k]), f"{k} changed in export"
    model = load_weights(build_reference_model(done, 257), out)
    for k, v in model.state_dict().items():
        assert torch.equal(v, exported[k]), f"{k} changed in import"

    # A new run started from the file, under another layout, evaluates the same model first.
    dst = tmp_path / "dst"
    train_job(tiny_config(token_dir, dst, f"checkpoint.init_from={out}", "run.steps=1"),
              LaunchSpec(nproc=2))
    assert abs(_eval_losses(dst)[0] - _eval_losses(src)[-1]) <= 1e-6

    bad = subprocess.run([*ALLHANDS, "export", str(tmp_path / "nothing"), "--out", str(out)],
                         capture_output=True, text=True, env=cli_env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "export:" in bad.stderr

"""Expert parallelism (parallel/expert.py) on gloo: ep=2 trains to the same parameters as one
process and as ep=1, with replicated (DDP) and sharded (FSDP2 ZeRO-2/3) dense parameters, under
activation checkpointing, with tensor parallelism and with pipeline stages; a checkpoint
written at one ep resumes at another."""

from __future__ import annotations

import json
import shutil

import pytest

from allhands.checkpoint import load_weights
from allhands.config import ConfigError, validate
from allhands.job import build_reference_model
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference, max_rel_diff

# SGD and no balancing loss: the update is linear in the gradient, and the objective of the
# data-parallel ranks is the mean of their losses (an auxiliary loss of products of per-rank
# means is not); routing itself is what is under test
MOE = ["model.family=llama", "model.n_kv_head=1", "model.ffn_hidden=48", "moe.n_experts=4",
       "moe.top_k=2", "moe.ffn_hidden=24", "moe.balance=none", "optim.name=sgd", "optim.lr=0.5",
       "optim.weight_decay=0.0"]


@pytest.mark.parametrize("label,nproc,layout", [
    ("ep2 ddp", 2, ["parallel.ep=2"]),
    ("ep2 fsdp zero3 + block ac", 2, ["parallel.ep=2", "parallel.dp_shard=2", "parallel.zero=3",
                                      "parallel.ac=block"]),
    ("ep1 ddp", 2, []),
    # tp: the MoE layer whole on every tp rank, its experts split by ep over the data ranks
    ("tp2", 2, ["parallel.tp=2", "model.n_kv_head=2"]),
    ("ep2 tp2 fsdp zero2", 4, ["parallel.ep=2", "parallel.tp=2", "model.n_kv_head=2",
                               "parallel.dp_shard=2", "parallel.zero=2"]),
    # pipeline stages: each stage's MoE layers exchange over their own stage's ep group
    ("ep2 pp2", 4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2"]),
])
def test_expert_parallel_matches_single_process(token_dir, tmp_path, label, nproc, layout):
    cfg = tiny_config(token_dir, tmp_path / "run", *MOE, *layout)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    got = assert_matches_reference(done, label)
    assert any("experts" in k for k in got)


def _written_at_ep(ckpt) -> int:
    """The parallel.ep of the job that wrote checkpoint ``ckpt`` (its allhands.json)."""
    return json.loads((ckpt / "allhands.json").read_text())["config"]["parallel"]["ep"]


def test_resume_across_ep_sizes(token_dir, tmp_path):
    """ep=2's step-2 checkpoint resumed at ep=1 (DDP and FSDP ZeRO-2), and a checkpoint that the
    ep=1 run wrote resumed at ep=2: each reaches the uninterrupted ep=2 run's step-4 parameters."""
    common = [*MOE, "run.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=5"]
    full = train_job(tiny_config(token_dir, tmp_path / "ep2", *common, "parallel.ep=2"),
                     LaunchSpec(nproc=2))
    want = load_weights(build_reference_model(full, 257),
                        tmp_path / "ep2" / "checkpoints" / "step-00000004").state_dict()
    # ep=2 -> ep=1; the DDP leg saves every step, so that its step 3 is written at ep=1
    for name, layout in (("to-ep1", ["checkpoint.interval=1"]),
                         ("to-ep1-fsdp", ["parallel.dp_shard=2", "parallel.zero=2"])):
        run = tmp_path / name
        shutil.copytree(tmp_path / "ep2", run)
        shutil.rmtree(run / "checkpoints" / "step-00000004")
        assert _written_at_ep(run / "checkpoints" / "step-00000002") == 2
        train_job(tiny_config(token_dir, run, *common, *layout), LaunchSpec(nproc=2), resume=str(run))
        got = load_weights(build_reference_model(full, 257),
                           run / "checkpoints" / "step-00000004").state_dict()
        assert max_rel_diff(got, want) <= 1e-5, name
    # and back: ep=1's step-3 checkpoint (written by the to-ep1 run) resumed at ep=2
    run = tmp_path / "back-to-ep2"
    shutil.copytree(tmp_path / "to-ep1", run)
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    assert _written_at_ep(run / "checkpoints" / "step-00000003") == 1
    train_job(tiny_config(token_dir, run, *common, "parallel.ep=2"), LaunchSpec(nproc=2),
              resume=str(run))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-3:] == [3, 4, 4]  # to-ep1's 3, 4; then 4 at ep=2
    assert _written_at_ep(run / "checkpoints" / "step-00000004") == 2
    got = load_weights(build_reference_model(full, 257),
                       run / "checkpoints" / "step-00000004").state_dict()
    assert max_rel_diff(got, want) <= 1e-5


def test_ep_layout_errors_name_the_field(token_dir, tmp_path):
    for extra, msg in ((["moe.n_experts=3"], "must divide moe.n_experts"),
                       (["parallel.tp=2", "model.n_kv_head=2"], "the 1 data-parallel ranks"),
                       (["parallel.dp_shard=2", "parallel.zero=1"], "zero=1")):
        cfg = tiny_config(token_dir, tmp_path / "x", *MOE, "parallel.ep=2", *extra)
        with pytest.raises(ConfigError, match=f"parallel.ep.*{msg}"):
            validate(cfg, world_size=2)
    cfg = tiny_config(token_dir, tmp_path / "x", *MOE, "parallel.ep=4")
    with pytest.raises(ConfigError, match="parallel.ep"):
        validate(cfg, world_size=2)


def test_metrics_record_expert_load_balancing_loss_and_all_to_all(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", *MOE, "parallel.ep=2", "moe.balance=aux",
                      "run.steps=2", "run.global_batch=4")
    done = train_job(cfg, LaunchSpec(nproc=2))
    rec = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
           if '"moe_load"' in line]
    assert len(rec) == 2
    r = rec[-1]
    # every (token, expert) pair counted once: 4 samples x 16 tokens x top-2, per layer
    assert [sum(row) for row in r["moe_load"]] == [4 * 16 * 2] * done.model.n_layer
    assert r["moe_tokens_per_expert_min"] <= 32 <= r["moe_tokens_per_expert_max"]
    assert r["moe_aux_loss"] > 0 and r["moe_a2a_bytes"] > 0 and r["moe_a2a_time"] > 0
    # routing cannot run on meta tensors: the FLOPs (and MFU) come from the shapes, active experts only
    from allhands.plan.decoder import flops_per_sample

    assert r["flops_per_step"] == flops_per_sample(done.model, done.moe, 257) * 4
    # the report draws the expert load; a run without MoE layers gets no such plot
    from allhands.report import make_report

    assert tmp_path / "run" / "report" / "experts.png" in make_report(tmp_path / "run")

"""Tensor and pipeline parallelism train the same model as one process, compose with sharded
data parallelism, load each other's checkpoints, and refuse impossible layouts before start.

Parity tolerance: 1e-5 relative (the issue allows 1e-4); measured 9e-7 (tp=2) to 3e-6
(pipelines, compositions) after 4 steps. Not bit-exact, because the layouts add the same numbers
in another order: TP sums a row-parallel matmul's partial products in a reduce-scatter, the
pipeline sums microbatch gradients one chunk at a time and divides by their count afterwards,
and the global gradient norm is a sum of per-shard/per-stage squares. Each differs from the
single process at fp32 rounding (~1e-7 per step), which Adam's division by sqrt(v) amplifies in
near-zero gradient entries. A real bug (a wrong shard, a missing reduction, an untied embedding,
a mis-scaled loss) shows up at 1e-3 or more.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from allhands.config import Config, ConfigError, apply_override, validate
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.models import GPT, GPTConfig
from allhands.parallel.pipeline import balanced_split, build_stage_module, stage_units, units
from allhands.parallel.tensor import resolve_plan

from conftest import ALLHANDS, ROOT, tiny_config
from test_parity import assert_matches_reference

TOL = 1e-5


# --------------------------------------------------------------------------- parity (processes)

LAYOUTS = {
    # tp=2 with sequence parallel, and gradient accumulation on top
    "tp2": (2, ["parallel.tp=2", "parallel.dp_replicate=1", "run.micro_batches=2"]),
    "pp2-gpipe": (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=gpipe"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=1f1b",
                     "parallel.pp_microbatches=3", "run.micro_batches=2"]),
    # two stages per rank: 4 stages over 2 ranks, so 4 layers
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=4",
                            "parallel.pp_schedule=interleaved1f1b"]),
    "dp_shard2xtp2": (4, ["parallel.tp=2", "parallel.dp_replicate=1", "parallel.dp_shard=2",
                          "parallel.zero=3"]),
    "pp2xdp_shard2": (4, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.dp_shard=2",
                          "parallel.zero=2"]),
    # replicated stages: composable replicate, since DDP fails under the schedule
    "pp2xdp_replicate2": (4, ["parallel.pp=2", "parallel.dp_replicate=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_pp_layout_matches_single_process(token_dir, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    cfg = tiny_config(token_dir, tmp_path / "run", "run.check_sync=true", *extra)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    got = assert_matches_reference(done, layout, TOL)
    # the tied embedding stayed tied (on separate stages under pp)
    assert torch.equal(got["tok_emb.weight"], got["lm_head.weight"])
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == done.run.steps and all(0 < v < 10 for v in losses)


def _eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_checkpoint_loads_across_tp_and_pp_layouts(token_dir, tmp_path):
    """Saved with dp_shard=2 (FSDP) on 2 ranks, resumed with tp=2, with pp=2 (interleaved: 2 stage
    modules per rank) and with pp=4 on 4 ranks: the eval loss right after loading is the one logged at the save. (Loading a tp or
    pp checkpoint into one plain module, a change of world size too, is what every parity test
    above does through trained_params.)"""
    src = tmp_path / "src"
    cfg = tiny_config(token_dir, src, "parallel.dp_replicate=1", "parallel.dp_shard=2",
                      "parallel.zero=3", "model.n_layer=4")
    train_job(cfg, LaunchSpec(nproc=2))
    saved = _eval_rows(src)[-1]
    assert saved["step"] == cfg.run.steps and "resumed" not in saved
    layouts = {
        "tp2": (2, ["parallel.tp=2", "parallel.tp_sequence_parallel=false"]),
        "pp2-interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved1f1b"]),
        # 4 ranks: the tied embedding/head pair meets in Mesh.pp_ends_group
        "pp4-gpipe": (4, ["parallel.pp=4", "parallel.pp_schedule=gpipe"]),
    }
    for name, (nproc, extra) in layouts.items():
        dst = tmp_path / name
        shutil.copytree(src, dst)
        cfg2 = tiny_config(token_dir, dst, "parallel.dp_replicate=1", "model.n_layer=4", *extra)
        train_job(cfg2, LaunchSpec(nproc=nproc), resume=str(dst))
        after = _eval_rows(dst)[-1]
        assert after.get("resumed") and after["step"] == saved["step"], name
        rel = abs(after["eval_loss"] - saved["eval_loss"]) / saved["eval_loss"]
        # fp32 eval of the same weights in another summation order (sharded matmuls, microbatches)
        assert rel <= 1e-5, f"{name}: eval loss {after['eval_loss']} after load vs {saved['eval_loss']}"


# --------------------------------------------------------------------------- splitting (no processes)


def test_stages_partition_the_model_under_its_own_names():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=8, n_layer=5, n_head=2, n_embd=16))
    full = model.state_dict()
    for n_stages in (2, 3, 5):
        per_stage = stage_units(model, balanced_split(len(model.blocks), n_stages), n_stages)
        stages = [build_stage_module(model, keep) for keep in per_stage]
        keys = [set(s.state_dict()) for s in stages]
        assert set().union(*keys) == set(full)
        for i, ks in enumerate(keys):
            for k in ks:
                assert torch.equal(stages[i].state_dict()[k], full[k])
        # blocks are balanced: stage sizes differ by at most one block
        counts = [len(s.blocks) for s in stages]
        assert max(counts) - min(counts) <= 1 and sum(counts) == 5
        # chaining the stages computes the unsplit forward
        x = torch.randint(0, 50, (2, 8))
        h = x
        for s in stages:
            h = s(h)
        assert torch.allclose(h, model(x), atol=1e-6)


def test_user_model_splits_at_named_points_and_keeps_list_keys():
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(4, 8))
    model.add_module("layers", nn.ModuleList(nn.Linear(8, 8) for _ in range(3)))
    assert units(model) == ["inp", "layers.0", "layers.1", "layers.2"]
    per_stage = stage_units(model, ["layers.1"], 2)
    assert per_stage == [["inp", "layers.0"], ["layers.1", "layers.2"]]
    second = build_stage_module(model, per_stage[1])
    assert set(second.state_dict()) == {"layers.1.weight", "layers.1.bias", "layers.2.weight",
                                        "layers.2.bias"}
    # a plain nn.Sequential splits with no changes to the model: its stages chain to the whole
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    parts = [build_stage_module(seq, keep) for keep in stage_units(seq, ["2", "4"], 3)]
    assert [set(p.state_dict()) for p in parts] == [{"0.weight", "0.bias"}, {"2.weight", "2.bias"},
                                                    {"4.weight", "4.bias"}]
    x = torch.randn(3, 4)
    assert torch.allclose(parts[2](parts[1](parts[0](x))), seq(x))
    with pytest.raises(ValueError, match=r"parallel.pp_split: 'layers.7' is not a unit"):
        stage_units(model, ["layers.7"], 2)
    with pytest.raises(ValueError, match=r"parallel.pp_split: 3 pipeline stages need 2 split points"):
        stage_units(model, ["layers.1"], 3)
    with pytest.raises(ValueError, match=r"must be distinct, in model order"):
        stage_units(model, ["layers.2", "layers.1"], 3)


def test_a_model_without_a_tp_plan_is_told_how_to_give_one():
    with pytest.raises(ValueError, match=r"parallel.tp: the model Sequential has no tensor-parallel plan"):
        resolve_plan(nn.Sequential(nn.Linear(2, 2)), None, True)
    from torch.distributed.tensor.parallel import ColwiseParallel
    plan = {"0": ColwiseParallel()}
    assert resolve_plan(nn.Sequential(nn.Linear(2, 2)), plan, True) == plan
    assert resolve_plan(nn.Sequential(nn.Linear(2, 2)), lambda m, sp: plan, True) == plan


# --------------------------------------------------------------------------- invalid layouts


def _cfg(*items: str) -> Config:
    cfg = Config()
    for item in ("model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.seq_len=16",
                 "run.global_batch=12", *items):
        apply_override(cfg, item)
    return cfg


INVALID = [
    (4, ["parallel.tp=4"], r"^parallel.tp: 4 is larger than model.n_head=2; every tensor-parallel rank"),
    (4, ["parallel.tp=4", "model.n_head=6", "model.n_embd=48", "parallel.dp_replicate=1"],
     r"^parallel.tp: 4 does not divide model.n_head=6"),
    (2, ["parallel.tp=2", "parallel.dp_replicate=1", "model.seq_len=15"],
     r"^parallel.tp: 2 does not divide model.seq_len=15"),
    (4, ["parallel.tp=2"], r"^parallel.zero: 0 replicates over DDP, which cannot hold the tp-sharded"),
    (4, ["parallel.pp=4", "parallel.dp_replicate=1"],
     r"^parallel.pp: 4 pipeline stages need at least as many layers, but model.n_layer=2"),
    (2, ["parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=3", "parallel.pp_schedule=interleaved1f1b"],
     r"^parallel.pp: pp x stages per rank = 2 x 2 = 4 pipeline stages need at least as many layers"),
    (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=interleaved1f1b",
         "parallel.pp_stages_per_rank=1"], r"^parallel.pp_stages_per_rank: interleaved1f1b needs >= 2"),
    (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_stages_per_rank=2"],
     r"^parallel.pp_stages_per_rank: 1f1b runs one stage per rank"),
    (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_microbatches=5"],
     r"^parallel.pp_microbatches: 5 does not divide the per-rank batch of run.global_batch / "
     r"\(data-parallel ranks x run.micro_batches\) = 12 / \(1 x 1\) = 12"),
    (4, ["parallel.pp=4", "parallel.dp_replicate=1", "model.n_layer=4", "parallel.pp_microbatches=2",
         "model.tie_embeddings=false"], r"^parallel.pp_microbatches: 1f1b needs at least parallel.pp=4"),
    (4, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.dp_replicate=1", "parallel.zero=1"],
     r"^parallel.zero: 1 \(ZeroRedundancyOptimizer over DDP\) does not run under pipeline stages"),
    (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_split=blocks.1,blocks.2"],
     r"^parallel.pp_split: 2 stages need 1 comma-separated split points, got 2"),
    (1, ["parallel.pp_schedule=zb"], r"^parallel.pp_schedule: 'zb' is not allowed; allowed: gpipe, 1f1b"),
]


@pytest.mark.parametrize("world,items,message", INVALID, ids=[m[1:40] for _, _, m in INVALID])
def test_invalid_tp_pp_layout_fails_before_start(world, items, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*items), world_size=world, need_data=False)


def test_valid_layouts_pass():
    for world, items in [(2, ["parallel.tp=2", "parallel.dp_replicate=1"]),
                         (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3",
                              "parallel.dp_replicate=1"]),
                         (2, ["parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=4",
                              "parallel.pp_schedule=interleaved1f1b"]),
                         (4, ["parallel.pp=2", "parallel.dp_replicate=2"])]:
        validate(_cfg(*items), world_size=world, need_data=False)


def test_cli_refuses_tp_above_the_head_count_with_exit_2(tmp_path, cli_env):
    r = subprocess.run([*ALLHANDS, "train", "--nproc", "4", "--set", "parallel.tp=4", "--set",
                        "model.n_head=2", "--set", f"run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "parallel.tp: 4 is larger than model.n_head=2" in errors[0], r.stderr
    assert not (tmp_path / "run").exists()

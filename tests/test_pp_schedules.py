"""Every pipeline schedule torch ships trains the parameters one process trains, places its
stages as it needs, refuses the microbatch and stage counts it cannot run before start, and
resumes a checkpoint another schedule wrote (a chain of resumes through all of them).

Parity tolerance 1e-5 relative under SGD, as in test_tp_pp.py: the schedules add the same
microbatch gradients in other orders (the zero-bubble ones compute weight gradients later, in
the bubble), which differs from one process at fp32 rounding.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from allhands.config import PP_SCHEDULES, ConfigError, validate
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.parallel.pipeline import stage_ids_of

from conftest import tiny_config
from test_parity import assert_matches_reference, max_rel_diff, trained_params
from test_tp_pp import TOL, _cfg

# 4 layers: the multi-stage schedules cut 2 ranks x 2 stages
SGD = ["optim.name=sgd", "optim.lr=0.5", "parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=4"]
MICRO = {"dualpipev": 4}  # one microbatch per stage at least (2 x pp); the rest take the default


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_schedule_matches_single_process(token_dir, tmp_path, schedule):
    mb = MICRO.get(schedule, 2)
    cfg = tiny_config(token_dir, tmp_path / "run", "run.check_sync=true", *SGD,
                      f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={mb}")
    done = train_job(cfg, LaunchSpec(nproc=2))
    got = assert_matches_reference(done, schedule, TOL)
    assert torch.equal(got["tok_emb.weight"], got["lm_head.weight"])  # the tied pair stayed tied


def test_zero_bubble_composes_with_sharded_stages(token_dir, tmp_path):
    """ZB-V's split backward under FSDP (ZeRO-2) stages: torch's stage reduces the gradients once
    after the last weight gradient, so pp=2 x dp_shard=2 trains what one process trains."""
    cfg = tiny_config(token_dir, tmp_path / "run", *SGD, "parallel.dp_shard=2", "parallel.zero=2",
                      "parallel.pp_microbatches=2",
                      "parallel.pp_schedule=zbvzerobubble")
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=4)), "zbv x zero2", TOL)


def test_v_schedules_fold_the_stages_onto_the_ranks():
    # torch's generate_stage_to_rank_mapping(style="v"): rank r holds r and 2*pp-1-r
    assert [stage_ids_of(r, 4, 2, "zbvzerobubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids_of(r, 2, 2, "interleaved1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
    v = generate_stage_to_rank_mapping(4, 8, style="v")
    assert all(v[s] == r for r in range(4) for s in stage_ids_of(r, 4, 2, "dualpipev"))


# After an uninterrupted 1f1b run, each schedule continues the checkpoint of the one before it,
# one step each; 1f1b comes round again to read the last one's. So every schedule reads one that
# another wrote, and the single-stage, looped and V-shaped placements read each other.
CHAIN = ["1f1b", "zbvzerobubble", "gpipe", "interleaved1f1b", "dualpipev", "loopedbfs",
         "interleavedzerobubble", "1f1b"]


def test_resume_chain_through_every_schedule(token_dir, tmp_path):
    """The uninterrupted 1f1b run's step-1 checkpoint continued by each schedule of CHAIN in turn,
    one step each, each from the checkpoint the previous schedule wrote (AdamW, so the moments
    move too, the tied head's under its first name): the eval loss right after loading (the new
    schedule's forward) is the one at the save, and the end is the uninterrupted run's parameters.
    The learning rate is constant (no warmup, no decay), so that a leg's run.steps, one past its
    start, leaves the run's schedule alone."""
    assert sorted(set(CHAIN)) == sorted(PP_SCHEDULES)
    common = ["parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=4", "parallel.pp_microbatches=4",
              "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "checkpoint.interval=1",
              "checkpoint.keep_last=10", "run.eval_interval=1"]
    steps = len(CHAIN)
    full = train_job(tiny_config(token_dir, tmp_path / "full", *common, f"run.steps={steps}",
                                 f"parallel.pp_schedule={CHAIN[0]}"), LaunchSpec(nproc=2))
    run = tmp_path / "chain"
    shutil.copytree(tmp_path / "full", run)
    for step in range(2, steps + 1):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    for step in range(2, steps + 1):
        saved = json.loads((run / "checkpoints" / f"step-{step - 1:08d}" / "allhands.json").read_text())
        assert saved["config"]["parallel"]["pp_schedule"] == CHAIN[step - 2]
        done = train_job(tiny_config(token_dir, run, *common, f"run.steps={step}",
                                     f"parallel.pp_schedule={CHAIN[step - 1]}"),
                         LaunchSpec(nproc=2), resume=str(run))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][steps:] == list(range(2, steps + 1))
    for step in range(1, steps):
        # evaluated at the save, then right after the next leg loaded the checkpoint
        saved, loaded = [r["eval_loss"] for r in rows if "eval_loss" in r and r["step"] == step][-2:]
        assert abs(loaded - saved) <= 1e-5 * saved, \
            f"{CHAIN[step - 1]} -> {CHAIN[step]}: eval {loaded} vs {saved}"
    diff = max_rel_diff(trained_params(done), trained_params(full))
    assert diff <= TOL, f"{' -> '.join(CHAIN)}: relative difference {diff:.2e}"


INVALID = [
    (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=dualpipev", "parallel.pp_microbatches=2"],
     r"^parallel.pp_microbatches: dualpipev needs at least as many microbatches as stages \(2 x parallel.pp = 4\)"),
    (2, ["parallel.pp=2", "model.n_layer=6", "parallel.pp_schedule=zbvzerobubble", "parallel.pp_stages_per_rank=3"],
     r"^parallel.pp_stages_per_rank: zbvzerobubble runs exactly 2 stages per rank"),
    (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=loopedbfs", "parallel.pp_stages_per_rank=1"],
     r"^parallel.pp_stages_per_rank: loopedbfs needs >= 2 stages per rank"),
    (4, ["parallel.pp=4", "model.n_layer=8", "run.global_batch=36", "parallel.pp_schedule=interleavedzerobubble",
         "parallel.pp_microbatches=9"], r"^parallel.pp_microbatches: interleavedzerobubble runs rounds of pp=4"),
    (2, ["parallel.pp=2", "model.n_layer=3", "parallel.pp_schedule=dualpipev"],
     r"^parallel.pp: pp x stages per rank = 2 x 2 = 4 pipeline stages need at least as many layers"),
]


@pytest.mark.parametrize("world,items,message", INVALID, ids=[m[1:50] for _, _, m in INVALID])
def test_a_count_a_schedule_cannot_take_fails_before_start(world, items, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg("parallel.dp_replicate=1", *items), world_size=world, need_data=False)


def test_counts_torch_takes_pass():
    # counts torch 2.13's schedules take (mb < pp under the multi-stage ones): the config accepts
    # them. Only validated here; the pp=2 dualpipev one also trains in test_schedule_matches_...
    for world, items in [(4, ["parallel.pp=4", "model.n_layer=8", "parallel.pp_schedule=interleaved1f1b",
                              "parallel.pp_microbatches=2"]),
                         (4, ["parallel.pp=4", "model.n_layer=8", "parallel.pp_schedule=zbvzerobubble",
                              "parallel.pp_microbatches=3"]),
                         (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=dualpipev",
                              "parallel.pp_microbatches=4"]),
                         (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=loopedbfs",
                              "parallel.pp_microbatches=3"])]:
        validate(_cfg("parallel.dp_replicate=1", *items), world_size=world, need_data=False)

"""Every pipeline schedule torch ships trains the parameters one process trains, places its
stages as it needs, refuses the microbatch and stage counts it cannot run before start, and
reads the checkpoints of every other schedule.

Parity tolerance 1e-5 relative under SGD, as in test_tp_pp.py: the schedules add the same
microbatch gradients in other orders (the zero-bubble ones compute weight gradients later, in
the bubble), which differs from one process at fp32 rounding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_resume_across_schedules(token_dir, tmp_path):
    """A 1f1b run stopped after step 2 continues under zbvzerobubble, and a zbvzerobubble run
    under 1f1b (AdamW, so the moments move too, the tied head's under its first name): each
    reaches the parameters of the uninterrupted run of the other schedule."""
    common = ["parallel.pp=2", "parallel.dp_replicate=1", "model.n_layer=4", "parallel.pp_microbatches=2",
              "checkpoint.interval=2", "checkpoint.keep_last=3", "run.eval_interval=2"]
    full = {}
    for s in ("1f1b", "zbvzerobubble"):
        done = train_job(tiny_config(token_dir, tmp_path / s, *common, f"parallel.pp_schedule={s}"),
                         LaunchSpec(nproc=2))
        full[s] = trained_params(done)
    for src, dst in (("1f1b", "zbvzerobubble"), ("zbvzerobubble", "1f1b")):
        cut = tmp_path / f"{src}-then-{dst}"
        shutil.copytree(tmp_path / src, cut)
        shutil.rmtree(cut / "checkpoints" / "step-00000004")
        done = train_job(tiny_config(token_dir, cut, *common, f"parallel.pp_schedule={dst}"),
                         LaunchSpec(nproc=2), resume=str(cut))
        rows = [json.loads(x) for x in (Path(cut) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r][-2:] == [3, 4]
        # the eval loss right after loading (the other schedule's forward) is the one of the save
        saved, loaded = [r["eval_loss"] for r in rows if "eval_loss" in r and r["step"] == 2][-2:]
        assert abs(loaded - saved) <= 1e-5 * saved, f"{src} -> {dst}: eval {loaded} vs {saved}"
        diff = max_rel_diff(trained_params(done), full[dst])
        assert diff <= TOL, f"{src} -> {dst}: relative difference {diff:.2e}"


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
    # measured: these run in torch 2.13 and match one process (mb < pp under the multi-stage ones)
    for world, items in [(4, ["parallel.pp=4", "model.n_layer=8", "parallel.pp_schedule=interleaved1f1b",
                              "parallel.pp_microbatches=2"]),
                         (4, ["parallel.pp=4", "model.n_layer=8", "parallel.pp_schedule=zbvzerobubble",
                              "parallel.pp_microbatches=3"]),
                         (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=dualpipev",
                              "parallel.pp_microbatches=4"]),
                         (2, ["parallel.pp=2", "model.n_layer=4", "parallel.pp_schedule=loopedbfs",
                              "parallel.pp_microbatches=3"])]:
        validate(_cfg("parallel.dp_replicate=1", *items), world_size=world, need_data=False)

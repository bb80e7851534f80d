"""The planner: every layout of a large cluster is listed (feasible ones ranked, the rest with a
reason), and its per-rank training-state memory for small layouts matches what allhands measures
when it trains them on this machine (within 10%)."""

from __future__ import annotations

import json
import subprocess

import pytest

from allhands.config import Config, apply_override
from allhands.plan import Layout, estimate, parse_cluster, plan, stage_params
from allhands.plan.check import check
from allhands.plan.localtime import local_step

from conftest import ALLHANDS, TINY, tiny_config


def _config(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


def test_plan_scores_16384_accelerators_and_gives_reasons():
    cfg = _config("model.n_layer=32", "model.n_head=32", "model.n_embd=4096", "model.seq_len=4096",
                  "model.vocab_size=50304", "run.global_batch=16384", "run.precision=bf16")
    out = plan(cfg, parse_cluster("h100:2048"))
    ok = [e for e in out if e.feasible]
    assert ok and len(out) > len(ok)
    assert all(e.layout.world == 16384 for e in out)
    steps = [e.time["step"] for e in ok]
    assert steps == sorted(steps)  # ranked fastest first
    assert all(0 < e.mfu < 1 and e.memory["total"] <= 0.9 * 80e9 for e in ok)
    assert any(e.reason.startswith("needs") for e in out)  # some do not fit in memory


def test_more_memory_saving_layouts_predict_less_state():
    cfg = _config(*TINY, "model.vocab_size=257")
    c = parse_cluster("a100:1")
    state = [sum(estimate(cfg, Layout(1, 8, 1, 1, z), c, False).state_rank) for z in (1, 2, 3)]
    ddp = estimate(cfg, Layout(8, 1, 1, 1, 0), c, False).state_rank[0]
    assert ddp > state[0] > state[1] == state[2]  # ZeRO-2 at rest holds a parameter shard too (FSDP2)


def test_plan_memory_matches_measured_state(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "unused")
    cluster = parse_cluster("local", 2)
    # one layout per state formula that differs: a ZeRO-1 optimizer shard, ZeRO-3's everything
    # sharded, tp's sharded matrices, a pipeline stage's blocks (DDP's full copy is the trainer's
    # own ZeRO-0 log line, checked by every run)
    wanted = {Layout(1, 2, 1, 1, 1), Layout(1, 2, 1, 1, 3), Layout(1, 1, 2, 1, 0),
              Layout(1, 1, 1, 2, 0, microbatches=2)}
    estimates = [e for e in plan(cfg, cluster, compile_options=(False,), ac_options=("none",))
                 if e.layout in wanted]
    assert len(estimates) == len(wanted) and all(e.feasible for e in estimates)
    fresh = []  # check predicts each layout again right before it runs (plan --check recalibrates there)

    def refresh(est):
        fresh.append(estimate(cfg, est.layout, cluster, False))
        return fresh[-1]

    checked = check(cfg, estimates, cluster, steps=2, refresh=refresh)
    assert [c.estimate for c in checked] == fresh and len(fresh) == len(wanted)
    for c in checked:
        assert c.state_error() <= 0.10, c.row()


def test_cli_plan_json_and_bad_cluster(cli_env):
    ok = subprocess.run([*ALLHANDS, "plan", "--cluster", "h200:2", "--json", "--tokens", "1e9",
                         "--set", "run.global_batch=64"], env=cli_env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    rows = json.loads(ok.stdout)["layouts"]
    assert rows[0]["feasible"] and rows[0]["accelerator_hours"] > 0
    assert any(not r["feasible"] and r["reason"] for r in rows)
    bad = subprocess.run([*ALLHANDS, "plan", "--cluster", "tpu:2"], env=cli_env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--cluster" in bad.stderr


def _calibration(**costs: float) -> dict:
    """A calibration of this machine's shape (calibrate.py's keys) with chosen costs, zero elsewhere."""
    cal = {op: [0.0, 0.0] for op in ("allreduce", "allgather", "reducescatter", "broadcast", "sendrecv")}
    cal.update({k: 0.0 for k in ("fsdp_unit_zero2", "fsdp_unit_zero3", "fsdp_step_zero2", "fsdp_step_zero3", "tp_step", "dtensor_update_tensor", "ddp_step", "ddp_half",
                                 "tp_module", "pp_microbatch", "step_fixed", "step_per_block",
                                 "step_per_param", "runtime", "zero1_update_tensor", "partial_grad_tensor")},
               contention=1.0)
    cal.update(costs)
    return cal


def test_local_step_is_composed_from_the_calibration():
    """The local model adds what the probes measured, no more: DDP pays its measured cost and its
    gradient bytes over a single process, which pays one all-reduce (the non-finite vote); 1F1B's
    bubble is (p-1)/m of compute."""
    cfg = _config(*TINY, "model.vocab_size=257")
    shape = dict(blocks=[2], numel=[stage_params(cfg, 1, 1, 0)[0]], tensors=[15], threads=1)
    cal = _calibration(allreduce=[1e-3, 1e-9], ddp_step=2e-3, step_fixed=5e-3, step_per_block=1e-3)
    one = local_step(cfg, Layout(1, 1, 1, 1, 0), cal, **shape)
    ddp = local_step(cfg, Layout(2, 1, 1, 1, 0), cal, **shape)
    assert ddp["comm_exposed"] - one["comm_exposed"] == pytest.approx(2e-3 + 4 * shape["numel"][0] * 1e-9)
    assert one["optimizer"] == pytest.approx(5e-3) and one["comm"] == pytest.approx(1e-3 + 4e-9)
    # half the per-rank batch: the eager-op cost per block stays, the matmuls shrink
    assert 2e-3 < ddp["compute"] < one["compute"]
    for m in (2, 4):
        pp = local_step(cfg, Layout(1, 1, 1, 2, 0, microbatches=m), cal, **{**shape, "blocks": [1, 1],
                        "numel": [1, 1], "tensors": [1, 1]})
        assert pp["bubble"] / pp["compute"] == pytest.approx(1 / m)



def test_a_calibration_made_by_another_method_is_measured_again(tmp_path, monkeypatch):
    """The cache keeps the method its figures were taken by (the fastest repetition, the kernels
    timed apart from the eager cost per block, contention in lockstep); one made before, with
    medians that other processes' load inflated or contention from unsynchronised workers, is
    not used."""
    from allhands.plan.localtime import METHOD, cached_calibration, calibration_key

    monkeypatch.setenv("ALLHANDS_CACHE_DIR", str(tmp_path))
    cal = _calibration()
    for old in ({}, {"statistic": "best", "kernels": "mm+attention+gelu+norm"}, {"method": METHOD - 1}):
        (tmp_path / "local_calibration.json").write_text(json.dumps({calibration_key(2): {**cal, **old}}))
        assert cached_calibration(2) is None
    cal["method"] = METHOD
    (tmp_path / "local_calibration.json").write_text(json.dumps({calibration_key(2): cal}))
    assert cached_calibration(2) == cal


def test_software_terms_of_published_runs_add_what_they_say():
    """Megatron-LM of 2021 as bench/plan.py plans it: DDP's all-reduce after backward is all
    exposed, and attention over stored T x T scores costs SCORE_PASSES element-wise passes over
    them per block at memory bandwidth (plus the recomputed forward's under block AC)."""
    from allhands.plan.estimate import SCORE_PASSES, SCORE_PASSES_FWD

    cfg = _config("model.n_layer=4", "model.n_head=8", "model.n_embd=512", "model.seq_len=1024",
                  "model.vocab_size=1024", "run.global_batch=64", "run.precision=bf16")
    c = parse_cluster("a100:2")
    layout = Layout(16, 1, 1, 1, 0)
    fused, late = estimate(cfg, layout, c, True), estimate(cfg, layout, c, True, overlap_dp=False)
    assert fused.time["comm_exposed"] < fused.time["comm"] == late.time["comm"] == late.time["comm_exposed"]
    assert late.time["step"] - fused.time["step"] == pytest.approx(late.time["comm"] - fused.time["comm_exposed"])
    # 4 samples x 8 heads x T^2 x 2 bytes x 4 blocks, at the element-wise kernels' share of bandwidth
    scores = 4 * 8 * 1024 ** 2 * 2 * 4 / (c.mem_bw * c.ew_eff)
    # QK^T and AV over the whole square as batched matmuls at gemm_eff, against a fused causal
    # kernel's half of them at attn_eff (12 x width x T a token and block, 4 x 1024 tokens, 4 blocks)
    attn = 12 * 512 * 1024 * 4 * 1024 * 4 / c.peak_bf16
    kernels = attn / c.gemm_eff - 0.5 * attn / c.attn_eff
    for ac, passes, rec in (("none", SCORE_PASSES, 1.0), ("block", SCORE_PASSES + SCORE_PASSES_FWD, 4 / 3)):
        base = estimate(cfg, Layout(16, 1, 1, 1, 0, ac=ac), c, True)
        stored = estimate(cfg, Layout(16, 1, 1, 1, 0, ac=ac), c, True, attention="materialized")
        assert stored.time["compute"] - base.time["compute"] == pytest.approx(passes * scores + rec * kernels)


@pytest.mark.parametrize("bias", [False, True])
def test_partial_gradients_are_counted_from_the_real_tp_plan(bias):
    """The parameters the planner charges for Partial gradients are those whose gradient the
    real sequence-parallel TP plan leaves Partial (a world of one keeps the placements), on every
    pipeline stage shape; without sequence parallelism there are none."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial

    from allhands.job import lm_loss
    from allhands.models import GPT, GPTConfig
    from allhands.parallel.tensor import apply_tp
    from allhands.plan.localtime import partial_grad_tensors

    cfg = _config(*TINY, f"model.bias={str(bias).lower()}")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for sp in (True, False):
            model = GPT(GPTConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=2, n_embd=32, bias=bias))
            apply_tp(model, init_device_mesh("cpu", (1,)), sequence_parallel=sp)
            x = torch.randint(0, 96, (2, 16))
            lm_loss(model(x), x).backward()
            partial = sum(isinstance(p.grad.placements[0], Partial) for p in model.parameters())
            apply_override(cfg, f"parallel.tp_sequence_parallel={str(sp).lower()}")
            assert partial == partial_grad_tensors(cfg, 2, True) == (10 if bias else 5) * sp
    finally:
        dist.destroy_process_group()
    apply_override(cfg, "parallel.tp_sequence_parallel=true")
    assert partial_grad_tensors(cfg, 2, False) == 4 * (1 + bias)  # a stage without ln_f


def test_partial_gradients_cost_their_measured_update_and_all_reduces():
    """Under sequence-parallel TP each Partial gradient costs the calibration's measured update
    (its all-reduces included) instead of a plain DTensor's; on a GPU preset, PARTIAL_REDUCES
    all-reduces of it at NCCL's per-call latency over the tp group."""
    from allhands.plan.estimate import _bw, _ring
    from allhands.plan.localtime import PARTIAL_REDUCES

    cfg = _config(*TINY, "model.vocab_size=257")
    shape = dict(blocks=[2], numel=[stage_params(cfg, 1, 2, 0)[0]], tensors=[15], threads=1)
    cal = _calibration(dtensor_update_tensor=1e-4, partial_grad_tensor=3e-3)
    tp2 = Layout(1, 1, 2, 1, 0)
    with_sp = local_step(cfg, tp2, cal, **shape)["optimizer"]
    assert with_sp == pytest.approx(10 * 1e-4 + 5 * 3e-3)  # 5 Partial: ln1, ln2 x 2 blocks, ln_f
    apply_override(cfg, "parallel.tp_sequence_parallel=false")
    assert local_step(cfg, tp2, cal, **shape)["optimizer"] == pytest.approx(15 * 1e-4)
    c = parse_cluster("a100:1")
    without = estimate(cfg, tp2, c, False).time
    apply_override(cfg, "parallel.tp_sequence_parallel=true")
    with_sp = estimate(cfg, tp2, c, False).time
    per_call = c.latency + _ring("allreduce", 4.0 * cfg.model.n_embd, 2) / _bw(c, tp2, "tp")
    assert with_sp["optimizer"] - without["optimizer"] == pytest.approx(PARTIAL_REDUCES * 5 * per_call)
    assert with_sp["step"] - without["step"] == pytest.approx(PARTIAL_REDUCES * 5 * per_call)


def test_check_notes_steps_too_short_to_time():
    """format_check names the layouts whose fastest step is under SHORT_STEP (mostly scheduler
    noise on a loaded CPU) in one line, and adds nothing when every step is long enough."""
    from allhands.plan.check import SHORT_STEP, Checked, format_check

    cfg, c = _config(*TINY, "model.vocab_size=257"), parse_cluster("a100:1")
    dp, tp = (estimate(cfg, layout, c, False) for layout in (Layout(2, 1, 1, 1, 0), Layout(1, 1, 2, 1, 0)))

    def checked(est, seconds):
        return Checked(est, [1e6, 1e6], 2e6, "rss", seconds, seconds)

    out = format_check([checked(dp, SHORT_STEP / 3), checked(tp, 2 * SHORT_STEP)])
    note = [x for x in out.splitlines() if x.startswith("note:")]
    assert len(note) == 1 and dp.layout.name() in note[0] and tp.layout.name() not in note[0]
    assert "note:" not in format_check([checked(tp, 2 * SHORT_STEP)])


def test_a_calibration_takes_each_figure_s_median_over_probe_runs():
    """A framework's cost is a difference of two minima, so one probe run can land far off (zero,
    or twice the value): the calibration keeps each figure's median over its probe runs, an
    alpha-beta pair element by element."""
    from allhands.plan.calibrate import _median

    runs = [{"ddp_step": 0.0, "allreduce": [1e-4, 3e-9]}, {"ddp_step": 2e-3, "allreduce": [3e-4, 1e-9]},
            {"ddp_step": 1e-3, "allreduce": [2e-4, 2e-9]}]
    assert _median(runs) == {"ddp_step": 1e-3, "allreduce": [2e-4, 2e-9]}


def test_contention_is_the_compute_factor_a_data_parallel_step_needs():
    """Calibration's contention: a 2-worker step whose compute runs 1.5x slower than one worker's
    gives 1.5, communication and the update left as modelled; a 1-worker step the model predicts
    20% short scales the compute it is compared with, so the model's own error does not count as
    contention; and workers that do not slow each other give 1, never less."""
    from allhands.plan.calibrate import contention_factor

    one = {"step": 40e-3, "compute": 36e-3}
    many = {"step": 45e-3, "compute": 36e-3}  # + 4 ms of communication, 5 ms of update
    assert contention_factor(40e-3, one, 9e-3 + 1.5 * 36e-3, many) == pytest.approx(1.5)
    assert contention_factor(48e-3, one, 9e-3 + 1.5 * 1.2 * 36e-3, many) == pytest.approx(1.5)
    assert contention_factor(40e-3, one, 40e-3, many) == 1.0

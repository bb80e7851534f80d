"""The published runs bench/plan.py plans are entered as the sources state them (each MPT row's
model, as the planner counts its parameters, has the NumParams llm-foundry printed beside it), and
the planner terms that describe their software and hardware add what they say."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from allhands.plan import Layout, estimate
from allhands.plan.cluster import PRESETS
from allhands.plan.estimate import _bw, stage_params

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_mpt_rows_match_published_parameter_counts():
    b = _bench()
    assert len(b.MPT_H100) == 52  # every row of llm-foundry's "H100 80GB BF16" table
    assert len(b.MPT_A100) + len(b.MPT_A100_PURE) == 61  # and of its "A100 80GB ... (RoCE)" table
    for model, seq, *_, params in b.MPT_H100 + b.MPT_A100 + b.MPT_A100_PURE:
        assert stage_params(b.mpt_config(model, seq), 1, 1, 0)[0] == params, (model, seq)


@pytest.mark.parametrize("layout,dim,gbs", [
    (Layout(1, 64, 1, 1, 3), "dp_shard", 8 * 21),  # 8 members a node: 8 NICs, under NVLink's 230
    (Layout(1, 32, 2, 1, 3), "dp_shard", 4 * 21),  # stride 2: 4 members a node
    (Layout(8, 8, 1, 1, 3), "dp_replicate", 21),  # HSDP's replicate dim: one member a node
    (Layout(1, 8, 8, 1, 3), "dp", 21),  # dp under tp=8
    (Layout(1, 8, 8, 1, 3), "tp", 230),  # inside a node
    (Layout(1, 4, 1, 1, 3), "dp_shard", 230),
])
def test_a_group_spanning_nodes_gets_the_nics_of_its_members_on_a_node(layout, dim, gbs):
    assert _bw(PRESETS["a100"], layout, dim) == pytest.approx(gbs * 1e9)


def test_nic_spreading_is_capped_by_the_links_inside_a_node():
    fast_nics = dataclasses.replace(PRESETS["h100"], inter_bw=50e9)  # 8 x 50 > NVLink's 360
    assert _bw(fast_nics, Layout(1, 16, 1, 1, 3), "dp_shard") == fast_nics.intra_bw


def test_published_software_terms_change_what_they_describe():
    b = _bench()
    cfg = b.mpt_config("125m", 2048, gpus=16, micro=4)
    layout, c = Layout(1, 16, 1, 1, 3), dataclasses.replace(PRESETS["a100"], nodes=2)
    torch_loss, fused = estimate(cfg, layout, c, True), estimate(cfg, layout, c, True, loss="fused")
    logits = 4 * 2048 * 50368  # micro batch x T x vocabulary
    assert torch_loss.memory["activations"] - fused.memory["activations"] == pytest.approx(
        logits * (3 * 4 - 2 * 2))  # logits, fp32 copy and gradient vs bf16 logits and gradient
    with_dropout = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1))
    masks = estimate(with_dropout, layout, c, True).memory["activations"] - torch_loss.memory["activations"]
    assert masks == pytest.approx(12 * 2 * 4 * 2048 * 768)  # 12 blocks x two 1-byte masks a value
    pure = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reduce_dtype="bf16"))
    rs = 15 / 16 * 4.0 * stage_params(cfg, 1, 1, 0)[0] / _bw(c, layout, "dp_shard")  # fp32 grads
    assert torch_loss.time["comm"] - estimate(pure, layout, c, True).time["comm"] == pytest.approx(rs / 2)

"""The published runs bench/plan.py plans are entered as the sources state them: each MPT row's
model, as the planner counts its parameters, has the NumParams llm-foundry printed beside it."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from allhands.plan import Layout
from allhands.plan.cluster import PRESETS
from allhands.plan.estimate import _bw, stage_params

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mpt_rows_match_published_parameter_counts():
    b = _bench()
    assert len(b.MPT_H100) == 52  # every row of llm-foundry's "H100 80GB BF16" table
    for model, seq, *_, params in b.MPT_H100:
        layers, width, heads = b.MPT[model]
        cfg = b._config(f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
                        f"model.seq_len={seq}", "model.vocab_size=50368", "model.bias=true",
                        "model.tie_embeddings=true")
        assert stage_params(cfg, 1, 1, 0)[0] == params, (model, seq)


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

"""run.compile: each block compiled in place (after TP and AC, before DDP/FSDP; each pipeline
stage's own blocks) trains to the single-process eager reference's parameters and keeps the
parameter names, under DDP, tp=2 and pp=2; the workers really compiled the blocks (rank 0's
record of the first step counts the graphs, compiled or read from the inductor cache the jobs
share, whose generated code holds a block's forward and backward).

Parity tolerance 1e-5 relative, as for eager layouts: under plain SGD the update is linear in the
gradient, so inductor's fused C++ kernels, which reorder float32 sums (layer norm, softmax, bias
gradients), move the parameters at fp32 rounding only (measured 1.2e-7 to 1.5e-7 after 3 steps,
as eager DDP's 1.3e-7). Under AdamW the same last bits, divided by sqrt(v) in near-zero gradient
entries, become lr-relative differences of up to 1e-4."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from allhands.config import validate
from allhands.env import cache_dir
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference

SGD = ["optim.name=sgd", "optim.lr=0.5", "run.steps=3"]


@pytest.fixture
def inductor_cache() -> Path:
    """The inductor cache a user's jobs get: the launcher's default in allhands' cache
    directory (in the suite, the run's own: tests/isolation.py), which outlives every job. A job
    reads what an earlier one compiled, which the record of its first step shows, as a user's
    restart does."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir() / "inductor")


def _train_compiled(token_dir, tmp_path, cache: Path, *layout: str) -> tuple:
    """Train with run.compile on 2 workers; returns the finished config and the Python inductor
    generated for the graphs in the shared cache. Rank 0's record of the first step says how
    many graphs this job compiled and that each inductor graph was compiled or read from that
    cache: the job really ran compiled blocks, whichever test first compiled them."""
    cfg = tiny_config(token_dir, tmp_path / "run", "run.compile=true", *SGD, *layout)
    if layout:
        validate(cfg, world_size=2)
    done = train_job(cfg, LaunchSpec(nproc=2))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    first = next(r for r in records if "compile_graphs" in r)
    blocks_on_rank_0 = 1 if "parallel.pp=2" in layout else 2
    assert first["step"] == 1 and first["compile_graphs"] >= blocks_on_rank_0, first
    # at least a forward and a backward graph went through inductor, compiled now or read from
    # the cache (blocks alike in code and shapes may share one compiled graph within a process)
    assert first["compile_cache_hits"] + first["compile_cache_misses"] >= 2, first
    return done, [p.read_text() for p in cache.glob("*/*.py")]


def _assert_blocks_compiled(graphs: list[str], label: str) -> None:
    """Among the compiled graphs, a block's forward (layer norm, attention, the MLP's GELU) and
    its backward (the attention's backward)."""
    assert any("layer_norm" in g and "scaled_dot_product" in g and "gelu" in g for g in graphs), \
        f"{label}: no compiled block forward among {len(graphs)} graphs"
    assert any(re.search(r"scaled_dot_product\w*_backward", g) for g in graphs), \
        f"{label}: no compiled block backward among {len(graphs)} graphs"


def test_compiled_ddp_matches_eager_reference(token_dir, tmp_path, inductor_cache):
    done, graphs = _train_compiled(token_dir, tmp_path, inductor_cache)
    _assert_blocks_compiled(graphs, "DDP")
    assert_matches_reference(done, "compiled blocks under DDP")


# Each compiled block under tensor parallelism (DTensor parameters, sequence parallel's
# redistributions inside the block) and under the pipeline's stages (each stage's blocks).
COMPILED_LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.dp_replicate=1"],
    "pp2": ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=1f1b"],
}


@pytest.mark.parametrize("layout", list(COMPILED_LAYOUTS))
def test_compiled_tp_and_pp_match_eager_reference(token_dir, tmp_path, inductor_cache, layout):
    done, graphs = _train_compiled(token_dir, tmp_path, inductor_cache, *COMPILED_LAYOUTS[layout])
    _assert_blocks_compiled(graphs, layout)
    if layout == "tp2":  # sequence parallel's all-gathers and reduce-scatters are in the graph
        assert any("all_gather" in g and "reduce_scatter" in g for g in graphs), layout
    assert_matches_reference(done, f"compiled blocks under {layout}")

"""run.compile: each block compiled in place (after TP and AC, before DDP/FSDP; each pipeline
stage's own blocks) trains to the single-process eager reference's parameters and keeps the
parameter names, under DDP, tp=2 and pp=2.

Parity tolerance: after 3 AdamW steps the largest relative difference of any parameter from the
eager reference is at most 1e-4 (``max_rel_diff``), against 1e-5 for eager layouts: inductor's fused
C++ kernels reorder float32 sums (layer norm, softmax, bias gradients), which moves the last
bits, and Adam's normalisation turns them into lr-relative differences."""

from __future__ import annotations

import pytest

from allhands.config import validate
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference


def test_compiled_ddp_matches_eager_reference(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.compile=true", "run.steps=3")
    done = train_job(cfg, LaunchSpec(nproc=2))
    assert_matches_reference(done, "compiled blocks under DDP", tol=1e-4)


# Each compiled block under tensor parallelism (DTensor parameters, sequence parallel's
# redistributions inside the block) and under the pipeline's stages (each stage's blocks).
COMPILED_LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.dp_replicate=1"],
    "pp2": ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=1f1b"],
}


@pytest.mark.parametrize("layout", list(COMPILED_LAYOUTS))
def test_compiled_tp_and_pp_match_eager_reference(token_dir, tmp_path, layout):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.compile=true", "run.steps=3",
                      *COMPILED_LAYOUTS[layout])
    validate(cfg, world_size=2)
    done = train_job(cfg, LaunchSpec(nproc=2))
    assert_matches_reference(done, f"compiled blocks under {layout}", tol=1e-4)

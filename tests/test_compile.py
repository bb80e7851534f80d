"""run.compile: each block compiled in place (after AC, before DDP/FSDP) trains to the
single-process eager reference's parameters, keeps the parameter names, and layouts it does not
support are refused in one line.

Parity tolerance: after 3 AdamW steps the largest relative difference of any parameter from the
eager reference is at most 1e-4 (``max_rel_diff``), against 1e-5 for eager layouts: inductor's fused
C++ kernels reorder float32 sums (layer norm, softmax, bias gradients), which moves the last
bits, and Adam's normalisation turns them into lr-relative differences."""

from __future__ import annotations

import pytest

from allhands.config import validate
from allhands.errors import ConfigError
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference


def test_compiled_ddp_matches_eager_reference(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.compile=true", "run.steps=3")
    done = train_job(cfg, LaunchSpec(nproc=2))
    assert_matches_reference(done, "compiled blocks under DDP", tol=1e-4)


@pytest.mark.parametrize("dim", ["pp", "tp"])
def test_compile_refuses_unsupported_layouts_in_one_line(token_dir, tmp_path, dim):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.compile=true", f"parallel.{dim}=2",
                      "parallel.dp_replicate=1")
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert str(e.value).startswith("run.compile:") and "\n" not in str(e.value)

"""Gradient accumulation communicates once per step: with ``run.micro_batches=4`` each FSDP
unit is reduce-scattered (ZeRO-2/3) and each DDP bucket all-reduced once per step, not once per
micro-batch, and the result is still the single process's. And the FSDP units are cut as
torchtitan cuts them: blocks, embeddings, the head kept gathered for backward."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from allhands.job import Job, build_reference_model
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.mesh import Mesh
from allhands.parallel.fsdp import apply_fsdp, edge_units

from conftest import tiny_config
from test_parity import assert_matches_reference

PATCHED: list[bool] = []  # once per worker: the FLOP counter builds the model a second time


def counting_model(cfg):
    """The reference model, in a worker whose gradient reductions are written one a line to
    RUN_DIR/reductions-<rank>.txt: ``fsdp <first parameter of the unit>`` for each FSDP2
    ``foreach_reduce`` (its reduce-scatter, and HSDP's all-reduce after it), ``ddp <bucket>``
    for each DDP bucket's all-reduce hook."""
    if not PATCHED:
        PATCHED.append(True)
        _count_reductions(Path(cfg.run.dir))
    return build_reference_model(cfg, 257)


def _count_reductions(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def log(line):
        with open(out / f"reductions-{dist.get_rank()}.txt", "a") as f:
            f.write(line + "\n")

    fsdp_reduce = _fsdp_param_group.foreach_reduce  # called by name from post_backward

    def foreach_reduce(fsdp_params, *args, **kwargs):
        log(f"fsdp {fsdp_params[0]._param_fqn}")
        return fsdp_reduce(fsdp_params, *args, **kwargs)

    ddp_hook = default_hooks.allreduce_hook  # read when sync/allreduce.py registers the hook

    def allreduce_hook(state, bucket):
        log(f"ddp {bucket.index()}")
        return ddp_hook(state, bucket)

    _fsdp_param_group.foreach_reduce = foreach_reduce
    default_hooks.allreduce_hook = allreduce_hook


LAYOUTS = {
    "ddp": ("ddp", []),
    "zero2": ("fsdp", ["parallel.dp_shard=2", "parallel.zero=2"]),
    "zero3": ("fsdp", ["parallel.dp_shard=2", "parallel.zero=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_gradient_reduction_per_unit_per_step_under_accumulation(token_dir, tmp_path, layout):
    kind, extra = LAYOUTS[layout]
    cfg = tiny_config(token_dir, tmp_path / "run", "run.micro_batches=4", "run.global_batch=16",
                      *extra)
    done = train_job(cfg, LaunchSpec(nproc=2), job=Job(model=counting_model))
    for rank in range(2):
        lines = (Path(done.run.dir) / f"reductions-{rank}.txt").read_text().splitlines()
        per_unit = Counter(lines)
        assert per_unit and all(k.startswith(kind + " ") for k in per_unit), per_unit
        # each unit (bucket) once per step: 4 a step would be one per micro-batch
        assert set(per_unit.values()) == {done.run.steps}, per_unit
        if kind == "fsdp":  # the blocks and the tied embedding/head: units of their own
            assert len(per_unit) == done.model.n_layer + 1, per_unit
    assert_matches_reference(done, f"{layout} x 4 micro-batches")


# ---------------------------------------------------------------- the units, in this process

def _gpt(tie: bool):
    cfg = tiny_config(Path("unused"), Path("unused"), f"model.tie_embeddings={str(tie).lower()}")
    return build_reference_model(cfg, 257)


def test_edge_units_are_the_embeddings_and_the_head():
    tied = _gpt(True)
    [(modules, allowed)] = edge_units(tied)
    assert modules == [tied.tok_emb, tied.pos_emb, tied.ln_f, tied.lm_head] and not allowed
    untied = _gpt(False)
    assert edge_units(untied) == [([untied.tok_emb, untied.pos_emb], True),
                                  ([untied.ln_f, untied.lm_head], False)]
    middle = _gpt(False)  # a middle pipeline stage: neither end
    middle.tok_emb = middle.pos_emb = middle.ln_f = middle.lm_head = None
    assert edge_units(middle) == []
    assert edge_units(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_zero3_reshards_blocks_and_embeddings_and_keeps_the_head_for_backward():
    """FSDP2 on a 1-rank mesh in this process: which units free their parameters after forward
    (``post_forward_mesh_info`` set) and which keep them until backward (None)."""
    mesh = Mesh.build(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo",
                      dp_replicate=1, timeout_s=30)
    try:
        model = _gpt(False)
        apply_fsdp(model, mesh, blocks=list(model.blocks.values()), reshard_after_forward=True)

        def reshards(module) -> bool:
            return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None

        assert all(reshards(b) for b in model.blocks.values())
        assert reshards(model.tok_emb) and not reshards(model.lm_head)
        assert model._get_fsdp_state()._fsdp_param_group is None  # the root holds nothing else
    finally:
        mesh.destroy()

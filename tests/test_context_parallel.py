"""Context parallelism (parallel.cp): each rank holds a head and a tail chunk of every sequence
and attends over keys and values gathered from its cp group. Trains the Llama family to the same
parameters as one process, alone, under FSDP, and with document masks; resumes on another cp."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from allhands.launch.launcher import LaunchSpec, train_job
from allhands.parallel.context import ContextParallel, chunk_index

from conftest import tiny_config
from test_parity import assert_matches_reference

LLAMA = ["model.family=llama", "model.n_head=4", "model.n_kv_head=2", "model.seq_len=32",
         "optim.name=sgd", "optim.lr=0.3", "parallel.dp_replicate=1"]


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert chunk_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_index(24, 3, r) for r in range(3)]).sort().values
    assert every.tolist() == list(range(24))


def test_cp2_trains_the_llama_family_like_one_process(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "parallel.cp=2", "model.seq_len=1024",
                      "run.global_batch=4")
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=2)), "cp=2 at seq_len 1024")


def test_cp2_under_fsdp_trains_like_one_process(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "parallel.cp=2", "parallel.zero=3")
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=2)), "cp=2 under FSDP (ZeRO-3)")


def test_a_cp2_checkpoint_resumes_at_cp1(token_dir, tmp_path):
    """DCP reshards: the step-2 checkpoint of a cp=2 run (FSDP over dp_shard x cp) resumes on one
    process, and the run ends where one process trained from the start would."""
    import shutil

    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "parallel.cp=2", "parallel.zero=3",
                      "checkpoint.interval=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    cut = tmp_path / "cut"
    shutil.copytree(done.run.dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    one = tiny_config(token_dir, cut, *LLAMA, "checkpoint.interval=2")
    resumed = train_job(one, LaunchSpec(nproc=1), resume=str(cut))
    assert_matches_reference(resumed, "cp=2 -> cp=1 resume")


def test_cp2_with_document_masks_trains_like_one_process(token_dir, tmp_path):
    """Packed documents under cp: the gathered keys are masked by document as well as by
    position, and the loss is the mean over the global batch's counted targets."""
    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "parallel.cp=2", "data.packing=mask")
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=2)), "cp=2 with document masks")


def test_blockwise_causal_attention_equals_sdpa_with_its_gradients():
    """A rank's two query chunks over the whole sequence, by log-sum-exp merged flash blocks,
    against SDPA's causal attention on the whole sequence (grouped-query heads: 4 over 2)."""
    import torch.nn.functional as F

    from allhands.parallel.context import _CausalBlocks

    torch.manual_seed(0)
    T, cp, rank = 16, 2, 0
    q, k, v = (torch.randn(1, h, T, 8, requires_grad=True) for h in (4, 2, 2))
    mine = chunk_index(T, cp, rank)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, mine]
    got = _CausalBlocks.apply(q[:, :, mine], k, v, [rank, 2 * cp - 1 - rank])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    have = torch.autograd.grad(got, (q, k, v), g)
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("doc_token", [-1, 7], ids=["causal", "documents"])
def test_the_flex_path_of_cuda_equals_attention_over_the_whole_sequence(doc_token):
    """The path cp takes on CUDA (FlexAttention, block mask of this rank's chunks over the keys
    in global order, grouped-query heads in the kernel), run forward on CPU for each rank of
    cp=2 with the gathered keys in rank order: the rows of the whole sequence's attention (SDPA
    with a dense causal, per-document mask) at that rank's positions, and the CPU path's."""
    import torch.nn.functional as F

    from allhands.models.layers import document_positions

    torch.manual_seed(0)
    B, T, cp = 2, 32, 2
    x = torch.randint(0, 7, (B, T))
    if doc_token >= 0:
        x[0, [5, 17]], x[1, 11] = doc_token, doc_token
        seg = document_positions(x, doc_token)[1]
    else:
        seg = torch.zeros_like(x)
    allowed = (seg[:, :, None] == seg[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    q, k, v = (torch.randn(B, h, T, 8) for h in (4, 2, 2))
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    held = torch.cat([chunk_index(T, cp, r) for r in range(cp)])  # the gathered (rank) order
    for rank in range(cp):
        mesh = SimpleNamespace(group=lambda dim: None, size=lambda dim: cp, local_rank=lambda dim: rank)
        mine = chunk_index(T, cp, rank)
        got = {}
        for path in ("flex", "sdpa"):
            part = ContextParallel(mesh, doc_token, path=path)
            xs, _, kw = part.shard(x, x)
            assert torch.equal(xs, x[:, mine]) and (part.block_mask is not None) == (path == "flex")
            got[path] = part.attend(q[:, :, mine], k[:, :, held], v[:, :, held], enable_gqa=True)
        torch.testing.assert_close(got["flex"], whole[:, :, mine], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["flex"], got["sdpa"], rtol=1e-5, atol=1e-6)


def test_the_planner_prices_cp_and_proposes_it_for_a_sequence_that_does_not_fit():
    """cp divides activation memory and adds the k/v all-gathers; at 64k tokens a Llama 3 8B
    sequence does not fit an H100 without it, and with 2 sequences a step on 8 GPUs the
    planner's best layout cuts them."""
    from allhands.config import Config, apply_override
    from allhands.plan import parse_cluster, plan
    from allhands.plan.estimate import Layout, estimate

    cfg = Config()
    for item in ("model.preset=llama3-8b", "model.seq_len=65536", "run.global_batch=2",
                 "run.precision=bf16"):
        apply_override(cfg, item)
    from allhands.models.build import with_preset
    cfg.model = with_preset(cfg.model)
    cluster = parse_cluster("h100:1", 8)
    one = estimate(cfg, Layout(1, 2, 1, 1, 3, ac="selective"), cluster, True)
    four = estimate(cfg, Layout(1, 2, 1, 1, 3, ac="selective", cp=4), cluster, True)
    assert four.memory["activations"] < one.memory["activations"] / 3.5
    assert four.time["comm"] > one.time["comm"] and one.reason
    best = plan(cfg, cluster)[0]
    assert not best.reason and best.layout.cp > 1, best.layout.name()


def test_cp2_composes_with_tp2_and_with_data_parallel(token_dir, tmp_path):
    """4 processes: tp=2 x cp=2 under FSDP, and 2 data-parallel replicas x cp=2 with document
    masks, each against one process."""
    tp = tiny_config(token_dir, tmp_path / "tp", *LLAMA, "parallel.cp=2", "parallel.tp=2",
                     "parallel.zero=3")
    assert_matches_reference(train_job(tp, LaunchSpec(nproc=4)), "tp=2 x cp=2")
    dp = tiny_config(token_dir, tmp_path / "dp", *LLAMA, "parallel.cp=2", "parallel.dp_replicate=2",
                     "data.packing=mask")
    assert_matches_reference(train_job(dp, LaunchSpec(nproc=4)), "dp=2 x cp=2, document masks")

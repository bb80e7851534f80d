"""The Llama family under every layout the GPT has: each trains a tiny grouped-query Llama to the
parameters of one process on the same global batches (parallel/tensor.py's family plan for tp,
the balanced pipeline split for pp, the generic FSDP/DDP/ZeRO-1/AC/DiLoCo/replica/ps paths).

SGD (no momentum), so each parameter's update is its gradient times the learning rate and a
layout bug (a wrong shard, a missing reduction over tp of a norm's partial gradient, an untied
copy, a mis-scaled loss) moves parameters by far more than the 1e-5 the layouts' summation order
costs; Adam would magnify rounding noise in near-zero gradients instead (test_sharding's note).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from allhands.config import ConfigError, validate
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import assert_matches_reference, max_rel_diff, reference_params
from test_replica import saved

# 4 query heads over 2 key/value heads (grouped-query), SwiGLU 32 -> 64, untied head (Llama 3's)
LLAMA = ["model.family=llama", "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=64",
         "model.tie_embeddings=false", "optim.name=sgd", "optim.lr=0.5", "run.threads=1"]
# Qwen3's variant: RMSNorm on each q/k head, Qwen2's q/k/v bias, tied embeddings
QWEN3 = ["model.qk_norm=true", "model.qkv_bias=true", "model.tie_embeddings=true"]

LAYOUTS = {
    "ddp": (2, []),
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero=1"]),
    "zero2+block_ac": (2, ["parallel.dp_shard=2", "parallel.zero=2", "parallel.ac=block"]),
    "zero3+selective_ac": (2, ["parallel.dp_shard=2", "parallel.zero=3", "parallel.ac=selective"]),
    "hsdp": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3"]),
    # grouped-query heads split over tp: 2 query + 1 key/value head a rank, sequence parallel norms
    "tp2-gqa": (2, ["parallel.tp=2", "parallel.dp_replicate=1"]),
    # per-head q/k norms, q/k/v bias and the tied embedding/head pair, sharded over the vocabulary
    "tp2-qwen3": (2, ["parallel.tp=2", "parallel.dp_replicate=1", *QWEN3]),
    "pp2": (2, ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=1f1b"]),
    "pp2-tied": (2, ["parallel.pp=2", "parallel.dp_replicate=1", *QWEN3]),
    # H=1, outer SGD with lr 1 and no momentum: exactly synchronous SGD (test_lowcomm's identity)
    "diloco": (2, ["parallel.sync=diloco", "sync.inner_steps=1", "sync.outer_lr=1.0",
                   "sync.outer_momentum=0.0", "sync.outer_nesterov=false", "optim.grad_clip=0"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layout_matches_single_process(token_dir, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "run.check_sync=true", *extra)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    got = assert_matches_reference(done, layout)
    if done.model.tie_embeddings:
        assert torch.equal(got["tok_emb.weight"], got["lm_head.weight"])
    if done.model.qk_norm:  # the per-head norms trained: their tp-partial gradients were summed
        assert not torch.equal(got["blocks.0.attn.q_norm.weight"], torch.ones(8))


def test_replica_mode_trains_the_family(token_dir, tmp_path):
    """fault.mode=replica, 2 groups of 1: each group's share of every global batch, reduced across
    groups through the quorum, ends at the reference of that batch rule and bit-equal in both."""
    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "fault.mode=replica")
    done = train_job(cfg, LaunchSpec(nproc=2))
    run = Path(done.run.dir)
    a, b = saved(run), saved(run / "replicas" / "group-1")
    got = {k.removeprefix("model.model."): v for k, v in a.items() if k.startswith("model.model.")}
    for k in got:
        assert torch.equal(got[k], b["model.model." + k]), k
    assert max_rel_diff(got, reference_params(done, shares=2)) <= 1e-5


def test_parameter_server_detaches_the_untied_embedding(token_dir, tmp_path):
    """parallel.sync=ps, sync mode, 2 workers and 1 server: the untied token embedding is a row
    table on the server (ps.sparse=auto; a head tied to it would keep it dense), every other
    parameter a dense shard; the result is the single-process SGD's."""
    from test_ps import server_tables, trained_params_without_tables

    cfg = tiny_config(token_dir, tmp_path / "run", *LLAMA, "parallel.sync=ps", "ps.servers=1",
                      "ps.sparse=auto", "optim.weight_decay=0", "data.eval_batches=0")
    done = train_job(cfg, LaunchSpec(nproc=3))
    ref = reference_params(done)
    got = trained_params_without_tables(done)
    assert "tok_emb.weight" not in got and "lm_head.weight" in got  # the table lives on the server
    (table,) = server_tables(Path(done.run.dir)).values()
    got["tok_emb.weight"] = table
    assert max_rel_diff(got, ref) <= 1e-5


def test_pipeline_split_of_an_imported_transformers_llama(token_dir, tmp_path):
    """A transformers LlamaForCausalLM saved offline, trained from with checkpoint.init_from and no
    model section, split over pp=2: the parameters of one process trained from the same weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=10000.0))
    hf.save_pretrained(tmp_path / "hf")
    cfg = tiny_config(token_dir, tmp_path / "run", "optim.name=sgd", "optim.lr=0.5", "run.threads=1",
                      f"checkpoint.init_from={tmp_path / 'hf'}", "parallel.pp=2",
                      "parallel.dp_replicate=1")
    done = train_job(cfg, LaunchSpec(nproc=2))
    assert done.model.family == "llama" and done.model.n_kv_head == 2
    got = assert_matches_reference(done, "imported llama, pp=2")
    want = hf.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert max_rel_diff({"w": got["blocks.1.mlp.down_proj.weight"]}, {"w": want}) > 1e-4  # it trained


@pytest.mark.parametrize("kv,extra,msg", [
    (1, [], "parallel.tp: 2 does not divide model.n_kv_head=1; key/value heads are split"),
    (2, ["model.seq_len=15"], "parallel.tp: 2 does not divide model.seq_len=15"),
])
def test_tp_refuses_what_it_cannot_split(token_dir, tmp_path, kv, extra, msg):
    """Multi-query attention (one key/value head) cannot be split over tp=2 ranks: refused in one
    line naming both fields, before any process starts; so is a sequence SP cannot halve."""
    cfg = tiny_config(token_dir, tmp_path, *LLAMA, f"model.n_kv_head={kv}", "parallel.tp=2",
                      "parallel.dp_replicate=1", *extra)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)

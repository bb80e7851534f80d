"""A shipped model is built on the meta device and allocated only once it is cut: each rank
writes exactly the elements it holds (its FSDP shard, its tensor-parallel slice, its pipeline
stage, its experts), never a whole parameter it does not hold, and every element equals the one
the single-process model gets from the same seed (models/init.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from allhands.launch.launcher import LaunchSpec, launch
from allhands.launch.rundir import resolve_run
from allhands.models import GPT, GPTConfig, Llama, LlamaConfig
from allhands.models import init
from allhands.models.moe import MoEArgs

from conftest import tiny_config

SMALL_CHUNKS = 64  # elements replayed at a time in the tests: a tiny parameter spans many chunks


@pytest.mark.parametrize("n", [16, 17, 33, 48, 100, 4097])
@pytest.mark.parametrize("kind", ["normal", "uniform"])
def test_a_draw_in_chunks_is_the_draw_at_once(kind, n, monkeypatch):
    # the property of torch's CPU kernels the replay rests on (models/init.py's docstring)
    monkeypatch.setattr(init, "CHUNK_NUMEL", 16)
    whole = getattr(torch.empty(n), f"{kind}_")(generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    op = init._Op(kind, torch.empty(n, device="meta"), (0.0, 1.0))
    chunks = init._chunks((n,))
    assert (len(chunks) > 1) == (n >= 32) and all(b - a >= 16 for a, b in chunks)
    assert torch.equal(torch.cat([init._draw(op, g, rows) for rows in chunks]), whole)


@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, seq_len=8)),
    lambda: GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, seq_len=8, bias=False,
                          tie_embeddings=False)),
    lambda: Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16,
                              qkv_bias=True, qk_norm=True, tie_embeddings=True,
                              moe=MoEArgs(n_experts=4, n_shared=1, balance="bias"))),
], ids=["gpt", "gpt-untied", "llama-moe"])
def test_replayed_on_meta_equals_built_whole(make, monkeypatch):
    monkeypatch.setattr(init, "CHUNK_NUMEL", SMALL_CHUNKS)
    torch.manual_seed(5)
    whole = make()
    torch.manual_seed(5)
    with torch.device("meta"), init.InitRecord() as record:
        cut = make()
    assert all(p.is_meta for p in cut.parameters())
    init.materializer(cut, record, "cpu")(cut)
    assert (cut.lm_head.weight is cut.tok_emb.weight) == cut.cfg.tie_embeddings
    want, got = whole.state_dict(), cut.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for (k, a), (_, b) in zip(whole.named_buffers(), cut.named_buffers()):
        assert torch.equal(a, b), k  # RoPE tables, MoE bias and counts


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.normal_(self.w, generator=torch.Generator().manual_seed(0))


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.w.normal_().mul_(2.0)


@pytest.mark.parametrize("make", [_OwnGenerator, _Scaled])
def test_an_initialisation_that_cannot_be_replayed_is_refused(make):
    with torch.device("meta"), init.InitRecord() as record:
        model = make()
    with pytest.raises(RuntimeError, match="cannot (be )?replay"):
        init.materializer(model, record, "cpu")(model)


def _init_worker(cfg_dict: dict, vocab: int, out: str) -> None:
    """One rank: its Trainer built (data, model, layout, optimizer; no step), with every element
    models/init.py writes counted; per parameter this rank holds, whether its block equals that
    block of the single-process model. Written to OUT/rank<R>.json."""
    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.job import build_reference_model
    from allhands.lockstep import build_mesh
    from allhands.trainer import Job, Trainer
    from allhands.worker import reported_failures

    init.CHUNK_NUMEL = SMALL_CHUNKS
    written: dict[int, int] = {}
    largest = [0]
    store = init._store

    def counting(local, index, r0, block):
        n = store(local, index, r0, block)
        written[local.data_ptr()] = written.get(local.data_ptr(), 0) + n
        largest[0] = max(largest[0], block.numel() if isinstance(block, torch.Tensor) else 1)
        return n

    with reported_failures():
        cfg = Config.from_dict(cfg_dict)
        mesh = build_mesh(cfg, worker_env())
        init._store = counting
        trainer = Trainer(cfg, Job(), mesh, Path(cfg.run.dir))
        init._store = store
        torch.manual_seed(cfg.run.seed)
        ref = build_reference_model(cfg, vocab)
        want = {init.clean_name(k): p for k, p in ref.named_parameters(remove_duplicate=False)}
        held, same, wrote = {}, {}, {}
        for part in trainer.parts:
            for name, p in part.named_parameters():
                fqn = init.clean_name(name)
                local, index = init.local_block(p)
                held[fqn] = local.numel()
                wrote[fqn] = written.pop(local.data_ptr(), 0) if local.numel() else 0
                same[fqn] = torch.equal(local.detach(), want[fqn][index] if index else want[fqn])
            for name, b in part.named_buffers():
                same[name] = torch.equal(b, dict(ref.named_buffers())[init.clean_name(name)])
        (Path(out) / f"rank{mesh.rank}.json").write_text(json.dumps(
            {"held": held, "wrote": wrote, "same": same, "elsewhere": sum(written.values()),
             "largest_block": largest[0], "full": sum(p.numel() for p in ref.parameters()),
             "largest_param": max(p.numel() for p in ref.parameters())}))
        mesh.destroy()


MOE = ["model.family=llama", "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=48",
       "model.qk_norm=true", "model.qkv_bias=true", "moe.n_experts=4", "moe.top_k=2",
       "moe.ffn_hidden=24", "moe.n_shared_experts=1"]


@pytest.mark.parametrize("layout,share", [
    (["parallel.dp_shard=2", "parallel.zero=3"], 0.55),
    (["parallel.tp=2", "parallel.dp_replicate=1"], 0.55),
    (["parallel.pp=2", "parallel.dp_replicate=1"], 0.65),  # + the tied head's copy on stage 1
    ([*MOE, "parallel.ep=2"], 0.85),  # the dense layers replicated, the experts split
], ids=["zero3", "tp2", "pp2", "llama-moe-ep2"])
def test_each_rank_writes_only_what_it_holds(token_dir, tmp_path, layout, share):
    cfg = resolve_run(tiny_config(token_dir, tmp_path / "run", "run.threads=1", *layout),
                      resume=None, world_size=2)
    out = tmp_path / "out"
    out.mkdir()
    launch(_init_worker, (cfg.to_dict(), 257, str(out)), LaunchSpec(nproc=2), threads=1)
    for r in range(2):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert all(got["same"].values()), [k for k, v in got["same"].items() if not v]
        # every element this rank holds written once, nothing else, a chunk at a time
        assert got["wrote"] == got["held"] and got["elsewhere"] == 0, r
        assert got["largest_block"] < got["largest_param"], r
        assert sum(got["held"].values()) <= share * got["full"], (r, sum(got["held"].values()))

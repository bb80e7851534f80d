"""MoE edges the other MoE tests leave open: expert parallelism when every token goes to the
experts of one ep rank (the other's get zero rows, in dispatch, the grouped GEMM and backward),
DeepSeek-V3's balancing bias across data-parallel ranks (the loads summed over them), and a
Mixtral-shaped run through `allhands train` and `allhands export --format hf` into transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from allhands.job import build_reference_model
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.models.moe import moe_layers

from conftest import tiny_config
from test_expert_parallel import MOE
from test_parity import assert_matches_reference

BIAS = [*MOE, "moe.balance=bias"]


def _init_routing_to(cfg, winners: tuple[int, ...], path) -> str:
    """A .safetensors start (checkpoint.init_from) of ``cfg``'s seeded model whose balancing bias
    sends every token to ``winners`` (top_k of them): 100 against scores in [0, 1], which a few
    steps of ``moe.bias_rate`` (1e-3) cannot overturn."""
    torch.manual_seed(cfg.run.seed)
    model = build_reference_model(cfg, 257)
    for m in moe_layers(model):
        m.router.expert_bias[list(winners)] = 100.0
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _moe_loads(run_dir) -> list[list[list[float]]]:
    """Each logged step's routed pairs per layer per expert (summed over the data ranks)."""
    return [json.loads(line)["moe_load"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"moe_load"' in line]


@pytest.mark.parametrize("winners", [(0, 1), (2, 3)], ids=["to-rank0", "to-rank1"])
def test_ep2_with_every_token_on_one_ranks_experts_matches_one_process(token_dir, tmp_path, winners):
    """ep=2 holds experts 0-1 on rank 0 and 2-3 on rank 1; all tokens of both ranks go to one
    rank's pair, so the other rank receives (and computes, and sends back) zero rows while its
    peer gets every row, forward and backward; either way round, the result is one process's."""
    cfg = tiny_config(token_dir, tmp_path / "run", *BIAS, "parallel.ep=2")
    cfg.checkpoint.init_from = _init_routing_to(cfg, winners, tmp_path / "init.safetensors")
    done = train_job(cfg, LaunchSpec(nproc=2))
    got = assert_matches_reference(done, f"ep2 all tokens to experts {winners}")
    idle = [e for e in range(4) if e not in winners]
    pairs = cfg.run.global_batch * cfg.model.seq_len  # each token once per winner (top_k = 2)
    loads = _moe_loads(tmp_path / "run")
    assert loads and all(row == [pairs if e in winners else 0 for e in range(4)]
                         for step in loads for row in step), loads
    # the idle experts never saw a row: plain SGD left them exactly as they started
    start = load_file(cfg.checkpoint.init_from)
    experts = [k for k in got if ".experts." in k]
    assert len(experts) == 3 * cfg.model.n_layer
    for k in experts:
        assert torch.equal(got[k][idle], start[k][idle]), k
        assert not torch.equal(got[k][list(winners)], start[k][list(winners)]), k


@pytest.mark.parametrize("layout", [(), ("parallel.dp_shard=2", "parallel.zero=2")],
                         ids=["ddp", "fsdp-zero2"])
def test_bias_balance_over_two_data_ranks_matches_one_process(token_dir, tmp_path, layout):
    """Two data-parallel ranks, each routing half the global batch: the bias step after each
    update sees the loads of both (all_reduce over dp), so the bias, and the routing it steers,
    are the one-process run's on whole batches. A rank's own loads would move it otherwise: under
    DDP every rank would take rank 0's (DDP broadcasts buffers before each forward), under FSDP
    each its own. 8 experts, so that some rank's count of some expert falls on the other side of
    the mean from the global count (with 4, rank 0's happen to agree over these 4 steps); a bias
    rate (0.01) large against the scores' spread, so the bias changes routing within the run."""
    cfg = tiny_config(token_dir, tmp_path / "run", *BIAS, "moe.n_experts=8", "moe.bias_rate=0.01",
                      *layout)
    done = train_job(cfg, LaunchSpec(nproc=2))
    got = assert_matches_reference(done, "dp2 balance=bias")
    bias = [got[k] for k in got if k.endswith("router.expert_bias")]
    assert len(bias) == cfg.model.n_layer
    for b in bias:  # moved, by whole steps of the rate
        steps = b / 0.01
        assert steps.abs().sum() >= 1 and torch.allclose(steps, steps.round(), atol=1e-4), b


def test_mixtral_run_exports_through_the_cli_to_transformers(token_dir, tmp_path, monkeypatch):
    """A Mixtral-shaped run (llama family, a moe section, experts at model.ffn_hidden) trained
    by `allhands train`, exported by `allhands export --format hf`, opens offline as
    MixtralForCausalLM whose fp32 logits are our trained model's."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from allhands.checkpoint import committed, load_weights
    from allhands.cli import main
    from allhands.config import load_config
    from test_hf_families import _logits, _sets

    run, out = tmp_path / "run", tmp_path / "hf"
    c = tiny_config(token_dir, run, "model.family=llama", "model.n_kv_head=1", "model.ffn_hidden=48",
                    "moe.n_experts=4", "moe.top_k=2", "moe.balance=aux", "run.steps=2",
                    "optim.warmup_steps=0")
    assert main(["train", "--nproc", "1", *[a for item in _sets(c) for a in ("--set", item)]]) == 0
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0

    hf = transformers.MixtralForCausalLM.from_pretrained(out, local_files_only=True,
                                                         dtype=torch.float32).eval()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    assert (hf.config.num_local_experts, hf.config.num_experts_per_tok) == (4, 2)
    done = load_config(run / "config.resolved.toml")
    ours = load_weights(build_reference_model(done, 257), committed(run / "checkpoints")[-1][1]).eval()
    torch.manual_seed(done.run.seed)  # trained: not the weights the run started from
    init = build_reference_model(done, 257).state_dict()
    assert not torch.equal(ours.state_dict()["blocks.0.mlp.experts.gate_proj"],
                           init["blocks.0.mlp.experts.gate_proj"])
    ids = torch.randint(0, 257, (2, done.model.seq_len), generator=torch.Generator().manual_seed(0))
    want = _logits(ours, ids).float()
    assert (_logits(hf, ids) - want).abs().max() <= 1e-5

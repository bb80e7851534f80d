"""Muon (optim.name=muon): torch.optim.Muon's update on the hidden matrices and torch's AdamW on
the rest, in one optimizer; distributed, each rank orthogonalizes a share of the matrices (the
pieces gathered to their owner, the results scattered back) and every layout trains the model of
one process; its state reshards like AdamW's."""

from __future__ import annotations

import copy
import os
import shutil
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.optim._muon import _zeropower_via_newtonschulz

from allhands.launch.launcher import LaunchSpec, train_job
from allhands.models.gpt import GPT, GPTConfig
from allhands.muon import NS_COEFFICIENTS, Muon, muon_matrices, newton_schulz
from allhands.optim import build_optimizer

from conftest import tiny_config
from test_parity import assert_matches_reference, max_rel_diff, trained_params

MUON = ["optim.name=muon", "optim.muon_ns_dtype=float32"]


def test_the_update_is_torch_muons_and_the_rest_torch_adamw():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(newton_schulz(g, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(24, 3))
    ref = copy.deepcopy(net)
    ours = Muon([{"params": [net[0].weight, net[1].weight], "muon": True},
                 {"params": [net[0].bias, net[1].bias]}], lr=0.01, weight_decay=0.1, ns_dtype="bfloat16")
    theirs = [torch.optim.Muon([ref[0].weight, ref[1].weight], lr=0.01, weight_decay=0.1,
                               adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW([ref[0].bias, ref[1].bias], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))]
    for step in range(3):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step))
        for model, opts in ((net, [ours]), (ref, theirs)):
            model(x).pow(2).sum().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert ours.stats["matrices"] == 6


def test_muon_takes_the_hidden_matrices_not_embeddings_head_or_norms(token_dir, tmp_path):
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, seq_len=8, bias=True))
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon_matrices(model)) == sorted(
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    opt = build_optimizer(model, tiny_config(token_dir, tmp_path, *MUON))
    # the two embeddings (the head is tied to one) decay under AdamW, norms and biases do not
    assert [len(g["params"]) for g in opt.param_groups] == [8, 2, len(list(model.parameters())) - 10]
    assert [g["muon"] for g in opt.param_groups] == [True, False, False]


# --------------------------------------------------------------------------- the exchange itself

SHAPES = [(24, 16), (9, 24), (16, 9), (16, 16), (5, 16)]  # uneven shards among them (9, 5 rows)


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for o, i in SHAPES])


def _train(net, opt, rank: int = 0, world: int = 1) -> None:
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        part = x.chunk(world)[rank]
        (net(part).pow(2).mean() / world).backward()
        opt.step()
        opt.zero_grad()


def _rank(rank: int, world: int, port: int, spread: bool, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    net = _net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = Muon([{"params": list(net.parameters()), "muon": True}], lr=0.02, ns_dtype="float32",
               spread=spread)
    _train(net, opt, rank, world)
    torch.save({"params": [p.full_tensor() for p in net.parameters()], "stats": opt.stats},
               os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    os._exit(0)  # no teardown: gloo's threads can abort a process exiting normally (SIGABRT)


@pytest.mark.parametrize("spread", [True, False], ids=["spread", "every-rank-all"])
def test_sharded_matrices_are_orthogonalized_by_one_owner_each(tmp_path, spread):
    """FSDP2 over 2 ranks (uneven shards among them): with the spreading each rank
    orthogonalizes a share of the matrices, balanced by cost, and sends the others less than an
    all-gather of them would; without it every rank does every one. Both equal one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, spread, str(tmp_path)), nprocs=2, start_method="spawn")
    ref = _net()
    opt = Muon([{"params": list(ref.parameters()), "muon": True}], lr=0.02, ns_dtype="float32")
    _train(ref, opt)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for a, b in zip(got[0]["params"], ref.parameters()):
        assert float((a - b.detach()).norm() / b.detach().norm()) <= 1e-5
    counts = [g["stats"]["matrices"] / g["stats"]["steps"] for g in got]
    flops = [g["stats"]["ns_flops"] for g in got]
    sent = sum(g["stats"]["bytes_sent"] for g in got) / 3
    matrix_bytes = 4 * sum(o * i for o, i in SHAPES)
    if spread:
        assert sum(counts) == len(SHAPES) and min(counts) >= 2, counts
        assert max(flops) / sum(flops) <= 0.6, flops  # about half each
        # each rank sends its half of the other's matrices and their results back: one matrix
        # set in all per step, where gathering every matrix everywhere is that too at 2 ranks
        assert sent == pytest.approx(matrix_bytes, rel=0.02), (sent, matrix_bytes)
    else:
        assert counts == [len(SHAPES)] * 2
        assert sent == pytest.approx(matrix_bytes, rel=0.02)


# --------------------------------------------------------------------------- layouts

LAYOUTS = {
    "ddp": (2, []),
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero=1"]),
    "zero2": (2, ["parallel.dp_shard=2", "parallel.zero=2"]),
    "zero3": (2, ["parallel.dp_shard=2", "parallel.zero=3"]),
    "zero3-unspread": (2, ["parallel.dp_shard=2", "parallel.zero=3", "optim.muon_spread=false"]),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_replicate=1"]),
    "hsdp": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3"]),
    "zero3+tp2": (4, ["parallel.dp_shard=2", "parallel.zero=3", "parallel.tp=2"]),
    "pp2+ddp": (4, ["parallel.pp=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_trains_the_single_process_model_under_every_layout(token_dir, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    cfg = tiny_config(token_dir, tmp_path / "run", *MUON, *extra)
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=nproc)), layout, 1e-5)


def test_a_zero3_muon_checkpoint_resumes_on_one_process(token_dir, tmp_path):
    """Saved under ZeRO-3 on 2 ranks at step 2, continued to step 4 there and on 1 process: DCP
    reshards the momentum buffers and the AdamW moments, and both reach the same parameters."""
    common = [*MUON, "run.steps=4", "checkpoint.interval=1", "checkpoint.keep_last=5"]
    zero3 = ["parallel.dp_shard=2", "parallel.zero=3"]
    full = tmp_path / "full"
    done = train_job(tiny_config(token_dir, full, *zero3, *common), LaunchSpec(nproc=2))
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for step in (3, 4):
        shutil.rmtree(cut / "checkpoints" / f"step-{step:08d}")
    one = train_job(tiny_config(token_dir, cut, *common), LaunchSpec(nproc=1), resume=str(cut))
    diff = max_rel_diff(trained_params(one), trained_params(done))
    assert diff <= 1e-5, diff


def test_muon_with_parameter_servers_is_refused_in_one_line(token_dir, tmp_path):
    from allhands.config import validate
    from allhands.errors import ConfigError
    with pytest.raises(ConfigError, match="optim.name.*muon needs whole matrices"):
        validate(tiny_config(token_dir, tmp_path, "optim.name=muon", "parallel.sync=ps"))


def test_the_planner_prices_muons_state_newton_schulz_and_exchange():
    """ZeRO-3 over 8 A100s, a 24-layer GPT: Muon's state is AdamW's less 4 bytes per hidden
    parameter (shared by 8), its step pays the Newton-Schulz FLOPs / 8 and an exchange of two
    7/8 x 1/8 shares of the matrices; without the spreading it pays every FLOP and an all-gather."""
    from allhands.config import Config, apply_override
    from allhands.plan.cluster import parse_cluster
    from allhands.plan.decoder import Decoder
    from allhands.plan.estimate import Layout, estimate

    def cfg(*extra):
        c = Config()
        for item in ("model.n_layer=24", "model.n_embd=1024", "model.n_head=16", "model.seq_len=1024",
                     "run.global_batch=64", *extra):
            apply_override(c, item)
        return c

    cluster, layout = parse_cluster("a100:1"), Layout(1, 8, 1, 1, 3)
    adamw, muon, flat = (estimate(cfg(*x), layout, cluster, True)
                         for x in ([], ["optim.name=muon"], ["optim.name=muon", "optim.muon_spread=false"]))
    c = 1024
    hidden = 24 * (3 * c * c + c * c + 2 * 4 * c * c)  # qkv, proj, fc, proj per block
    assert adamw.state_rank[0] - muon.state_rank[0] == pytest.approx(4 * hidden / 8, rel=1e-9)
    flops = 24 * 5 * sum(4 * min(i, o) ** 2 * max(i, o) + 2 * min(i, o) ** 3
                         for i, o, _ in Decoder.of(cfg().model).matmuls())
    rate = cluster.peak(True) * cluster.gemm_eff
    extra = muon.time["optimizer"] - adamw.time["optimizer"]
    exchange = extra - flops / 8 / rate
    assert exchange > 0 and exchange == pytest.approx(2 * 7 / 8 * 4 * hidden / 8 / cluster.intra_bw
                                                      + 2 * cluster.latency, rel=0.05)
    assert flat.time["optimizer"] - adamw.time["optimizer"] > 4 * extra  # 8x the FLOPs, 4x the bytes
    assert muon.time["step"] - adamw.time["step"] == pytest.approx(extra, rel=1e-9)

"""The loss under tensor parallelism is vocabulary-parallel (torch's ``loss_parallel``, as
torchtitan): the output head hands the loss a DTensor sharded on the vocabulary, each rank
holding ``(B, T, V/tp)``, instead of the ``(B, T, V)`` logits all-gathered to every tp rank, and
training still ends where one process does, for the plain mean and for the token mean over a
loss mask (targets of -100 ignored)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard

from allhands.job import Job, TokenMeanLoss, build_reference_model, lm_loss
from allhands.jobcheck import checked_loss
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.data import GlobalSampler, load_training_data
from allhands.models import GPT, GPTConfig
from allhands.parallel.tensor import resolve_plan

from conftest import tiny_config
import test_instruct_data as instruct
from test_parity import assert_matches_reference, max_rel_diff, reference_params, trained_params

# The instruction data's fixtures (a tokenizer directory, the prepared examples), found here by name
tok_dir, instruct_dir = instruct.tok_dir, instruct.instruct_dir

VOCAB = 257  # the token shards' byte vocabulary: tp=2 shards it unevenly (129 + 128 rows)


def _head(plan):
    style = plan["lm_head"]
    return tuple(style.output_layouts), style.use_local_output


def test_family_plans_keep_the_heads_output_sharded_on_the_vocabulary():
    gpt = GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=2, n_embd=8))
    assert _head(resolve_plan(gpt, None, True, loss_parallel=True)) == ((Shard(-1),), False)
    assert _head(resolve_plan(gpt, None, True)) == ((Replicate(),), True)
    cfg = tiny_config(Path("unused"), Path("unused"), "model.family=llama", "model.n_kv_head=2")
    with torch.device("meta"):
        llama = build_reference_model(cfg, VOCAB)
    assert _head(resolve_plan(llama, None, False, loss_parallel=True)) == ((Shard(-1),), False)
    # a plan the user gives decides its head itself
    own = {"lm_head": resolve_plan(gpt, None, True)["lm_head"]}
    assert resolve_plan(gpt, own, True, loss_parallel=True) == own


def test_the_default_losses_take_sharded_logits_and_a_users_does_not():
    assert lm_loss.vocab_parallel and TokenMeanLoss().vocab_parallel
    assert not getattr(checked_loss(lm_loss), "vocab_parallel", False)


# ---------------------------------------------------------------- processes

RECORDED: list[bool] = []  # one model per worker is hooked: the trained one, built first


def recording_model(cfg):
    """The reference model; its output in the first training forward (what the loss is handed)
    is described in RUN_DIR/logits-<rank>.json. The FLOP counter builds a second copy later."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = build_reference_model(cfg, VOCAB)
    if RECORDED:
        return model
    RECORDED.append(True)

    def record(module, inputs, out):
        path = Path(cfg.run.dir) / f"logits-{dist.get_rank()}.json"
        if not torch.is_grad_enabled() or path.exists():  # the first evaluation runs before
            return
        local = out.to_local() if isinstance(out, DTensor) else out
        path.write_text(json.dumps({
            "dtensor": isinstance(out, DTensor),
            "placements": [str(p) for p in out.placements] if isinstance(out, DTensor) else [],
            "local": list(local.shape), "global": list(out.shape)}))

    model.register_forward_hook(record)
    return model


def test_tp_loss_sees_a_vocabulary_shard_and_trains_like_one_process(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.tp=2", "parallel.dp_replicate=1",
                      "run.micro_batches=2")
    done = train_job(cfg, LaunchSpec(nproc=2), job=Job(model=recording_model))
    got = assert_matches_reference(done, "tp=2, vocabulary-parallel loss", 1e-5)
    assert torch.equal(got["tok_emb.weight"], got["lm_head.weight"])  # still tied
    seen = [json.loads((Path(done.run.dir) / f"logits-{r}.json").read_text()) for r in range(2)]
    rows = done.run.global_batch // done.run.micro_batches  # one micro-batch, whole on each tp rank
    for s in seen:
        assert s["dtensor"] and s["placements"] in ([str(Shard(2))], [str(Shard(-1))])
        assert s["global"] == [rows, done.model.seq_len, VOCAB]
        assert s["local"][:2] == s["global"][:2]
    # each rank holds its part of the vocabulary, together the whole of it once
    assert sorted(s["local"][2] for s in seen) == [VOCAB // 2, math.ceil(VOCAB / 2)]


def test_tp_token_mean_over_a_loss_mask_trains_like_one_process(instruct_dir, tmp_path):
    """Masked targets (-100) under tp=2 with sequence parallel and 2 micro-batches: the
    vocabulary-parallel token mean trains to the single process's parameters, and the
    evaluation loss is the global token mean too (as the data-parallel layouts' test)."""
    cfg = tiny_config(instruct_dir, tmp_path / "run", *instruct.FT, "parallel.tp=2",
                      "parallel.dp_replicate=1", "run.micro_batches=2", "optim.name=sgd",
                      "optim.lr=0.5")
    done = train_job(cfg, LaunchSpec(nproc=2))
    train, val, vocab = load_training_data(done)
    assert train.masked_targets and vocab != VOCAB
    got = trained_params(done)
    assert max_rel_diff(got, reference_params(done)) <= 1e-5
    model = build_reference_model(done, vocab)
    model.load_state_dict(got)
    idx = GlobalSampler(len(val), done.run.global_batch, done.data.seed + 1).global_batch_indices(0)
    x, y = torch.utils.data.default_collate([val[i] for i in idx])
    assert (y == -100).any()
    with torch.no_grad():
        want = float(lm_loss(model.eval()(x), y))
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines()]
    last = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
    assert abs(last - want) <= 1e-5 * max(1.0, abs(want))

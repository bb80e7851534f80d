"""fault.mode = "replica" with FSDP inside each replica group (HSDP across groups): 2 groups of 2
ranks, one rank of group 1 SIGKILLed inside the cross-group all-reduce. The other group never
restarts; the step is discarded everywhere and redone; the restarted group heals rank by rank
from the survivor; both groups end bit-equal (full tensors from their checkpoints) and equal to a
single-process reference of the batch rule (the global batch is kept) within the parity tolerance.
And with DiLoCo (groups are its replicas): a replica killed between outer syncs and at one; the
survivor discards and redoes the round, heals each replacement, and the global models end
bit-equal. The quorum side of a multi-rank group is tested in-process, with threads on one store."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from allhands.authstore import MACStore, store_key
from allhands.config import replica_group_size, validate
from allhands.errors import ConfigError
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.replica.quorum import ReplicaQuorum

from conftest import tiny_config
from test_parity import max_rel_diff, reference_params
from test_replica import _in_threads, _store, saved


def _ranks_of_group(master, group, n=2, timeout_s=0.3):
    """The ReplicaQuorums of one group's two local ranks (threads of this process), each with its
    own client of the job's store and the group's own 2-rank gloo world, as the workers have."""
    def rank(r):
        local_store = dist.PrefixStore(f"local/{group}/", _client(master))
        world = dist.ProcessGroupGloo(local_store, r, 2, datetime.timedelta(seconds=10))
        return ReplicaQuorum(MACStore(_client(master), store_key("test-secret"), "test store"), group, n,
                             timeout_s=timeout_s, dead_s=30.0, pg_timeout_s=10, local_group=world)
    return _in_threads(lambda: rank(0), lambda: rank(1))


def _client(master):
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_multi_rank_group_is_one_member_and_each_local_rank_reduces_with_its_peers():
    master = _store()
    groups = _in_threads(lambda: _ranks_of_group(master, 0), lambda: _ranks_of_group(master, 1))
    (a0, a1), (b0, b1) = groups
    assert a0.life == a1.life != b0.life == b1.life  # one incarnation per group
    qs = _in_threads(*(lambda q=q: q.form(0) for q in (a0, a1, b0, b1)))
    assert all(q == qs[0] for q in qs) and qs[0].members == (0, 1)
    # local rank L of group 0 and of group 1 hold the same shard: they sum theirs, apart from L'
    grads = [[torch.full((2,), v)] for v in (1.0, 10.0, 2.0, 20.0)]
    oks = _in_threads(*(lambda q=q, g=g: q.allreduce(g, 0) for q, g in zip((a0, a1, b0, b1), grads)))
    assert oks == [True] * 4
    assert [float(g[0][0]) for g in grads] == [3.0, 30.0, 3.0, 30.0]
    assert not any(q.reform for q in (a0, a1, b0, b1))
    # one rank of group 1 failed its all-reduce: the step is discarded by every rank of every group
    verdicts = _in_threads(*(lambda q=q, ok=ok: q._decide(qs[0], 1, ok)
                             for q, ok in zip((a0, a1, b0, b1), (True, True, True, False))))
    assert verdicts == [b"abort"] * 4


def test_hsdp_replica_config_is_accepted_and_sized_by_dp_shard(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path, "fault.mode=replica", "parallel.dp_shard=2", "parallel.zero=3")
    validate(cfg, world_size=4)
    assert replica_group_size(cfg.parallel, 4) == 2
    for extra in (("parallel.dp_shard=2", "parallel.zero=1"),
                  ("parallel.zero=2",), ("sync.compress=powersgd",), ("parallel.tp=2",)):
        with pytest.raises(ConfigError, match="fault.mode=replica"):
            validate(tiny_config(token_dir, tmp_path, "fault.mode=replica", *extra))


def _killed_job(token_dir, tmp_path, capfd, nproc: int, restarts: int, *extra: str):
    """Train a replica-mode job whose group 1 is killed ``restarts`` times (``extra`` says where);
    min_groups=2: the survivor waits in memory for each replacement. Checks that group 0 never
    restarted and group 1 did each time; returns the finished config, run directory and stderr."""
    cfg = tiny_config(token_dir, tmp_path / "run", "fault.mode=replica", f"fault.max_restarts={restarts}",
                      "parallel.timeout_s=30", "fault.quorum_timeout_s=0.5", "fault.min_groups=2", *extra)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    err = capfd.readouterr().err
    run = Path(done.run.dir)
    assert not (run / "logs" / "restarts.jsonl").exists(), err[-3000:]  # group 0 never restarted
    assert len((run / "replicas" / "group-1" / "logs" / "restarts.jsonl").read_text().splitlines()) == restarts
    assert err.count("healed from group 0") >= restarts, err[-3000:]
    return done, run, err


def test_hsdp_kill_one_rank_inside_the_allreduce_only_its_group_restarts(token_dir, tmp_path, capfd):
    # rank 3 = group 1's local rank 1 SIGKILLs itself after the forward of step 3: its group's
    # agent restarts both of its ranks; group 0 (ranks 0, 1) discards the step, waits and heals
    # the replacement, each local rank from its namesake
    done, run, err = _killed_job(token_dir, tmp_path, capfd, 4, 1, "run.steps=5", "parallel.dp_shard=2",
                                 "parallel.zero=3", "fault.inject=3:3:SIGKILL")
    assert "replica groups of 2 worker(s)" in err, err[-3000:]
    assert "replica group 0: step 3 discarded by every member" in err, err[-3000:]
    # both groups' last checkpoints, every model entry (parameters and optimizer state, full
    # tensors: DCP gathers the FSDP shards), bit for bit
    a, b = saved(run), saved(run / "replicas" / "group-1")
    assert int(a["train.step"]) == int(b["train.step"]) == 5
    model_keys = [k for k in a if k.startswith("model.")]
    assert any(k.startswith("model.optim.state.") for k in model_keys), model_keys[:5]
    for k in model_keys:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
    got = {k.removeprefix("model.model."): v for k, v in a.items() if k.startswith("model.model.")}
    ref = reference_params(done, shares=4)  # the global batch in 4 slices, one per rank
    assert set(got) == set(ref), (sorted(got)[:3], sorted(ref)[:3])
    assert max_rel_diff(got, ref) <= 1e-5, max_rel_diff(got, ref)


def test_diloco_groups_a_lost_round_is_redone_and_the_replacement_heals(token_dir, tmp_path, capfd):
    # DiLoCo with H=2 over 2 groups: group 1 dies inside round 3-4 (step 3, between outer syncs)
    # and again at step 6, while group 0 is at or inside the outer sync of round 5-6. Each time
    # group 0 discards the round, rolls back to its start, waits and heals the replacement, and
    # the round is redone by both.
    _, run, err = _killed_job(token_dir, tmp_path, capfd, 2, 2, "run.steps=8", "parallel.sync=diloco",
                              "sync.inner_steps=2", "fault.inject=1:3:SIGKILL,1:6:SIGKILL")
    for step in (4, 6):
        assert f"replica group 0: the outer round ending at step {step} is discarded" in err, err[-3000:]
    a, b = saved(run), saved(run / "replicas" / "group-1")
    assert int(a["train.step"]) == int(b["train.step"]) == 8
    # the global model (the last step is an outer sync: parameters = anchor) and the outer
    # momentum, bit for bit; the inner AdamW moments are each replica's own
    glob = [k for k in a if k.startswith(("model.model.", "sync.anchor.", "sync.momentum."))]
    assert any(k.startswith("sync.momentum.") for k in glob), sorted(a)[:8]
    for k in glob:
        assert torch.equal(a[k], b[k]), k
    for k in (k for k in a if k.startswith("sync.anchor.")):
        assert torch.equal(a[k], a["model.model." + k.removeprefix("sync.anchor.")]), k

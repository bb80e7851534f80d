"""Parameter-server training (ps/client.py): the sharding plan without processes; sync mode against
the single-process reference; async and bounded staleness against their guarantees."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import torch.distributed.checkpoint as dcp

from allhands.checkpoint import committed
from allhands.checkpoint.export import checkpoint_weights
from allhands.checkpoint.safe import SafeFileSystemReader
from allhands.config import ConfigError, validate
from allhands.data import GlobalSampler, load_token_splits
from allhands.data.sampler import collate
from allhands.faults import FaultInjector
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.launch.policy import RestartPolicy
from allhands.report import make_report, read_metrics
from allhands.ps.rows import RowShard, draw_rows
from allhands.ps.server import due_replies
from allhands.ps.wire import plan_shards
from allhands.trainer import Job, build_reference_model

from conftest import tiny_config
from test_parity import (assert_matches_reference, max_rel_diff, reference_params,
                         trained_params)


def test_plan_balances_bytes_and_splits_large_tensors():
    numels, sizes = [1000, 10, 10, 7, 500], [4, 4, 4, 4, 4]
    for servers in (1, 2, 3, 5):
        plan = plan_shards(numels, sizes, servers)
        per = [sum(p.numel * 4 for p in plan if p.server == s) for s in range(servers)]
        assert max(per) - min(per) <= 4, per  # equal to one element
        for i, n in enumerate(numels):  # every element of every parameter exactly once, in order
            mine = [p for p in plan if p.param == i]
            assert mine[0].start == 0 and mine[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
    assert len({p.server for p in plan_shards(numels, sizes, 3) if p.param == 0}) == 2  # split


def test_ps_config_checks(token_dir, tmp_path):
    cfg = tiny_config(token_dir, tmp_path, "parallel.sync=ps", "ps.servers=2")
    with pytest.raises(ConfigError, match="^ps.servers"):
        validate(cfg, world_size=2)
    validate(cfg, world_size=4)  # 2 workers share the batch of 12
    bad = tiny_config(token_dir, tmp_path, "parallel.sync=ps", "ps.mode=sync", "ps.push_every=2")
    with pytest.raises(ConfigError, match="^ps.push_every"):
        validate(bad)
    with pytest.raises(ConfigError, match="^parallel.zero"):
        validate(tiny_config(token_dir, tmp_path, "parallel.sync=ps", "parallel.zero=1"))


def _servers(done) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(done.run.dir) / "ps").glob("server*.json"))]


def _resumed_from(world: Path) -> list[str]:
    """Where each restart of a replica-mode world said it resumes from (its restarts.jsonl)."""
    return [json.loads(line)["resume_from"] for line in (world / "logs" / "restarts.jsonl").read_text().splitlines()]


def test_async_one_worker_is_sequential_training(token_dir, tmp_path):
    """Bit for bit: one thread on both sides, since a CPU kernel's summation order (so its
    rounding) depends on the thread count."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", "run.threads=1")
    done = train_job(cfg, LaunchSpec(nproc=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = reference_params(done)
    finally:
        torch.set_num_threads(threads)
    got = trained_params(done)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_async_loses_no_update(token_dir, tmp_path):
    """Every push applied once; ssp's bound is checked with the table on the meta device below."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", "log.interval=4")
    done = train_job(cfg, LaunchSpec(nproc=3))
    (stats,) = _servers(done)
    assert stats["updates"] == stats["pushes"] == 2 * cfg.run.steps
    assert [len(t) for t in stats["push_t"].values()] == [cfg.run.steps] * 2
    # per-server load and bytes beside the step times, and the staleness histogram in the report
    (line,) = [r for r in read_metrics(Path(done.run.dir)) if "ps_server" in r]
    assert line["ps_pushes"] == stats["pushes"] and line["ps_bytes_in"] == stats["bytes_in"] > 0
    assert 0 < line["ps_load"] <= 1 and line["ps_staleness"] == stats["staleness"]
    assert Path(done.run.dir) / "report" / "ps.png" in make_report(Path(done.run.dir))


def test_sync_mode_matches_single_process_and_resumes_exactly(token_dir, tmp_path):
    """2 workers, 2 servers (the parameters split across them): DDP's update, so the single
    process's parameters. The servers restore their shards (parameters and AdamW state) saved
    at the workers' resume step, so a run resumed from step 2 ends bit for bit where the
    uninterrupted one did."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.servers=2", "run.check_sync=true",
                      "checkpoint.interval=2")
    done = train_job(cfg, LaunchSpec(nproc=4))
    assert_matches_reference(done, "ps sync, 2 workers x 2 servers")
    stats = _servers(done)
    assert [s["updates"] for s in stats] == [cfg.run.steps] * 2
    assert abs(stats[0]["shard_bytes"] - stats[1]["shard_bytes"]) <= 4
    full = Path(done.run.dir)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for d in ("checkpoints", "ps-checkpoints"):
        shutil.rmtree(cut / d / "step-00000004")
    train_job(cfg, LaunchSpec(nproc=4), resume=str(cut))
    a = trained_params(done)
    done.run.dir = str(cut)
    b = trained_params(done)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (cut / "ps-checkpoints" / "step-00000004").is_dir()


def test_replies_wait_only_for_their_round_or_the_staleness_bound():
    """The servers' reply rule (no processes): under sync a pushing worker's reply waits for the
    round, but a pull without a push (a worker's start, after another's first push) goes, else
    both would wait forever; under ssp a worker more than max_staleness ahead of the slowest
    active one waits; under async nobody does."""
    go, keep = due_replies([(1, 1, True), (0, 0, True)], "sync", {1}, [0, 1], {0, 1}, 2)
    assert [src for src, _, _ in go] == [0] and keep == [(1, 1, True)]
    go, keep = due_replies(keep, "sync", set(), [1, 1], {0, 1}, 2)
    assert [src for src, _, _ in go] == [1] and keep == []
    waiting = [(0, 5, True), (1, 4, False)]  # clocks 5, 4 and 2: gaps 3 and 2
    go, keep = due_replies(waiting, "ssp", set(), [5, 4, 2], {0, 1, 2}, 2)
    assert go == [(1, 2, False)] and keep == [(0, 5, True)]
    go, keep = due_replies(waiting, "ssp", set(), [5, 4, 2], {0, 1}, 2)  # worker 2 is done
    assert go == [(1, 0, False), (0, 1, True)] and keep == []  # the slowest first
    go, keep = due_replies(waiting, "async", set(), [5, 4, 2], {0, 1, 2}, 0)
    assert len(go) == 2 and keep == []
    # a restarted server: only the workers that relinked are active; one that has not yet
    # holds nobody back, and once it is active at its clock the bound applies again
    go, keep = due_replies(waiting, "ssp", set(), [5, 4, 0], {0}, 2)
    assert [src for src, _, _ in go] == [1, 0] and keep == []
    go, keep = due_replies(waiting, "ssp", set(), [5, 4, 2], {0, 2}, 2)
    assert [src for src, _, _ in go] == [1] and keep == [(0, 5, True)]


def test_push_fault_is_taken_once_before_the_push_is_cut(tmp_path):
    """Fault ``ps-push`` (no processes): the hook exists only at the push that is to be cut (at
    or after STEP, once per run directory), so a replacement's pushes go whole."""
    assert FaultInjector("1:3:ps-push", 0, tmp_path).push_hook(3) is None  # another worker's
    faults = FaultInjector("1:3:ps-push", 1, tmp_path)
    assert faults.push_hook(2) is None and callable(faults.push_hook(4))
    assert (tmp_path / "faults" / "1-3-ps-push").exists()
    assert FaultInjector("1:3:ps-push", 1, tmp_path).push_hook(5) is None  # fired already


# -- embedding tables moved by row (ps/rows.py)

def _row_step_vs_dense(opt_cls, touched_per_step, **kw):
    """A RowShard stepped with the rows ``touched_per_step`` against torch's dense optimizer on
    the whole table with the same gradients (zero on untouched rows)."""
    torch.manual_seed(0)
    table = torch.randn(10, 3)
    dense = torch.nn.Parameter(table.clone())
    dopt = opt_cls([dense], lr=0.1, **kw)
    shard = RowShard(0, 10, table.clone(), lambda ps: opt_cls(ps, lr=0.1, **kw))
    for ids in touched_per_step:
        ids = torch.tensor(ids)
        g = torch.randn(len(ids), 3)
        dense.grad = torch.zeros(10, 3).index_copy_(0, ids, g)
        dopt.step()
        shard.step(shard.param(ids, g), ids, 0.1)
    return dense.detach(), shard.rows


def test_row_shard_updates_only_touched_rows_as_the_dense_optimizer_would():
    # Adagrad (no weight decay): a zero gradient changes neither a row nor its state, so the
    # lazy row-wise update is the dense one exactly, untouched rows and all.
    steps = [[1, 4, 7], [0, 4], [4, 9, 2]]
    dense, rows = _row_step_vs_dense(torch.optim.Adagrad, steps)
    assert torch.equal(dense, rows)
    # AdamW: the dense update whenever every row is touched...
    dense, rows = _row_step_vs_dense(torch.optim.AdamW, [list(range(10))] * 3, weight_decay=0.1)
    assert torch.equal(dense, rows)
    # ...and lazy otherwise: an untouched row keeps its value (no decay, no momentum).
    torch.manual_seed(0)
    start = torch.randn(10, 3)
    dense, rows = _row_step_vs_dense(torch.optim.AdamW, [[1, 2], [1, 3]], weight_decay=0.1)
    assert torch.equal(rows[5], start[5]) and not torch.equal(dense[5], start[5])
    assert not torch.equal(rows[2], dense[2])  # touched once, then carried by momentum in the dense one


def test_rows_drawn_on_servers_do_not_depend_on_the_server_count():
    whole = draw_rows(0, 10_000, 4, 0.5, seed=3)
    parts = torch.cat([draw_rows(0, 3_000, 4, 0.5, seed=3), draw_rows(3_000, 10_000, 4, 0.5, seed=3)])
    assert torch.equal(whole, parts) and abs(float(whole.std()) - 0.5) < 0.02


def server_tables(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tables of the servers' last checkpoint, ``{parameter index: rows}`` (ps-checkpoints)."""
    _, path = committed(run_dir / "ps-checkpoints")[-1]
    meta = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if ".tables." in k and k.rsplit(".", 1)[1] in ("rows", "start")}
    dcp.load(sd, storage_reader=SafeFileSystemReader(path), no_dist=True)
    pieces: dict[int, list] = {}
    for k, v in sd.items():
        if k.endswith(".rows"):
            param = int(k.split(".tables.")[1].split(".")[0])
            pieces.setdefault(param, []).append((int(sd[k[:-len("rows")] + "start"]), v))
    return {p: torch.cat([v for _, v in sorted(ps, key=lambda x: x[0])]) for p, ps in pieces.items()}


def test_sparse_tables_move_only_touched_rows_and_train_like_the_dense_path(token_dir, tmp_path):
    """Untied token and position embeddings as tables over 2 servers, 2 workers, sync mode:
    every row fetched or pushed is one the worker's batch used (counted against the batches
    themselves), and the parameters equal the single-process dense SGD's. SGD without weight
    decay, as Adagrad, makes the lazy row update the dense one exactly (the unit test above);
    Adagrad here would compare its normalised steps of rounding-noise gradients instead."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.servers=2", "ps.sparse=auto",
                      "optim.name=sgd", "optim.lr=0.5", "optim.weight_decay=0",
                      "model.tie_embeddings=false", "data.eval_batches=0")
    done = train_job(cfg, LaunchSpec(nproc=4))
    train, _, meta = load_token_splits(cfg.data.path, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.global_batch, cfg.data.seed)
    rows = 0  # rows each step's batches use, per worker: distinct tokens, and every position
    for step in range(cfg.run.steps):
        for rank in range(2):
            (idx,) = sampler.local_micro_batches(step, rank, 2, 1)
            x, _ = collate(train, idx)
            rows += len(torch.unique(x)) + x.shape[1]
    stats = _servers(done)
    d = cfg.model.n_embd
    assert sum(s["rows_fetched"] for s in stats) == rows == sum(s["rows_pushed"] for s in stats)
    assert sum(s["row_bytes_out"] for s in stats) == rows * d * 4  # the rows fetched
    assert sum(s["row_bytes_in"] for s in stats) == rows * 8 * 2 + rows * d * 4  # ids twice, grads
    ref = reference_params(done)
    got = trained_params_without_tables(done)
    names = list(ref)
    tables = server_tables(Path(done.run.dir))
    n_dense = len(names) - 2
    got["tok_emb.weight"], got["pos_emb.weight"] = tables[n_dense], tables[n_dense + 1]
    assert tables[n_dense].shape == (meta["vocab_size"], d)
    assert max_rel_diff(got, ref) <= 1e-5
    torch.manual_seed(cfg.run.seed)
    init = build_reference_model(cfg, meta["vocab_size"]).state_dict()
    assert max_rel_diff({"t": got["tok_emb.weight"]}, {"t": init["tok_emb.weight"]}) > 1e-3  # it trained
    assert sum(s["shard_bytes"] for s in stats) == 4 * sum(v.numel() for k, v in ref.items()
                                                           if not k.endswith("emb.weight"))


def trained_params_without_tables(cfg) -> dict[str, torch.Tensor]:
    _, path = committed(Path(cfg.run.dir) / "checkpoints")[-1]
    return checkpoint_weights(path)


TABLE_ROWS = 1 << 20


class ClickModel(torch.nn.Module):
    """A click model whose table is built on the meta device: no worker can hold it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(TABLE_ROWS, 8, mode="sum", device="meta")
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the worker holds only the rows this batch uses, fetched from the servers
        assert all(p.numel() < TABLE_ROWS for p in self.parameters()), "the worker holds the table"
        assert sum(r.shape[0] for _, r in self.emb._ps_table.touched) < 64
        return self.head(self.emb(x)).squeeze(-1)


def click_model(cfg):
    return ClickModel()


def click_data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, TABLE_ROWS, (96, 4), generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] % 2).float())


def click_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)


def test_table_built_on_meta_lives_on_the_servers_only_and_ssp_bounds_staleness(token_dir, tmp_path):
    """An EmbeddingBag built on the meta device trains in ssp mode: the workers never allocate
    it (ClickModel.forward checks), the server draws it and updates the rows pushed, and no
    worker ran more than max_staleness steps ahead of the other."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.sparse=auto", "ps.mode=ssp",
                      "ps.max_staleness=1", "ps.optimizer=Adagrad", "log.interval=4", "data.eval_batches=0")
    done = train_job(cfg, LaunchSpec(nproc=3), job=Job(model=click_model, data=click_data, loss=click_loss))
    (stats,) = _servers(done)
    assert stats["table_bytes"] == TABLE_ROWS * 8 * 4
    assert stats["updates"] == stats["pushes"] == 2 * cfg.run.steps
    assert [len(t) for t in stats["push_t"].values()] == [cfg.run.steps] * 2
    assert max(int(g) for g in stats["clock_gap"]) <= 1
    assert 0 < stats["rows_pushed"] <= 2 * cfg.run.steps * 6 * 4  # 6 samples of 4 ids per step


def test_killed_server_is_recovered_exactly_in_sync_mode(token_dir, tmp_path):
    """SIGKILL of the server (rank 2) while it applies update 3: torch's elastic agent restarts
    every process, the workers resume from the step-2 checkpoint (saved synchronously, so
    committed before step 3) and the server restores its shard saved there, so the job ends on
    the single-process reference. A worker's death takes the same path (every process restarts
    from the checkpoint); the resume's exactness is test_sync_mode_matches_single_process..."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "checkpoint.interval=2",
                      "checkpoint.mode=sync", "data.eval_batches=0", "fault.inject=2:3:SIGKILL",
                      "fault.max_restarts=1", "fault.backoff_s=0")
    done = train_job(cfg, LaunchSpec(nproc=3))
    assert (Path(done.run.dir) / "faults" / "2-3-SIGKILL").exists()
    assert_matches_reference(done, "ps sync, the server killed at update 3")


def test_killed_async_worker_restarts_everyone_and_the_job_finishes(token_dir, tmp_path):
    """Async mode, restart mode: torch's elastic agent stops every process when one dies, so a
    killed worker does not leave the others training; all restart from the last checkpoint (the
    servers from their shards saved there) and the job finishes. Not exact: async updates race."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", "log.interval=4",
                      "checkpoint.interval=2", "checkpoint.mode=sync", "data.eval_batches=0",
                      "fault.inject=0:3:SIGKILL", "fault.max_restarts=1", "fault.backoff_s=0")
    done = train_job(cfg, LaunchSpec(nproc=3))
    run_dir = Path(done.run.dir)
    assert (run_dir / "faults" / "0-3-SIGKILL").exists()
    assert [s for s, _ in committed(run_dir / "checkpoints")][-1] == cfg.run.steps
    (stats,) = _servers(done)
    # every push of the restarted attempt applied, from the step-2 checkpoint (saved synchronously)
    assert stats["pushes"] == stats["updates"] == 2 * (cfg.run.steps - 2)


def test_a_world_logging_apart_says_and_records_where_it_resumes(tmp_path):
    """A replica-mode world logs in a directory of its own (``ps-servers``) but resumes from the
    servers' checkpoints: its restart line and record name their latest committed step, not its
    log directory's (which has none), and when it gives up the fix names the run directory
    ``--resume`` takes, not the world's; without ``checkpoints`` a job keeps RUN/checkpoints."""
    run = tmp_path / "run"
    for step, commit in ((2, True), (4, True), (6, False)):  # step 6: a save cut short, no .metadata
        (run / "ps-checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        if commit:
            (run / "ps-checkpoints" / f"step-{step:08d}" / ".metadata").write_bytes(b"")
    lines: list[str] = []
    job = RestartPolicy(max_restarts=1, backoff_s=0).for_job(
        run / "ps-servers", checkpoints=run / "ps-checkpoints", resume_dir=run, sleep=lambda s: None,
        say=lines.append)
    job.backoff(job.decide("worker rank 0 (pid 1) failed: killed by SIGKILL", progressed=True))
    assert lines[0].endswith("restart 1/1 from checkpoint step 4 after 0.0 s")
    assert _resumed_from(run / "ps-servers") == ["checkpoint step 4"]
    again = job.decide("worker rank 0 (pid 2) failed: killed by SIGKILL", progressed=True)
    assert f"continue from checkpoint step 4 with --resume {run}, or allow more" in job.stop(again)
    assert RestartPolicy().for_job(run / "ps-servers").resume_from().startswith("the start")


def test_killed_async_worker_restarts_alone_and_rejoins(token_dir, tmp_path):
    """Replica mode (launch/psgroups.py): SIGKILL of worker 1 in step 3 of 8, ssp with a bound of
    1. Its own agent restarts it alone: the server and worker 0 keep their processes (the one
    server saw worker 0 join once and worker 1 twice, from two pids) and worker 0 keeps training
    while worker 1 is away (the dead worker no longer paces ssp); the replacement resumes from
    its own step-2 checkpoint, pulls, and pushes steps 3..8. Every push that arrived was applied
    once: the step-3 push never left the dead process, so each worker pushed 8 steps."""
    steps = 8
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=ssp", "ps.max_staleness=1",
                      f"run.steps={steps}", "log.interval=8", "checkpoint.interval=2", "checkpoint.mode=sync", "fault.mode=replica",
                      "fault.inject=1:3:SIGKILL", "fault.max_restarts=1", "fault.backoff_s=0")
    done = train_job(cfg, LaunchSpec(nproc=3))
    run_dir = Path(done.run.dir)
    assert (run_dir / "faults" / "1-3-SIGKILL").exists()
    (stats,) = _servers(done)
    (lost,) = stats["lost"]
    assert lost[0] == 1
    joins = {k: [(life, pid) for w, life, pid, _ in stats["joins"] if w == k] for k in (0, 1)}
    assert [life for life, _ in joins[0]] == [1] and [life for life, _ in joins[1]] == [1, 2]
    assert joins[1][0][1] != joins[1][1][1]  # a new process
    rejoined = [t for w, life, _, t in stats["joins"] if (w, life) == (1, 2)][0]
    assert rejoined > lost[1]
    pushes = {int(k): t for k, t in stats["push_t"].items()}
    assert sum(t > lost[1] for t in pushes[0]) >= steps - 4  # worker 0 went on without worker 1
    assert len(pushes[0]) == len(pushes[1]) == steps and sum(t > rejoined for t in pushes[1]) == steps - 2
    assert stats["updates"] == stats["pushes"] == 2 * steps
    # its restart record names the checkpoint it resumed from, its group's (not its log directory's)
    assert _resumed_from(run_dir / "replicas" / "group-1" / "ps-worker") == ["checkpoint step 2"]
    assert [s for s, _ in committed(run_dir / "checkpoints")][-1] == steps
    assert [s for s, _ in committed(run_dir / "replicas" / "group-1" / "checkpoints")][-1] == steps


def test_killed_server_restarts_alone_and_the_workers_continue(token_dir, tmp_path):
    """Replica mode, async: SIGKILL of the server (rank 2) while it applies update 6. Its own
    world's agent restarts it (a new pid, incarnation 2) and it restores its shard from its last
    committed checkpoint; the workers keep their processes (each linked to the new server as its
    first incarnation), relink, and go on; the job finishes. The restored server applied exactly
    the complete pushes it received, on top of the checkpoint's version."""
    steps = 8
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", f"run.steps={steps}",
                      "log.interval=8", "checkpoint.interval=2", "checkpoint.mode=sync", "data.eval_batches=0",
                      "fault.mode=replica", "fault.inject=2:6:SIGKILL", "fault.max_restarts=1",
                      "fault.backoff_s=0")
    done = train_job(cfg, LaunchSpec(nproc=3))
    run_dir = Path(done.run.dir)
    assert (run_dir / "faults" / "2-6-SIGKILL").exists()
    (stats,) = _servers(done)
    (m1, pid1), (m2, pid2) = stats["incarnations"]
    assert (m1, m2) == (1, 2) and pid1 != pid2 and stats["incarnation"] == 2
    assert sorted((k, life) for k, life, _, _ in stats["joins"]) == [(0, 1), (1, 1)]  # no worker restarted
    step, version = stats["restored"]
    assert step in (2, 4) and version < 6  # a checkpoint saved before the kill (keep_last pruned it since)
    assert _resumed_from(run_dir / "ps-servers") == [f"checkpoint step {step}"]  # the one it restored
    assert stats["updates"] == stats["pushes"] > 0 and stats["version"] == version + stats["updates"]
    assert stats["pushes"] <= 2 * steps
    assert [s for s, _ in committed(run_dir / "checkpoints")][-1] == steps
    assert [s for s, _ in committed(run_dir / "replicas" / "group-1" / "checkpoints")][-1] == steps


def test_worker_killed_mid_push_is_applied_by_no_server_that_missed_part(token_dir, tmp_path):
    """Replica mode, 2 servers: worker 1 is SIGKILLed in the middle of its step-3 push (fault
    ``ps-push``), after server 0 received its whole piece and server 1 only the header. Server 0
    applied that push, server 1 none of it (each server's updates equal the complete pushes it
    received); the replacement resumes from its step-2 checkpoint and pushes steps 3..6 again, so
    server 0 counts one push more than server 1; training goes on to the end."""
    steps = 6
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", "ps.servers=2",
                      f"run.steps={steps}", "log.interval=6", "checkpoint.interval=2", "checkpoint.mode=sync",
                      "data.eval_batches=0", "fault.mode=replica", "fault.inject=1:3:ps-push",
                      "fault.max_restarts=1", "fault.backoff_s=0")
    done = train_job(cfg, LaunchSpec(nproc=4))
    run_dir = Path(done.run.dir)
    assert (run_dir / "faults" / "1-3-ps-push").exists()
    first, second = _servers(done)
    assert [k for k, _ in first["lost"]] == [k for k, _ in second["lost"]] == [1]
    assert first["updates"] == first["pushes"] == 2 * steps + 1
    assert second["updates"] == second["pushes"] == 2 * steps
    assert _resumed_from(run_dir / "replicas" / "group-1" / "ps-worker") == ["checkpoint step 2"]
    assert [s for s, _ in committed(run_dir / "replicas" / "group-1" / "checkpoints")][-1] == steps

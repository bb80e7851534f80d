"""Parameter-server training (sync/ps.py): the sharding plan without processes; sync mode against
the single-process reference; async and bounded staleness against their guarantees."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from allhands.config import ConfigError, validate
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.sync.ps_wire import plan_shards

from conftest import tiny_config
from test_parity import assert_matches_reference, reference_params, trained_params


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


def test_sync_mode_matches_single_process(token_dir, tmp_path):
    """2 workers, 2 servers (the parameters split across them): DDP's update."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.servers=2", "run.check_sync=true")
    done = train_job(cfg, LaunchSpec(nproc=4))
    assert_matches_reference(done, "ps sync, 2 workers x 2 servers")
    stats = _servers(done)
    assert [s["updates"] for s in stats] == [cfg.run.steps] * 2
    assert abs(stats[0]["shard_bytes"] - stats[1]["shard_bytes"]) <= 4


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


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_loses_no_update_and_ssp_bounds_staleness(token_dir, tmp_path, mode):
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", f"ps.mode={mode}",
                      "ps.max_staleness=1", "run.steps=6", "log.interval=6")
    done = train_job(cfg, LaunchSpec(nproc=3))
    (stats,) = _servers(done)
    assert stats["updates"] == stats["pushes"] == 2 * cfg.run.steps
    if mode == "ssp":
        assert max(int(g) for g in stats["clock_gap"]) <= 1


def test_sync_mode_resume_is_exact(token_dir, tmp_path):
    """The servers restore their shards (parameters and AdamW state) saved at the workers' resume
    step, so a run resumed from step 2 ends bit for bit where the uninterrupted one did."""
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "checkpoint.interval=2")
    done = train_job(cfg, LaunchSpec(nproc=3))
    full = Path(done.run.dir)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for d in ("checkpoints", "ps-checkpoints"):
        shutil.rmtree(cut / d / "step-00000004")
    train_job(cfg, LaunchSpec(nproc=3), resume=str(cut))
    a = trained_params(done)
    done.run.dir = str(cut)
    b = trained_params(done)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (cut / "ps-checkpoints" / "step-00000004").is_dir()

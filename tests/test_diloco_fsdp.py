"""DiLoCo and local SGD with FSDP2 inside each replica (the outer sync runs over one mesh
dimension, so FSDP (or plain DDP) inside a host composes with DiLoCo across hosts), and
PowerSGD's error feedback through a resume.

Layout of every FSDP job here: 4 gloo ranks, dp_replicate=2 x dp_shard=2, ``fully_shard`` over
dp_shard only; the outer sync all-reduces each rank's local shards over dp_replicate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from allhands.config import validate
from allhands.errors import ConfigError
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_lowcomm import n_params, step_records
from test_parity import assert_matches_reference, assert_resume_bit_exact, max_rel_diff, trained_params

FSDP_2x2 = ["parallel.dp_replicate=2", "parallel.dp_shard=2"]


def test_diloco_h1_with_fsdp_inside_is_synchronous_sgd(token_dir, tmp_path, zero=3):
    # Inside a replica FSDP's reduce-scatter averages the gradient over its 2 ranks, SGD steps
    # each shard; the outer round (H=1, outer SGD lr 1, no momentum) averages the 2 replicas'
    # shard deltas: one SGD step on the mean gradient of all 4 ranks, i.e. of the global batch.
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=diloco", "sync.inner_steps=1",
                      "sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.outer_nesterov=false",
                      "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0", "run.check_sync=true",
                      "log.interval=1", f"parallel.zero={zero}", *FSDP_2x2)
    done = train_job(cfg, LaunchSpec(nproc=4))
    assert_matches_reference(done, f"DiLoCo(H=1, SGD) over FSDP zero={zero} vs synchronous SGD")
    # Bytes: each rank all-reduces its shard (1/dp_shard of the fp32 model) once per round over
    # the 2 replicas; FSDP's own collectives inside a replica are not the outer sync's.
    size = 4 * n_params(done)
    for r in step_records(done.run.dir):
        assert r["comm_bytes"] == pytest.approx(size / 2)
        assert r["comm_wire_bytes"] == pytest.approx(size / 2 * 2 * (2 - 1) / 2)


def _replica_check_worker(cfg_dict: dict, out: str) -> None:
    """One rank of a training job whose strategy, after every step, gathers each replica's full
    parameters (FSDP all-gather inside the replica, then all_gather across dp_replicate) and
    records whether every replica holds exactly the same ones. Written to OUT/rank<R>.json."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.worker import reported_failures
    from allhands.mesh import Mesh
    from allhands.trainer import Job, Trainer

    with reported_failures():
        cfg, env = Config.from_dict(cfg_dict), worker_env()
        p = cfg.parallel
        mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                          device="cpu", backend="gloo", dp_replicate=p.dp_replicate,
                          dp_shard=p.dp_shard, timeout_s=p.timeout_s)
        trainer = Trainer(cfg, Job(), mesh, Path(cfg.run.dir))
        strategy, seen = trainer.strategy, []
        after_step = strategy.after_step

        def checked(step: int) -> None:
            after_step(step)
            full = torch.cat([q.full_tensor().reshape(-1) for q in trainer.raw_model.parameters()])
            group = mesh.group("dp_replicate")
            replicas = [torch.empty_like(full) for _ in range(group.size())]
            dist.all_gather(replicas, full, group=group)
            seen.append({"step": step, "in_sync": strategy.in_sync(step),
                         "identical": all(torch.equal(r, replicas[0]) for r in replicas)})

        strategy.after_step = checked
        trainer.fit()
        (Path(out) / f"rank{mesh.rank}.json").write_text(json.dumps(seen))
        mesh.destroy()


def test_local_sgd_with_fsdp_leaves_replicas_identical_after_each_sync(token_dir, tmp_path):
    import json

    from allhands.launch.launcher import launch
    from allhands.launch.rundir import resolve_run
    from test_lowcomm import simulate_rounds

    # AdamW inside, one synchronous warm-up step (gradients averaged over the replicas' FSDP
    # shards), then H=2 and a short last round (steps=5): the replicas drift apart between
    # syncs (the check sees it) and hold bit-identical full parameters after each one.
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=local_sgd", "sync.inner_steps=2",
                      "sync.sync_warmup_steps=1", "run.steps=5", "parallel.zero=2", "run.threads=1",
                      *FSDP_2x2)
    cfg = resolve_run(cfg, resume=None, world_size=4)
    out = tmp_path / "out"
    out.mkdir()
    launch(_replica_check_worker, (cfg.to_dict(), str(out)), LaunchSpec(nproc=4), threads=1)
    for rank in range(4):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert [s["step"] for s in seen] == [1, 2, 3, 4, 5]
        assert [s["in_sync"] for s in seen] == [True, True, False, True, True]
        assert all(s["identical"] == s["in_sync"] for s in seen), seen
    # The rounds are local SGD's: the averaged replicas equal an in-process simulation of two
    # replicas, each training on its half of every global batch.
    got, ref = trained_params(cfg), simulate_rounds(cfg, 2)
    diff = max(float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref)
    assert diff <= 1e-5, f"local SGD over FSDP vs simulated replicas: relative difference {diff:.2e}"


def test_diloco_with_fsdp_resume_is_exact(token_dir, tmp_path):
    # AdamW inside, Nesterov outer momentum: stopped after the first round and resumed, the
    # sharded anchor and momentum (DTensors under ``sync``), each replica's sharded inner AdamW
    # moments and the FSDP model come back, so the second round matches bit for bit.
    cfg = tiny_config(token_dir, tmp_path / "full", "parallel.sync=diloco", "sync.inner_steps=2",
                      "run.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=5",
                      "parallel.zero=3", *FSDP_2x2)
    done, a = assert_resume_bit_exact(cfg, 4, tmp_path, drop_step=4, label="resume")
    full = Path(done.run.dir)
    # Resumed on another layout, 2 replicas of one rank each (no sharding): DCP reshards the
    # FSDP model, the DTensor anchor and momentum and each replica's inner AdamW moments into
    # plain tensors. Each replica still sees its half of every global batch, so the second round
    # is the same computation up to the rounding of FSDP's in-replica gradient mean.
    moved = tmp_path / "moved"
    shutil.copytree(full, moved)
    shutil.rmtree(moved / "checkpoints" / "step-00000004")
    other = tiny_config(token_dir, moved, "parallel.sync=diloco", "sync.inner_steps=2",
                        "run.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=5",
                        "parallel.dp_replicate=2", "parallel.dp_shard=1")
    train_job(other, LaunchSpec(nproc=2), resume=str(moved))
    done.run.dir = str(moved)
    diff = max_rel_diff(trained_params(done), a)
    assert diff <= 1e-5, f"resumed as 2 x 1 without FSDP: relative difference {diff:.2e}"


def test_powersgd_resume_is_exact(token_dir, tmp_path):
    # Compression from step 2 on; stopped at step 3 and resumed: the per-rank error-feedback
    # residuals, the warm-started Q factors, the iteration counter and the RNG come back, so
    # steps 4-6 match the uninterrupted run bit for bit (same world size, CPU). DDP rebuilds
    # its buckets after the first backward of each process, so the resumed step 4 runs on other
    # buckets than the saving step 3 did: the state is restored per parameter.
    from allhands.checkpoint.safe import SafeFileSystemReader

    cfg = tiny_config(token_dir, tmp_path / "full", "sync.compress=powersgd",
                      "sync.powersgd_start_step=2", "sync.powersgd_rank=2", "run.steps=6",
                      "checkpoint.interval=3", "checkpoint.keep_last=5")
    done, _ = assert_resume_bit_exact(cfg, 2, tmp_path, drop_step=6, label="resume with PowerSGD")
    saved = SafeFileSystemReader(Path(done.run.dir) / "checkpoints" / "step-00000003").read_metadata().state_dict_metadata
    for rank in (0, 1):  # one residual per rank, one Q for all
        assert any(k.startswith(f"sync.powersgd.error.rank{rank}.") for k in saved)
    assert any(k.startswith("sync.powersgd.q_r2.") for k in saved)


def test_diloco_layout_config_errors(token_dir, tmp_path):
    # What parallel.zero means under diloco/local_sgd/auto: 0 DDP and 2/3 FSDP over dp_shard
    # inside a replica; ZeRO-1 and tp/pp are refused naming the field and the fix.
    def cfg(*extra):
        return tiny_config(token_dir, tmp_path / "r", "parallel.sync=diloco", "sync.inner_steps=1",
                           *extra)

    for zero in (0, 2, 3):
        validate(cfg(f"parallel.zero={zero}", *FSDP_2x2), world_size=4)
    validate(tiny_config(token_dir, tmp_path / "r", "parallel.sync=local_sgd", "sync.inner_steps=1",
                         "parallel.zero=2", *FSDP_2x2), world_size=4)
    with pytest.raises(ConfigError, match=r"^parallel.zero: 1 \(ZeroRedundancyOptimizer\) is not supported "
                                          r"with parallel.sync=diloco; use parallel.zero=2"):
        validate(cfg("parallel.zero=1", *FSDP_2x2), world_size=4)
    with pytest.raises(ConfigError, match=r"^parallel.tp: 2 is not supported with parallel.sync=diloco; "
                                          r"set parallel.tp=1"):
        validate(cfg("parallel.zero=2", "parallel.tp=2", "parallel.dp_replicate=2"), world_size=4)
    with pytest.raises(ConfigError, match=r"^parallel.pp: 2 is not supported"):
        validate(cfg("parallel.pp=2", "parallel.dp_replicate=2"), world_size=4)
    # FSDP inside a replica needs something to shard over
    with pytest.raises(ConfigError, match=r"^parallel.zero: 2 shards over parallel.dp_shard, which is 1"):
        validate(cfg("parallel.zero=2", "parallel.dp_replicate=2"), world_size=2)
    with pytest.raises(ConfigError, match=r"^sync.compress: "):
        validate(cfg("parallel.zero=2", "sync.compress=powersgd", *FSDP_2x2), world_size=4)

"""A run stopped at step k and resumed reaches the same parameters at step K as an uninterrupted
run: bit for bit on CPU fp32. Dropout is on, so this needs every per-rank RNG restored too."""

from __future__ import annotations

import shutil

import torch

from allhands.checkpoint import committed, load_weights
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.job import build_reference_model

from conftest import tiny_config


def weights(cfg, path):
    return load_weights(build_reference_model(cfg, 257), path).state_dict()


def test_resume_is_bit_exact(token_dir, tmp_path):
    full = tmp_path / "full"
    cfg = tiny_config(token_dir, full, "run.steps=6", "checkpoint.interval=3", "checkpoint.keep_last=5",
                      "model.dropout=0.2", "run.micro_batches=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    ckpts = committed(full / "checkpoints")
    assert [s for s, _ in ckpts] == [3, 6]

    # "Stop" at step 3: a copy of the run directory that has only the step-3 checkpoint.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000006")
    resumed = train_job(cfg, LaunchSpec(nproc=2), resume=str(cut))
    assert resumed.run.dir == str(cut)

    a = weights(done, full / "checkpoints" / "step-00000006")
    b = weights(done, cut / "checkpoints" / "step-00000006")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    step3 = weights(done, full / "checkpoints" / "step-00000003")
    assert any(not torch.equal(a[k], step3[k]) for k in a), "resume trained no further step"
    # the resumed run appended steps 4..6 to the copied metrics
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 9


def test_resume_refuses_a_damaged_checkpoint_and_names_the_file(token_dir, tmp_path):
    import pytest

    from allhands.errors import LaunchError

    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, "run.steps=2")
    train_job(cfg, LaunchSpec(nproc=2))
    (_, ckpt), = committed(run_dir / "checkpoints")
    assert (ckpt / "manifest.json").is_file()
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(LaunchError, match=r"CheckpointError: .*__1_0\.distcp"):
        train_job(cfg, LaunchSpec(nproc=2), resume=str(run_dir))
    assert shard.read_bytes() == bytes(data), "the failed resume touched the checkpoint"

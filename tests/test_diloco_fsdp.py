"""DiLoCo and local SGD with FSDP2 inside each replica (issue 5: "the outer sync runs over one
mesh dimension, so FSDP (or plain DDP) inside a host composes with DiLoCo across hosts"), and
PowerSGD's error feedback through a resume.

Layout of every FSDP job here: 4 gloo ranks, dp_replicate=2 x dp_shard=2, ``fully_shard`` over
dp_shard only; the outer sync all-reduces each rank's local shards over dp_replicate."""

from __future__ import annotations

import shutil

import pytest
import torch

from allhands.checkpoint import committed
from allhands.config import validate
from allhands.errors import ConfigError
from allhands.launch import LaunchSpec, train_job

from conftest import tiny_config
from test_lowcomm import n_params, step_records
from test_parity import assert_matches_reference, trained_params

FSDP_2x2 = ["parallel.dp_replicate=2", "parallel.dp_shard=2"]


@pytest.mark.parametrize("zero", [2, 3])
def test_diloco_h1_with_fsdp_inside_is_synchronous_sgd(token_dir, tmp_path, zero):
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

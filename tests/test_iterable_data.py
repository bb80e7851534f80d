"""An IterableDataset through the Python API: the rule of data/iterable.py (step s takes stream
items [sB, (s+1)B), rank r of W the r-th contiguous slice), without processes; and an exact resume
on it, in this process, against the same run uninterrupted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn

import allhands
from allhands.checkpoint import checkpoint_weights, committed
from allhands.config import Config, apply_override
from allhands.data.iterable import StreamSampler, StreamView
from allhands.errors import DataError


class Counting(torch.utils.data.IterableDataset):
    """Yields 0, 1, 2, ... (n items) and counts the passes started over it."""

    def __init__(self, n: int):
        self.n, self.passes = n, 0

    def __iter__(self):
        self.passes += 1
        return iter(range(self.n))


def test_each_rank_keeps_its_contiguous_slice_of_each_step():
    B, W = 6, 3
    sampler = StreamSampler(B)
    for step in range(3):
        shares = [sampler.local_micro_batches(step, r, W, 2) for r in range(W)]
        flat = [i for share in shares for micro in share for i in micro]
        assert flat == list(range(step * B, (step + 1) * B))  # the whole step, once, in order
        assert shares[1] == [[step * B + 2], [step * B + 3]]


def test_a_view_skips_forward_and_starts_a_new_pass_for_earlier_items():
    stream = Counting(20)
    view = StreamView(stream)
    assert [view[i] for i in (7, 8, 12)] == [7, 8, 12] and stream.passes == 1  # resume: skip 0-6
    assert view[0] == 0 and stream.passes == 2  # an evaluation reads its first batch again
    with pytest.raises(DataError, match="ended after 20 items but item 25 is needed"):
        view[25]


class Regression(torch.utils.data.IterableDataset):
    """The same 64 noisy linear samples on every pass (seeded inside __iter__)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        w = torch.linspace(-1, 1, 4)
        for _ in range(64):
            x = torch.randn(4, generator=g)
            yield x, (x @ w + 0.1 * torch.randn((), generator=g)).unsqueeze(0)


def _train(run_dir, resume=None):
    cfg = Config()
    for item in ("run.steps=6", "run.global_batch=8", "checkpoint.interval=3", "run.eval_interval=3",
                 "data.eval_batches=1", "log.progress=false", "log.tensorboard=false", "optim.lr=1e-2",
                 "optim.warmup_steps=1", f"run.dir={run_dir}"):
        apply_override(cfg, item)
    torch.manual_seed(0)
    return allhands.train(cfg, model=lambda c: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                          data=(Regression(), Regression()), loss=nn.functional.mse_loss, resume=resume)


def test_resume_on_a_stream_equals_the_uninterrupted_run(tmp_path):
    whole = _train(tmp_path / "whole")
    cut = tmp_path / "cut"
    _train(cut)
    shutil.rmtree(dict(committed(cut / "checkpoints"))[6])  # as if it had died after step 3's
    resumed = _train(cut, resume=str(cut))
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 3, "resumed": True}.items() <= next(r for r in rows if r.get("resumed")).items()
    assert resumed["loss"] == whole["loss"] and resumed["eval_loss"] == whole["eval_loss"]
    a = checkpoint_weights(committed(tmp_path / "whole" / "checkpoints")[-1][1])
    b = checkpoint_weights(committed(cut / "checkpoints")[-1][1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "tokens_per_s" not in whole and whole["samples_per_s"] > 0  # rows, not tokens

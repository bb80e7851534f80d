"""The hang watchdog does not take a long first step (caches, buckets, torch.compile) for a hang:
the first step of every start and restart has its own, longer limit, fault.first_step_timeout_s;
a hang in a later step is still caught within fault.hang_timeout_s."""

from __future__ import annotations

import json
import time

import pytest
import torch.nn as nn

from allhands.heartbeat import find_hang
from allhands.job import Job, build_reference_model
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config

ALIVE = lambda pid: True  # noqa: E731


def beat(step: int, at: float, first: int = 0) -> tuple:
    return (100, step, at, "host", False, first)  # pid step time host done first


def test_the_first_step_is_judged_by_its_own_limit():
    now = 1000.0
    for step in (0, 1):  # the resumed step, then 'working on' the first: no step completed yet
        first = {0: beat(step, now - 50)}
        assert find_hang(first, now, 10, ALIVE, first_step_timeout=60) == []
        (h,) = find_hang(first, now, 10, ALIVE, first_step_timeout=40)
        assert "fault.first_step_timeout_s=40" in h.describe(10)
        assert find_hang(first, now, 10, ALIVE, first_step_timeout=0) == []  # no limit
        assert find_hang(first, now, 10, ALIVE, first_step_timeout=5)  # never below hang_timeout_s
    (h,) = find_hang({0: beat(2, now - 50)}, now, 10, ALIVE, first_step_timeout=60)  # step 1 done
    assert "(fault.hang_timeout_s=10)" in h.describe(10)
    resumed = {0: beat(41, now - 50, first=40), 1: beat(41, now - 1, first=40)}
    assert find_hang(resumed, now, 10, ALIVE, first_step_timeout=60) == []


FIRST_STEP_S = 3.0  # longer than hang_timeout_s below
_slept = False


class SlowFirstStep(nn.Module):
    """The reference GPT whose first training step in each process takes FIRST_STEP_S longer,
    as a first step that compiles does (not the FLOP count on meta tensors, not evaluation)."""

    def __init__(self, cfg):
        super().__init__()
        self.inner = build_reference_model(cfg, 257)

    def forward(self, x, *args, **kw):
        global _slept
        if self.training and not x.is_meta and not _slept:
            _slept = True
            time.sleep(FIRST_STEP_S)
        return self.inner(x, *args, **kw)


def slow_first_step(cfg) -> nn.Module:
    return SlowFirstStep(cfg)


@pytest.mark.serial  # how soon the hang is named
def test_a_slow_first_step_runs_and_a_later_hang_is_caught(token_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, "run.steps=6", "checkpoint.interval=2", "fault.backoff_s=0.1",
                      "fault.hang_timeout_s=2", "fault.first_step_timeout_s=60", "fault.inject=1:4:hang",
                      "fault.max_restarts=1")
    train_job(cfg, LaunchSpec(nproc=2), job=Job(model=slow_first_step))
    events = [json.loads(x) for x in (run_dir / "logs" / "restarts.jsonl").read_text().splitlines()]
    # one failure: the hang at step 4; neither attempt's slow first step was taken for one
    assert [e["verdict"] for e in events] == ["restart"] and events[0]["hang"], events
    assert "worker rank 1" in events[0]["summary"] and "hang_timeout_s=2)" in events[0]["summary"]
    assert "first_step" not in events[0]["summary"]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in x]
    assert steps[-1] == 6

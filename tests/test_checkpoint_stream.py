"""An async save's copy to host memory is ordered after the compute stream (saver.py
``stage_after_compute``): on an accelerator DCP's stager copies on a stream of its own, and
without a wait it could read parameters the optimizer step is still writing. This CPU has no
stream: the CUDA branch runs against stand-in stream objects that record what they are asked."""

from __future__ import annotations

import torch

from allhands.checkpoint import Checkpointer, ModelOptimState, TrainState
from allhands.checkpoint.saver import stage_after_compute


class FakeStream:
    """A copy stream on ``cuda:0`` that records the streams it was told to wait for."""

    device = torch.device("cuda", 0)

    def __init__(self, log: list):
        self.log = log

    def wait_stream(self, other) -> None:
        self.log.append(("wait", other))


def _compute_stream(log: list):
    def current_stream(device=None):
        log.append(("current_stream", device))
        return "compute stream"
    return current_stream


def test_the_copy_stream_waits_for_the_compute_stream_of_its_device(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.accelerator, "current_stream", _compute_stream(log))
    stager = type("Stager", (), {})()
    stager._staging_stream = FakeStream(log)
    stage_after_compute(stager)
    assert log == [("current_stream", torch.device("cuda", 0)), ("wait", "compute stream")]


def test_no_stream_no_wait_on_cpu(monkeypatch):
    """DCP's stager makes a stream only where an accelerator is (none here): nothing is asked
    of any stream, and nothing blocks."""
    calls: list = []
    monkeypatch.setattr(torch.accelerator, "current_stream", _compute_stream(calls))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: calls.append("synchronize"))
    ckpt = Checkpointer("unused", rank=0, mode="async")
    stager = ckpt._stager_once()
    assert stager._staging_stream is None
    stage_after_compute(stager)
    ckpt.close()
    assert calls == []


def test_a_stager_without_the_stream_attribute_blocks_instead(monkeypatch):
    """Another torch's stager may keep its stream elsewhere: with an accelerator, the host
    waits for the device rather than staging unordered."""
    calls: list = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: calls.append("synchronize"))
    stage_after_compute(object())
    assert calls == ["synchronize"]


def test_an_async_save_queues_the_wait_before_it_hands_the_state_over(tmp_path, monkeypatch):
    """In ``Checkpointer.save``: the wait is queued on the training thread before ``stage``
    gives the state to the stager's thread (which queues its copies after it); the save then
    commits as ever."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": ModelOptimState(model, opt), "train": TrainState()}
    ckpt = Checkpointer(tmp_path, rank=0, mode="async")
    log: list = []
    monkeypatch.setattr(torch.accelerator, "current_stream", _compute_stream(log))
    stager = ckpt._stager_once()
    stager._staging_stream = FakeStream(log)  # the CPU stager ignores it: its copies are blocking
    stage = stager.stage
    monkeypatch.setattr(stager, "stage", lambda sd, **kw: (log.append(("stage",)), stage(sd, **kw))[1])
    for step in (1, 2):  # the first save (which prepares the directory) and a later one
        ckpt.save(step, state)
        ckpt.wait()
    ckpt.close()
    assert ckpt.failures == 0, ckpt.warnings
    order = [entry[0] for entry in log]
    assert order == ["current_stream", "wait", "stage"] * 2
    assert ckpt.latest()[0] == 2

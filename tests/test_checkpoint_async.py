"""An async save copies the model and optimizer state in the background while the next
forward/backward runs (Checkpointer.before_update waits for the copy before the optimizer step).
The saved state must still be exactly the state at the save step, even when the copy is slow and
training goes on changing everything else. One process, no process group: DCP saves locally."""

from __future__ import annotations

import random
import time

import torch

from allhands.checkpoint import Checkpointer, ModelOptimState, RNGState, TrainState


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)  # running statistics change in forward, not in step

    def forward(self, x):
        return self.norm(self.lin(x))


def _trained(steps: int):
    """A model, its AdamW (with state) and the step counter after ``steps`` steps from seed 0."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ts = TrainState()
    for _ in _train(model, opt, ts, steps):
        pass
    return model, opt, ts


def _train(model, opt, ts, steps):
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        yield  # the point where the trainer calls before_update
        opt.step()
        opt.zero_grad()
        ts.step += 1


def test_async_save_is_the_state_at_the_save_step_while_training_goes_on(tmp_path, monkeypatch):
    model, opt, ts = _trained(2)
    state = {"model": ModelOptimState(model, opt), "train": ts, "rng": RNGState(0)}
    ckpt = Checkpointer(tmp_path, rank=0, mode="async")
    ckpt.save(ts.step, state)  # the first save prepares the directory; wait for it
    ckpt.wait()

    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    expected_rng = torch.get_rng_state()
    saved_step = ts.step
    # A copy to host memory slower than a forward/backward: without before_update, the
    # optimizer step below would land in the checkpoint.
    stager = ckpt._stager_once()
    slow = stager._stage
    monkeypatch.setattr(stager, "_stage", lambda sd, **kw: (time.sleep(0.5), slow(sd, **kw))[1])
    ckpt.save(ts.step, state)
    for _ in _train(model, opt, ts, 3):
        ckpt.before_update()
    random.random()
    ckpt.wait()
    ckpt.close()
    assert ckpt.failures == 0, ckpt.warnings
    assert ts.step == saved_step + 3

    fresh = _Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    for _ in _train(fresh, fresh_opt, TrainState(), 1):  # optimizer state must exist to be loaded
        pass
    back = {"model": ModelOptimState(fresh, fresh_opt), "train": TrainState(), "rng": RNGState(0)}
    step, path = ckpt.latest()
    assert step == saved_step
    ckpt.load(path, back)
    assert back["train"].step == saved_step
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected_model[k]), f"{k} is not the state at the save step"
    for k, v in fresh_opt.state_dict()["state"][0].items():
        assert torch.equal(v, expected_optim[k]), f"optimizer {k} is not the state at the save step"
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_cadence_fixed_interval_and_checkfreq_rule():
    from allhands.checkpoint.cadence import Cadence

    fixed = Cadence(3, 0.0, start_step=4, device=torch.device("cpu"))  # resumed at step 4
    saved = []
    for step in range(5, 14):
        fixed.step_done(0.1, False)
        if fixed.due(step):
            assert fixed.save(step, lambda: saved.append(step)) is None
    assert saved == [6, 9, 12]

    auto = Cadence(5, 0.02, start_step=0, device=torch.device("cpu"))
    notes = []
    for step in range(1, 31):
        # Clean steps take 0.1 s; the two steps after a save 0.1 + 0.9525 s, i.e. one save adds
        # 1.905 s: every 5 * ceil(1.905 / (0.02 * 0.1 * 5)) = 5 * 191 steps keeps it under 2%.
        auto.step_done(0.1 + (0.9525 if step in (6, 7) else 0.0), step in (6, 7))
        if auto.due(step):
            notes.append(auto.save(step, lambda: None))
    assert notes[0] is None  # nothing measured before the first save
    assert auto.interval == 955 and auto.next == 10 + 955
    assert "5 -> 955 steps" in notes[1] and "checkpoint.max_overhead 2%" in notes[1], notes[1]


def test_a_copy_that_fails_to_start_is_a_failed_save_not_a_hang(tmp_path, monkeypatch):
    """The copy starts last in Checkpointer.save; if it cannot start, the write thread
    waiting for it must fail the save, not wait forever."""
    model, opt, ts = _trained(1)
    state = {"model": ModelOptimState(model, opt), "train": ts}
    ckpt = Checkpointer(tmp_path, rank=0, mode="async")
    ckpt.save(ts.step, state)
    ckpt.wait()
    stager = ckpt._stager_once()
    monkeypatch.setattr(stager, "stage", lambda sd, **kw: (_ for _ in ()).throw(MemoryError("no host memory")))
    ts.step += 1
    ckpt.save(ts.step, state)
    ckpt.before_update()
    # Bounded, so that the hang this guards against fails here instead of blocking ckpt.wait.
    assert ckpt._pending.committed.wait(120), "the write thread still waits for a copy that never started"
    ckpt.wait()
    assert ckpt.failures == 1 and "no host memory" in ckpt.warnings[0], ckpt.warnings
    assert ckpt.latest()[0] == ts.step - 1  # the previous checkpoint stays
    assert not list(tmp_path.glob(".tmp-*"))
    ckpt.close()

"""ModelOptimState's fast state dict: the key maps ``get_state_dict`` finds on every call are
learned once, and every later save's state dict is the same as ``get_state_dict``'s (the same
keys, the same tensors, equal values) under every one-rank layout: DDP, ZeRO-1, FSDP2 (ZeRO-2/3),
activation checkpointing's wrapped names, compiled blocks. Multi-rank layouts (tp, pp) learn the
same maps; a mismatch there turns the fast path off for that optimizer (``_learn_keys``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from allhands.checkpoint import ModelOptimState
from allhands.checkpoint import state as state_mod
from allhands.job import build_reference_model, lm_loss
from allhands.mesh import Mesh
from allhands.parallel.layout import build_layout
from allhands.sync import AllReduceSync

from conftest import tiny_config


@pytest.fixture
def one_rank():
    assert not dist.is_initialized()
    mesh = Mesh.build(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo",
                      dp_replicate=1, timeout_s=30)
    yield mesh
    mesh.destroy()


def _slow(part: ModelOptimState) -> dict:
    """The state dict without learned maps: get_state_dict on every part."""
    saved = dict(state_mod._KEYS)
    for _, optim, _ in part._parts():
        state_mod._KEYS[optim] = False
    try:
        return part.state_dict()
    finally:
        for _, optim, _ in part._parts():
            state_mod._KEYS[optim] = saved.get(optim) if optim in saved else None
            if state_mod._KEYS[optim] is None:
                del state_mod._KEYS[optim]


@pytest.mark.parametrize("extra", [["parallel.zero=0"], ["parallel.zero=1"], ["parallel.zero=3"],
                                   ["parallel.zero=2", "parallel.ac=block"],
                                   # the compiled blocks' wrapping, not inductor's kernels, is
                                   # what a state dict sees (test_compile runs inductor)
                                   ["parallel.zero=0", "parallel.ac=block", "run.compile=true",
                                    "run.compile_backend=aot_eager"]])
def test_fast_state_dict_is_get_state_dict(one_rank, token_dir, tmp_path, extra):
    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.dp_replicate=1", *extra)
    torch.manual_seed(0)
    layout = build_layout(cfg, one_rank, build_reference_model(cfg, 96), AllReduceSync(), lm_loss)
    x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        layout.forward_backward(x, torch.roll(x, -1, 1), 1.0)
        layout.after_backward()
        layout.optimizer.step()
        layout.optimizer.zero_grad()
        first = ModelOptimState(*layout.checkpoint_parts()).state_dict()  # learns the maps
    _, optim, _ = layout.checkpoint_parts()
    assert isinstance(state_mod._KEYS.get(optim), state_mod._Keys), "the fast path is off"
    fast = ModelOptimState(*layout.checkpoint_parts()).state_dict()
    slow = _slow(ModelOptimState(*layout.checkpoint_parts()))
    for part in ("model", "optim"):
        assert state_mod._same(fast[part], slow[part]), part
        assert state_mod._same(first[part], slow[part]), part
    # A changed learning rate is read at each save, not learned.
    for g in layout.optimizer.param_groups:
        g["lr"] = 0.123
    fast = ModelOptimState(*layout.checkpoint_parts()).state_dict()
    assert state_mod._same(fast["optim"], _slow(ModelOptimState(*layout.checkpoint_parts()))["optim"])
    assert all(dict(pairs)["lr"] == 0.123 for k, pairs in fast["optim"].items()
               if k.startswith("param_groups."))


def test_new_parameters_relearn_the_maps():
    """Other parameters under the same optimizer (a rebuilt model): the maps are learned again."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    ModelOptimState(model, optim).state_dict()
    learned = state_mod._KEYS[optim]
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim.param_groups[0]["params"] = list(other.parameters())
    optim.state = {q: optim.state[p] for p, q in zip(model.parameters(), other.parameters())}
    sd = ModelOptimState(other, optim).state_dict()
    assert state_mod._KEYS[optim] is not learned and state_mod._KEYS[optim].model() is other
    assert sd["model"]["0.weight"].data_ptr() == other[0].weight.data_ptr()

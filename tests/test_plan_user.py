"""Planning a user's model: built on the meta device from MODULE:BUILDER, its parameters, FLOPs
(FlopCounterMode) and saved activations counted exactly for a small MLP, and its data-parallel
layouts listed by ``allhands plan --model`` with the state memory the ZeRO stages predict."""

from __future__ import annotations

import json

import pytest

from allhands.cli import main
from allhands.config import Config, apply_override
from allhands.errors import ConfigError
from allhands.plan import parse_cluster
from allhands.plan.usermodel import load_builder, measure, parse_input, plan_user


MLP = '''
import torch.nn as nn

def build(cfg):
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
'''
IN, HID, OUT = 64, 256, 10


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usermlp.py").write_text(MLP)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _config(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


def test_user_model_is_counted_on_the_meta_device(user_module):
    cfg = _config("run.global_batch=64")
    shape = measure(load_builder("usermlp:build"), cfg, *parse_input("64", cfg))
    assert shape.params == IN * HID + HID + HID * OUT + OUT and shape.tensors == 4
    # forward 2 m k n per linear; backward: both gradients of the second, only the weight
    # gradient of the first (its input needs none)
    assert shape.flops == 2 * (IN * HID + HID * OUT) + 2 * IN * HID + 4 * HID * OUT
    # saved for backward: the input (first linear) and the ReLU output (ReLU and second linear
    # save the same tensor); the weights are parameters, not activations
    assert shape.activations == 4 * (IN + HID)
    assert shape.largest_child == IN * HID + HID and shape.units == 4
    with pytest.raises(ConfigError, match="--input"):
        parse_input("3xq", cfg)

    est = plan_user(shape, cfg, parse_cluster("a100:1"), bf16=False)
    assert est and all(e.feasible and e.layout.tp == e.layout.pp == 1 and e.layout.world == 8 for e in est)
    steps = [e.time["step"] for e in est]
    assert steps == sorted(steps)
    state = {(e.layout.zero, e.layout.dp_shard): e.state_rank[0] for e in est}
    full = 16 * shape.params + 4 * shape.tensors  # fp32 parameters, gradients, AdamW moments, steps
    assert state[(0, 1)] == full
    assert state[(3, 8)] == pytest.approx(full / 8)
    e0 = next(e for e in est if e.layout.zero == 0)
    assert e0.memory["activations"] == pytest.approx(shape.activations * 64 / 8)


def test_cli_plans_a_user_model(user_module, capsys):  # in-process: no second torch import
    assert main(["plan", "--model", "usermlp:build", "--input", "64", "--cluster", "h100:2", "--json",
                 "--set", "run.global_batch=64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == IN * HID + HID + HID * OUT + OUT
    assert out["layouts"] and all(r["feasible"] for r in out["layouts"])
    assert {r["layout"].split()[1] for r in out["layouts"]} == {"zero0", "zero1", "zero2", "zero3"}

"""Fuzz the config loader: 120 seeded mutations of a valid job file (wrong types, unknown keys,
out-of-range values, broken TOML). Each must exit 2 with one message line, no traceback, and write
nothing."""

from __future__ import annotations

import random

import pytest

from allhands import cli
from allhands.config import Config, to_toml

OUT_OF_RANGE = {
    "optim.lr": "-0.5", "optim.eps": "0", "optim.beta1": "1.0", "optim.beta2": "-0.1",
    "optim.min_lr_ratio": "1.5", "optim.warmup_steps": "-1", "optim.grad_clip": "-1",
    "model.n_layer": "0", "model.n_head": "-2", "model.dropout": "1.5", "model.seq_len": "0",
    "run.steps": "0", "run.global_batch": "-4", "run.micro_batches": "0", "run.device": '"tpu"',
    "run.precision": '"fp8"', "parallel.sync": '"gossip"', "parallel.backend": '"mpi"',
    "checkpoint.keep_last": "0", "log.interval": "0", "run.threads": "-1",
}


def mutate(rng: random.Random, text: str) -> str:
    lines = text.splitlines()
    fields = [i for i, line in enumerate(lines) if " = " in line]
    kind = rng.choice(["type", "unknown", "range", "toml", "section"])
    i = rng.choice(fields)
    key, value = lines[i].split(" = ", 1)
    if kind == "type":
        bad = {'"': "12", "t": '"yes"', "f": '"no"'}.get(value[0], rng.choice(['"text"', "[1, 2]", "{a = 1}"]))
        lines[i] = f"{key} = {bad}"
    elif kind == "unknown":
        lines.insert(i, f"{key}_{rng.randrange(1000)} = 1")
    elif kind == "range":
        path, bad = rng.choice(sorted(OUT_OF_RANGE.items()))
        want_section, name = path.split(".")
        j = next(n for n, line in enumerate(lines) if line == f"[{want_section}]")
        k = next(n for n in range(j, len(lines)) if lines[n].startswith(f"{name} = "))
        lines[k] = f"{name} = {bad}"
    elif kind == "toml":
        lines[i] = rng.choice([f"{key} = ", f"{key} == {value}", f"[{key}", f'{key} = "unterminated'])
    else:
        lines.insert(0, f"[bogus{rng.randrange(100)}]\nx = 1")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", range(120))
def test_mutated_config_exits_2_cleanly(seed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(mutate(random.Random(seed), to_toml(Config())))
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = cli.main(["train", str(job)])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2, (job.read_text(), out.err)
    assert len(lines) == 1 and lines[0].startswith("allhands: error: "), out.err
    assert "Traceback" not in out.err + out.out
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a rejected config wrote a file"

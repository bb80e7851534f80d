"""Mesh and sharding config: every impossible layout fails in validate (before any worker starts)
with its dotted path and the arithmetic; no processes here."""

from __future__ import annotations

import pytest

from allhands.config import Config, ConfigError, apply_override, mesh_sizes, validate


def cfg_with(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


@pytest.mark.parametrize("items,world,sizes", [
    ((), 4, dict(pp=1, dp_replicate=4, dp_shard=1, tp=1)),
    (("parallel.dp_shard=2", "parallel.zero=3"), 4, dict(pp=1, dp_replicate=2, dp_shard=2, tp=1)),
    (("parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.zero=2"), 4,
     dict(pp=1, dp_replicate=1, dp_shard=4, tp=1)),
    (("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=1"), 4,
     dict(pp=1, dp_replicate=2, dp_shard=2, tp=1)),
    (("parallel.zero=3",), 1, dict(pp=1, dp_replicate=1, dp_shard=1, tp=1)),
])
def test_sizes_resolve(items, world, sizes):
    cfg = cfg_with(*items)
    validate(cfg, world_size=world, need_data=False)
    assert mesh_sizes(cfg.parallel, world) == sizes


BAD = [
    (("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3"), 8,
     "parallel: dp_replicate=2 x dp_shard=2 x tp=1 x pp=1 = 4, but the job has 8 workers"),
    (("parallel.dp_shard=3", "parallel.zero=3"), 4,
     "parallel: dp_replicate=-1 x dp_shard=3 x tp=1 x pp=1: the fixed dims multiply to 3, which does "
     "not divide the job's 4 workers"),
    (("parallel.dp_shard=-1",), 4, "parallel.dp_shard: only one mesh dim may be -1"),
    (("parallel.dp_shard=0",), 4, "parallel.dp_shard: 0 is not allowed"),
    (("parallel.dp_shard=2",), 4, "parallel.zero: 0 (plain DDP) replicates everything"),
    (("parallel.zero=2",), 4, "parallel.zero: 2 shards over parallel.dp_shard, which is 1 here"),
    (("parallel.zero=4",), 4, "parallel.zero: 4 is not allowed; allowed: 0 (DDP), 1, 2, 3"),
    (("parallel.ac=full",), 4, "parallel.ac: 'full' is not allowed"),
    (("parallel.reduce_dtype=fp16",), 4, "parallel.reduce_dtype: 'fp16' is not allowed"),
    (("parallel.dp_shard=2", "parallel.zero=3", "run.global_batch=6"), 4,
     "run.global_batch: 6 is not allowed; must be divisible by data-parallel ranks x micro_batches = 4 x 1"),
    (("checkpoint.init_from=/nonexistent/model.safetensors",), 2, "checkpoint.init_from: "),
]


@pytest.mark.parametrize("items,world,message", BAD)
def test_bad_layouts_name_the_field_and_the_arithmetic(items, world, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(*items), world_size=world, need_data=False)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_bad_layout_before_start(capsys, tmp_path, monkeypatch):
    from allhands import cli

    monkeypatch.chdir(tmp_path)
    rc = cli.main(["train", "--nproc", "4", "--set", "parallel.dp_replicate=2", "--set",
                   "parallel.dp_shard=3", "--set", "parallel.zero=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "parallel: dp_replicate=2 x dp_shard=3 x tp=1 x pp=1 = 6, but the job has 4 workers" in err[0]
    assert not (tmp_path / "runs").exists()

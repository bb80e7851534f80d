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


MOE = ("model.family=llama", "moe.n_experts=4")
LLAMA = ("model.family=llama",)
# What ep and cp do to the rank count: expert parallelism borrows the data-parallel ranks (ep is
# no factor of the product and must divide dp_replicate x dp_shard); context parallelism takes
# ranks of its own (cp is a factor). Each message names that and the one setting that fixes it.
BORROWED = [
    ((*MOE, "parallel.dp_replicate=1", "parallel.ep=2"), 2,
     "parallel: dp_replicate=1 x dp_shard=1 x tp=1 x pp=1 = 1, but the job has 2 workers; parallel.ep=2 "
     "adds no ranks (expert parallelism borrows the data-parallel ranks, dp_replicate x dp_shard, which "
     "ep must divide): set parallel.dp_replicate=2"),
    ((*MOE, "parallel.dp_replicate=1", "parallel.zero=3", "parallel.ep=2"), 4,
     "parallel: dp_replicate=1 x dp_shard=1 x tp=1 x pp=1 = 1, but the job has 4 workers; parallel.ep=2 "
     "adds no ranks (expert parallelism borrows the data-parallel ranks, dp_replicate x dp_shard, which "
     "ep must divide): set parallel.dp_shard=4"),
    ((*MOE, "parallel.dp_replicate=1", "parallel.ep=2"), 3,
     "parallel: dp_replicate=1 x dp_shard=1 x tp=1 x pp=1 = 1, but the job has 3 workers; parallel.ep=2 "
     "adds no ranks (expert parallelism borrows the data-parallel ranks, dp_replicate x dp_shard, which "
     "ep must divide): make parallel.dp_replicate a multiple of 2 (on a multiple of 2 workers) or lower "
     "parallel.ep"),
    ((*MOE, "parallel.tp=2", "model.n_kv_head=2", "parallel.ep=2"), 2,
     "parallel.ep: 2 is not allowed; must divide the 1 data-parallel ranks (dp_replicate=1 x dp_shard=1): "
     "expert parallelism borrows them and adds none; make them a multiple of 2 (more workers, or a "
     "smaller parallel.tp or parallel.pp) or lower parallel.ep"),
    ((*MOE, "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3", "parallel.ep=4"), 4,
     "parallel.ep: 4 is not allowed; must divide parallel.dp_shard=2 under zero 3 (the expert ranks are "
     "carved out of the sharding ranks); make parallel.dp_shard a multiple of 4 (e.g. -1 with "
     "parallel.dp_replicate=1) or lower parallel.ep"),
    (("parallel.ep=2",), 2,
     "parallel.ep: 2 needs a mixture-of-experts model (moe.n_experts > 0), but this one is dense; set "
     "moe.n_experts (a multiple of 2) or parallel.ep=1"),
    ((*LLAMA, "parallel.dp_replicate=2", "parallel.cp=2"), 2,
     "parallel: dp_replicate=2 x dp_shard=1 x cp=2 x tp=1 x pp=1 = 4, but the job has 2 workers; "
     "parallel.cp=2 takes ranks of its own (context parallelism splits each data-parallel rank's "
     "sequences over cp more ranks, borrowing none): set parallel.dp_replicate=1"),
    ((*LLAMA, "parallel.dp_replicate=2", "parallel.cp=2"), 3,
     "parallel: dp_replicate=2 x dp_shard=1 x cp=2 x tp=1 x pp=1 = 4, but the job has 3 workers; "
     "parallel.cp=2 takes ranks of its own (context parallelism splits each data-parallel rank's "
     "sequences over cp more ranks, borrowing none): run a multiple of 2 workers with "
     "parallel.dp_replicate=-1 or lower parallel.cp"),
    ((*LLAMA, "parallel.cp=4"), 2,
     "parallel: dp_replicate=-1 x dp_shard=1 x cp=4 x tp=1 x pp=1: the fixed dims multiply to 4, which "
     "does not divide the job's 2 workers; parallel.cp=4 takes ranks of its own (context parallelism "
     "splits each data-parallel rank's sequences over cp more ranks, borrowing none): run a multiple of "
     "4 workers or lower parallel.cp"),
]


@pytest.mark.parametrize("items,world,message", BORROWED)
def test_ep_and_cp_errors_say_whose_ranks_they_use_and_the_fix(items, world, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(*items), world_size=world, need_data=False)
    assert str(e.value) == message


@pytest.mark.parametrize("items,world,message", [b for b in BORROWED if ": set parallel." in b[2]])
def test_the_named_fix_gives_a_valid_layout(items, world, message):
    fix = message.rpartition(": set ")[2]
    cfg = cfg_with(*items, fix)
    validate(cfg, world_size=world, need_data=False)
    sizes = mesh_sizes(cfg.parallel, world)
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    assert dp * sizes.get("cp", 1) * sizes["tp"] * sizes["pp"] == world
    assert dp % cfg.parallel.ep == 0

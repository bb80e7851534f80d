"""``parallel.layout = "auto"`` and the memory check at launch (plan/auto.py): the layout chosen
on the devices found, the fields a user set kept, and a job that cannot fit refused in one line
before any worker starts. A rank's memory is set with ``parallel.memory_gib``, the documented
knob, so that the same tests hold on a host of any size."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import tomllib

import pytest

from allhands.cli import main
from allhands.config import ConfigError, load_config, validate
from allhands.plan.auto import fit

from conftest import ALLHANDS, ROOT, TINY


def _cfg(*items: str):
    return load_config(None, list(items))


def _fit(*items: str, nproc: int = 2) -> tuple:
    said: list[str] = []
    return fit(_cfg(*items), nproc=nproc, say=said.append), said


BIG = ("model.preset=llama3.2-1b", "model.seq_len=256", "run.global_batch=4")  # 1.24B parameters


def test_auto_shards_a_model_that_one_rank_cannot_hold():
    cfg, said = _fit(*BIG, "parallel.layout=auto", "parallel.memory_gib=16")
    p = cfg.parallel
    # plain DDP holds 16 bytes a parameter on every rank, ~20 GB: more than the whole budget
    with pytest.raises(ConfigError, match="under dp2 zero0 on 2 workers needs"):
        _fit(*BIG, "parallel.memory_gib=16")
    assert (p.zero >= 2 and p.dp_shard == 2) or p.tp > 1 or p.pp > 1, p
    validate(cfg, world_size=2, need_data=False)
    assert len(said) == 1 and said[0].startswith("allhands: layout auto: ")
    assert "of 16.0 GiB (parallel.memory_gib)" in said[0] and "that fit" in said[0]


def test_fields_the_user_set_win():
    cfg, said = _fit("parallel.layout=auto", "parallel.zero=3", "parallel.ac=block")
    p = cfg.parallel
    assert (p.zero, p.dp_shard, p.ac) == (3, 2, "block")
    assert "kept parallel.zero, parallel.ac" in said[0]
    cfg, _ = _fit("parallel.layout=auto", "parallel.tp=2", "parallel.zero=2")
    assert (cfg.parallel.tp, cfg.parallel.zero) == (2, 2)


def test_no_layout_fits_is_one_line():
    with pytest.raises(ConfigError) as e:
        _fit(*BIG, "parallel.layout=auto", "parallel.memory_gib=2")
    line = str(e.value)
    assert "\n" not in line and line.startswith("parallel.layout: auto: no layout of 2 workers fits 2.0 GiB")
    assert "the smallest, " in line and "parallel.memory_check=false" in line
    cfg, said = _fit(*BIG, "parallel.layout=auto", "parallel.memory_gib=2", "parallel.memory_check=false")
    assert "none of" in said[0] and "the smallest" in said[0]


def test_the_refusal_names_a_layout_that_fits_and_it_does():
    base = ("model.preset=llama3-8b", "parallel.memory_gib=40")
    with pytest.raises(ConfigError) as e:
        _fit(*base, nproc=8)
    line = str(e.value)
    assert "\n" not in line and "llama3-8b (8.03B parameters) under dp8 zero0 on 8 workers needs" in line
    assert "a rank has 40.0 GiB (parallel.memory_gib)" in line and "a layout that fits: " in line
    sets = line.split("a layout that fits: ")[1].split(": ", 1)[1].split(" (or --layout auto)")[0]
    items = [a for a in shlex.split(sets) if a != "--set"]
    assert items and all(i.startswith("parallel.") for i in items)
    fit(_cfg(*base, *items), nproc=8)  # the suggestion passes the same check
    cfg = fit(_cfg(*base, "parallel.memory_check=false"), nproc=8)  # and the check can be skipped
    assert cfg.parallel.zero == 0


def test_the_tiny_jobs_of_the_tests_pass_the_check_on_this_host():
    for nproc in (1, 2, 4):
        cfg = _cfg(*TINY)
        assert fit(cfg, nproc=nproc) is cfg


def test_invalid_values_are_config_errors():
    for item in ("parallel.layout=fastest", "parallel.memory_gib=-1"):
        with pytest.raises(ConfigError, match=item.split("=")[0]):
            validate(_cfg(item), need_data=False)


def test_a_job_that_cannot_fit_is_refused_before_any_worker(tmp_path, capsys):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    code = main(["train", "--nproc", "2", "--set", "model.preset=llama3-8b", "--set", "parallel.memory_gib=8",
                 "--set", f"run.dir={run_dir}"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [x for x in err.splitlines() if x.startswith("allhands: error:")]
    assert len(errors) == 1 and len(err.strip().splitlines()) == 1, err
    assert "needs" in errors[0] and "a rank has 8.0 GiB" in errors[0] and "no layout of 2 workers fits" in errors[0]
    assert not run_dir.exists()  # no run directory, no checkpoints, no worker
    assert took < 10, took


def test_the_chosen_layout_trains(tmp_path, cli_env):
    run_dir = tmp_path / "auto"
    r = subprocess.run([*ALLHANDS, "train", "examples/configs/tiny.toml", "--layout", "auto", "--nproc", "2",
                        "--set", "run.steps=3", "--set", "run.eval_interval=0", "--set", "log.progress=false",
                        "--set", "checkpoint.interval=0", "--set", f"run.dir={run_dir}"],
                       capture_output=True, text=True, env=cli_env, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    said = [x for x in r.stderr.splitlines() if x.startswith("allhands: layout auto: ")]
    assert len(said) == 1, r.stderr
    resolved = tomllib.loads((run_dir / "config.resolved.toml").read_text())["parallel"]
    assert resolved["layout"] == "auto"
    name = said[0].removeprefix("allhands: layout auto: ").split(",")[0]
    assert f"zero{resolved['zero']}" in name  # the line names the layout the run recorded
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [s["step"] for s in steps] == [3]  # the last step logs (the default: every 10th too)

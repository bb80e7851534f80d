"""Config tree: defaults < TOML < --set; every bad value exits 2 with its dotted path, before
any worker starts."""

from __future__ import annotations

import subprocess

import pytest

from allhands import cli
from allhands.config import Config, ConfigError, load_config, to_toml, validate

from conftest import ALLHANDS


def test_layers_and_round_trip(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text("[optim]\nlr = 0.01\n[run]\nsteps = 7\nname = 'x'\n")
    cfg = load_config(f, ["optim.lr=5e-4", "run.name=1e3", "model.bias=false"])
    assert cfg.optim.lr == 5e-4 and cfg.run.steps == 7 and cfg.run.name == "1e3"
    assert cfg.model.bias is False and cfg.model.n_layer == Config().model.n_layer
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg, with_docs=True))
    assert load_config(out) == cfg


def test_every_field_has_a_doc():
    import dataclasses

    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), sec.name)):
            assert f.metadata.get("doc"), f"{sec.name}.{f.name} has no doc"


BAD = [
    (["--set", "optim.lr=-1"], "optim.lr"),
    (["--set", "run.global_batch=33"], "run.global_batch"),
    (["--set", "run.micro_batches=4", "--set", "run.global_batch=12"], "run.global_batch"),
    (["--set", "data.path=/nonexistent/tokens"], "data.path"),
    (["--set", "model.nope=1"], "model.nope"),
    (["--set", "nosection.x=1"], "nosection"),
    (["--set", "run.steps=many"], "run.steps"),
    (["--set", "run.steps=1.5"], "run.steps"),
    (["--set", "model.n_embd=100", "--set", "model.n_head=3"], "model.n_embd"),
    (["--set", "model.dropout=1.0"], "model.dropout"),
    (["--set", "run.device=tpu"], "run.device"),
    (["--set", "checkpoint.max_overhead=1.5"], "checkpoint.max_overhead"),
    (["--set", "optim.lr"], "--set"),
    (["--nproc", "-1"], "--nproc"),
    (["--nnodes", "2"], "--rdzv-endpoint"),
]


@pytest.mark.parametrize("argv,path", BAD)
def test_bad_values_exit_2_with_the_path(argv, path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("allhands: error: ") and path in err[0], err
    assert not (tmp_path / "runs").exists(), "a failed validation wrote a run directory"


def test_unknown_key_and_broken_toml_in_file(tmp_path, capsys):
    f = tmp_path / "job.toml"
    f.write_text("[optim]\nlearning_rate = 1\n")
    assert cli.main(["config", "show", str(f)]) == 2
    assert "optim.learning_rate: unknown key" in capsys.readouterr().err
    f.write_text("[optim\nlr = 1\n")
    assert cli.main(["config", "show", str(f)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert cli.main(["train", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_validate_allows_the_defaults():
    validate(Config(), world_size=2, need_data=False)
    with pytest.raises(ConfigError, match="run.global_batch"):
        validate(Config(), world_size=3, need_data=False)


def test_config_show_subprocess_exit_codes(cli_env):
    ok = subprocess.run([*ALLHANDS, "config", "show", "--set", "optim.lr=1e-4", "--docs"],
                        capture_output=True, text=True, env=cli_env, timeout=120)
    assert ok.returncode == 0 and "lr = 0.0001" in ok.stdout and "# peak learning rate" in ok.stdout
    bad = subprocess.run([*ALLHANDS, "train", "--set", "optim.lr=-3"], capture_output=True, text=True,
                         env=cli_env, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "optim.lr" in bad.stderr

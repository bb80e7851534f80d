"""What the user sets wins over a preset, whatever its value: a field given in the TOML file or by
``--set`` keeps it, even when it equals the field's default; the preset fills only the fields left
out, and the resolved config (config.resolved.toml, the workers' copy) builds the same model."""

from __future__ import annotations

import pickle

import torch.distributed.checkpoint as dcp

from allhands.checkpoint import committed
from allhands.config import Config, ModelConfig, load_config, to_toml
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.models.build import moe_preset, with_preset
from allhands.models.resolve import resolve_model

from conftest import tiny_config

# llama3-8b: n_layer 32, rope_theta 500000, tie_embeddings false; these are the fields' defaults
AT_DEFAULT = ("model.n_layer=4", "model.rope_theta=10000.0", "model.tie_embeddings=true")


def _shape(m: ModelConfig) -> tuple:
    return m.n_layer, m.rope_theta, m.tie_embeddings, m.n_embd, m.n_kv_head, m.vocab_size


WANT = (4, 10000.0, True, 4096, 8, 128256)  # the user's three, then the preset's


def test_set_fields_win_even_at_their_default():
    cfg = resolve_model(load_config(None, ["model.preset=llama3-8b", *AT_DEFAULT]))
    assert _shape(cfg.model) == WANT
    unset = resolve_model(load_config(None, ["model.preset=llama3-8b"])).model
    assert (unset.n_layer, unset.rope_theta, unset.tie_embeddings) == (32, 500000.0, False)


def test_the_toml_file_counts_as_set(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "llama3-8b"\nn_layer = 4\nrope_theta = 10000.0\n')
    m = resolve_model(load_config(path, ["model.tie_embeddings=true"])).model
    assert _shape(m) == WANT


def test_a_moe_field_set_to_its_default_keeps_it():
    cfg = load_config(None, ["model.preset=mixtral-8x7b", "moe.aux_coef=0.01"])  # the preset's: 0.02
    e = resolve_model(cfg).moe
    assert (e.n_experts, e.top_k, e.aux_coef) == (8, 2, 0.01)


def test_the_resolved_config_builds_the_same_model_everywhere(tmp_path):
    cfg = load_config(None, ["model.preset=llama3-8b", *AT_DEFAULT])
    # a copy made before resolving (train_job's) keeps what was set
    assert _shape(resolve_model(Config.from_dict(cfg.to_dict())).model) == WANT
    resolved = resolve_model(cfg)
    # config.resolved.toml, read back on a resume: every field there is set, to its final value
    path = tmp_path / "config.resolved.toml"
    path.write_text(to_toml(resolved))
    back = load_config(path)
    assert back.model == resolved.model and resolve_model(back).model == resolved.model
    # the workers' copy (pickled to_dict) and `allhands plan` fill the preset again: no change
    worker = Config.from_dict(pickle.loads(pickle.dumps(resolved.to_dict())))
    assert with_preset(worker.model) == resolved.model
    assert moe_preset(worker.model, worker.moe) == resolved.moe
    assert with_preset(resolved.model) == resolved.model


def test_a_section_built_in_python_keeps_its_non_default_values():
    assert with_preset(ModelConfig(preset="llama3-8b", n_layer=2)).n_layer == 2
    assert with_preset(ModelConfig(preset="llama3-8b")).n_layer == 32


def test_a_run_trains_the_depth_that_was_set(token_dir, tmp_path):
    """llama-tiny has 2 blocks; n_layer=4, the default, set by the user, trains 4."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, "model.preset=llama-tiny", "model.n_layer=4",
                      "run.steps=2", "checkpoint.at_end=true")
    train_job(cfg, LaunchSpec(nproc=1))
    assert "n_layer = 4\n" in (run_dir / "config.resolved.toml").read_text()
    (_, path), = committed(run_dir / "checkpoints")
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert any(".blocks.3." in k for k in keys) and not any(".blocks.4." in k for k in keys)

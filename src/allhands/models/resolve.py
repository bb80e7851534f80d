"""Settle what the ``model`` section names before a run starts: the shape of the transformers
directory in ``checkpoint.init_from`` (its config.json), else a preset's. The result is what
config.resolved.toml records, so a resumed run builds the same model without the directory's
help and ``allhands export`` knows the family."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from allhands.config import Config
from allhands.models.build import moe_preset, moe_section, section_of, with_preset
from allhands.models.hf import hf_config, is_hf_dir


def resolve_model(cfg: Config) -> Config:
    """``cfg`` with its model section settled. A config.json field we do not implement is a
    ConfigError naming it; so is an unknown preset."""
    src = cfg.checkpoint.init_from
    if src and is_hf_dir(Path(src)):
        m = cfg.model
        fc, positions = hf_config(Path(src), seq_len=m.seq_len, bias=m.bias, dropout=m.dropout)
        model = section_of(fc, m)
        if model.family == "llama":
            model.seq_len = m.seq_len  # the training length; RoPE needs no table from the file
        model.max_positions = positions
        moe = moe_section(fc.moe, cfg.moe) if model.family == "llama" else cfg.moe
    else:
        model, moe = with_preset(cfg.model), moe_preset(cfg.model, cfg.moe)
    if model == cfg.model and moe == cfg.moe:
        return cfg
    return dataclasses.replace(cfg, model=model, moe=moe)

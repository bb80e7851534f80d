"""Settle what the ``model`` section names before a run starts: the shape of the transformers
directory in ``checkpoint.init_from`` (its config.json), else a preset's. The result is what
config.resolved.toml records, so a resumed run builds the same model without the directory's
help and ``allhands export`` knows the family. Also checked here, before any worker starts: that
the training length fits the directory's positions, and that the prepared data's token ids mean
the same tokens to the directory's tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from allhands.config import Config, parse_mix
from allhands.data.shards import load_meta
from allhands.data.tokenizer import TOKENIZER_FILE, prepared_vocab, vocab_of
from allhands.errors import ConfigError, DataError
from allhands.models.build import moe_preset, moe_section, section_of, with_preset
from allhands.models.hf import hf_config, is_hf_dir
from allhands.models.llama import LlamaConfig


def resolve_model(cfg: Config, say: Callable[[str], None] | None = None) -> Config:
    """``cfg`` with its model section settled. A config.json field we do not implement is a
    ConfigError naming it; so is an unknown preset, and a ``model.seq_len`` beyond the positions
    config.json allows. ``say``: where a warning line goes (None: nowhere)."""
    src = cfg.checkpoint.init_from
    if src and is_hf_dir(Path(src)):
        m = cfg.model
        fc, positions = hf_config(Path(src), seq_len=m.seq_len, bias=m.bias, dropout=m.dropout)
        _check_positions(m.seq_len, fc, positions, say)
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


def _check_positions(seq_len: int, fc, positions: int, say: Callable[[str], None] | None) -> None:
    """``model.seq_len`` against config.json's positions (GPT-2's ``n_positions``, the others'
    ``max_position_embeddings``; 0 when it gives none). GPT-2 learns one embedding per position,
    so there is no row beyond them; RoPE computes any position, but a model has only seen those up
    to its maximum, unless its RoPE scaling (llama3's factor: the only scaling from_hf_config
    accepts) stretches them, which is the one case a longer run only warns about."""
    if not positions or seq_len <= positions:
        return
    key = "max_position_embeddings" if isinstance(fc, LlamaConfig) else "n_positions"
    if isinstance(fc, LlamaConfig) and fc.rope_scaling:
        if say is not None:
            say(f"allhands: warning: model.seq_len={seq_len} is longer than checkpoint.init_from's "
                f"config.json {key}={positions}; its RoPE scaling ({fc.rope_scaling}, factor "
                f"{fc.rope_factor:g}) is meant to stretch the positions, so the run goes on")
        return
    raise ConfigError(f"model.seq_len: {seq_len} is longer than checkpoint.init_from's config.json "
                      f"{key}={positions}, and the model has no RoPE scaling to cover it; set "
                      f"model.seq_len <= {positions}")


def check_tokenizer(cfg: Config) -> None:
    """Before any worker starts: a transformers directory in ``checkpoint.init_from`` that carries
    a tokenizer.json reads the prepared data's ids as the same tokens (unless
    ``data.tokenizer_check=false``); else a ConfigError naming both tokenizers.

    Compared is the token -> id map, and only the data's part of it: every token the data's
    tokenizer knows has the same id in the model's. A hash of tokenizer.json would tell apart
    the same tokenizer saved by two versions of the tokenizers library (key order, merges as
    strings or as pairs, new fields), and a vocabulary size would not tell apart two tokenizers of
    the same size. The map is what an id means to an embedding row; tokens the model has beyond
    the data's (chat tokens an instruct release adds) never occur in the data. Nothing is
    compared when the directory has no tokenizer.json (a SentencePiece tokenizer.model, or none)."""
    src = cfg.checkpoint.init_from
    if not (cfg.data.tokenizer_check and src and is_hf_dir(Path(src))):
        return
    theirs = vocab_of(Path(src) / TOKENIZER_FILE)
    field, path = ("data.mix", parse_mix(cfg.data.mix)[0][0]) if cfg.data.mix else ("data.path", cfg.data.path)
    try:
        meta = load_meta(path)
    except DataError:  # no prepared data there: the data's own check names what is wrong
        return
    ours = prepared_vocab(Path(path), meta)
    if theirs is None or ours is None:
        return
    wrong = next(((tok, i) for tok, i in sorted(ours.items(), key=lambda kv: kv[1])
                  if theirs.get(tok) != i), None)
    if wrong is None:
        return
    tok, i = wrong
    other = {v: k for k, v in theirs.items()}.get(i)
    given = "the byte tokenizer" if meta.get("tokenizer") == "byte" else f"a tokenizer.json of {len(ours)} tokens"
    raise ConfigError(f"{field}: {str(path)!r} was prepared with {given}, but checkpoint.init_from "
                      f"{src!r} has its own tokenizer.json of {len(theirs)} tokens, which reads the "
                      f"data's ids as other tokens (id {i} is {tok!r} in the data, "
                      f"{'no token' if other is None else repr(other)} in the model); prepare the "
                      f"data with --tokenizer {src}, or set data.tokenizer_check=false to train anyway")

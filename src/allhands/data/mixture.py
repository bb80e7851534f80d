"""Training data as the trainer takes it: one prepared directory (``data.path``) or several
mixed by weight (``data.mix``), as one map-style dataset, so that the sample order stays the
GlobalSampler's pure function of (seed, step, global batch): deterministic, independent of
the worker count and exact on resume at any world size, mixture or not.

A mixture of sources with ``n_i`` samples and weights ``w_i`` is a dataset of
``N = sum n_i`` slots: source ``i`` owns ``round(N w_i / sum w)`` of them (largest remainder),
so each epoch of the sampler's permutation draws every source exactly in proportion to its
weight. Slot ``k`` of source ``i`` is that source's sample ``perm_i[k mod n_i]`` under a seeded
permutation: an up-weighted source repeats its samples, a down-weighted one uses a seeded
subset of them per epoch (the same subset every epoch).
"""

from __future__ import annotations

import numpy as np
import torch

from allhands.config import Config, parse_mix
from allhands.data.examples import valid_targets
from allhands.data.shards import load_token_splits
from allhands.errors import ConfigError, DataError


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder, each share >= 1."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [max(1, int(e)) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: int(exact[i]) - exact[i])[:max(0, total - sum(shares))]:
        shares[i] += 1
    return shares


class MixtureDataset(torch.utils.data.Dataset):
    """Sources drawn by weight; see the module docstring."""

    def __init__(self, sources: list, weights: list[float], seed: int):
        self.sources = sources
        self.shares = _shares(sum(len(s) for s in sources), weights)
        self.starts = np.cumsum([0] + self.shares)
        self.perms = [np.random.default_rng([seed, i]).permutation(len(s))
                      for i, s in enumerate(sources)]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def source_of(self, i: int) -> tuple[int, int]:
        """(source, sample index in it) of slot ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        k = i - int(self.starts[s])
        return s, int(self.perms[s][k % len(self.perms[s])])

    def __getitem__(self, i: int):
        s, j = self.source_of(i)
        return self.sources[s][j]

    @property
    def masked_targets(self) -> bool:
        """Whether a source has a loss mask (instruction examples): see job.TokenMeanLoss."""
        return any(getattr(s, "masked_targets", False) for s in self.sources)

    def valid_targets(self, indices: list[int]) -> int:
        return sum(valid_targets(self.sources[s], [j]) for s, j in map(self.source_of, indices))


def load_training_data(cfg: Config):
    """(train, val, vocab_size) of ``data.path`` or ``data.mix``."""
    d = cfg.data
    entries = parse_mix(d.mix) if d.mix else [(d.path, 1.0)]
    loaded = [load_token_splits(path, cfg.model.seq_len, d.packing) for path, _ in entries]
    ids = [meta.get("tokenizer_id", meta["tokenizer"]) for _, _, meta in loaded]
    for (path, _), tid in zip(entries, ids):
        if tid != ids[0]:
            raise DataError(f"data.mix: {path!r} and {entries[0][0]!r} were prepared with different "
                            f"tokenizers; prepare every source with the same --tokenizer")
    vocab = max(meta["vocab_size"] for _, _, meta in loaded)
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's "
                          f"vocabulary {vocab}; use 0 to take it from the data")
    if len(loaded) == 1:
        return loaded[0][0], loaded[0][1], vocab
    weights = [w for _, w in entries]
    return (MixtureDataset([t for t, _, _ in loaded], weights, d.seed),
            MixtureDataset([v for _, v, _ in loaded], weights, d.seed + 1), vocab)

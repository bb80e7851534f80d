"""Token shards: prepare round-trips text, and damaged data is named in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from allhands.data import ByteTokenizer, load_token_splits, prepare
from allhands.data.shards import embedded_text
from allhands.errors import DataError


def test_prepare_round_trips_text(tmp_path):
    docs = ["Many hands make light work.", "Grüße, 世界! ✓", "third\ndocument"] * 8  # > 2 x 129 tokens
    meta = prepare(docs, tmp_path, val_fraction=0.2, shard_tokens=16)
    assert len(meta["splits"]["train"]) > 1  # several shards
    tok = ByteTokenizer()
    stream = np.concatenate([np.fromfile(tmp_path / e["file"], dtype=np.uint16)
                             for split in ("train", "val") for e in meta["splits"][split]])
    pieces, cur = [], []
    for t in stream.tolist():
        if t == tok.eot:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert pieces == docs


def test_samples_are_shifted_windows(tmp_path):
    prepare(["abcdefghijklmnopqrstuvwxyz" * 20], tmp_path, val_fraction=0.1)
    train, val, meta = load_token_splits(tmp_path, seq_len=8)
    x, y = train[3]
    assert x.shape == (8,) and y.shape == (8,)
    assert (x[1:] == y[:-1]).all()
    assert len(train) == (int(json.loads((tmp_path / "meta.json").read_text())["splits"]["train"][0]["tokens"]) - 1) // 8


def test_truncated_shard_is_named(tmp_path):
    prepare(["some text " * 100], tmp_path)
    with open(tmp_path / "train-000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="train-000.bin.*truncated"):
        load_token_splits(tmp_path, seq_len=8)


def test_embedded_corpus_is_real_text_over_1mb():
    text = embedded_text()
    assert len(text.encode()) >= 1_000_000
    words = text.split()
    assert sum(w.lower() in ("the", "a", "of", "is") for w in words) / len(words) > 0.05

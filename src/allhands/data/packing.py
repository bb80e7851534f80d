"""Rows of whole documents (``data.packing``): ``mask`` packs documents into rows and the model
keeps attention inside each one; ``pad`` gives every document a row of its own; ``concat``
(``shards.TokenDataset``) cuts the token stream into windows that cross documents.

A document is its tokens and the end-of-document token after them. Packing is greedy and in
stream order (a row takes the next documents while they fit its ``seq_len + 1`` tokens; a
document longer than a row fills rows of its own, its tail starting the next one), and the rest
of a row is end-of-document tokens. So the rows are a pure function of the shards and
``seq_len``: a map-style dataset that the sampler orders the same on any number of workers.

Targets that would cross a boundary are ignored (``IGNORE``, cross_entropy's ``ignore_index``):
the target of each end-of-document token (the next document's first token, or padding). With
the model's document mask (models/layers.py: ``document_mask``), a row's summed loss is then
the sum of its documents' losses computed one at a time. Shapes: ``x``, ``y`` ``(seq_len,)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from allhands.data.examples import IGNORE
from allhands.errors import DataError

PACKINGS = ("concat", "mask", "pad")


def pack_rows(ends: np.ndarray, n_tokens: int, capacity: int, one_per_row: bool) -> np.ndarray:
    """Rows ``(start, length)`` ``(R, 2)`` over a stream of ``n_tokens`` whose documents end at
    ``ends`` (the end-of-document token's index, ascending); ``capacity`` tokens a row."""
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
    lengths = (ends + 1 - starts) if len(ends) else np.zeros(0, np.int64)
    rows: list[tuple[int, int]] = []
    row_start, row_len = 0, 0
    for s, n in zip(starts.tolist(), lengths.tolist()):
        if one_per_row or row_len + n > capacity:
            if row_len:
                rows.append((row_start, row_len))
            row_start, row_len = s, 0
        while n > capacity:  # a long document: whole rows of it, then its tail
            rows.append((s, capacity))
            s, n = s + capacity, n - capacity
            row_start = s
        row_len += n
    if row_len:
        rows.append((row_start, row_len))
    del n_tokens  # a stream's tail after its last end-of-document token is not a whole document
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset of rows of whole documents over memmapped shards (module docstring)."""

    masked_targets = True  # ignored targets: the trainer averages over the step's counted ones

    def __init__(self, files: list[tuple[Path, int]], dtype: np.dtype, seq_len: int, eot: int,
                 packing: str = "mask"):
        if packing not in ("mask", "pad"):
            raise ValueError(f"packing {packing!r}: PackedDataset packs 'mask' or 'pad' rows")
        self.seq_len, self.eot, self.packing = seq_len, eot, packing
        self.maps, self.rows, self.offsets = [], [], [0]
        for path, n_tokens in files:
            tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))
            rows = pack_rows(np.flatnonzero(tokens == eot), n_tokens, seq_len + 1, packing == "pad")
            if len(rows):
                self.maps.append(tokens)
                self.rows.append(rows)
                self.offsets.append(self.offsets[-1] + len(rows))
        if len(self) == 0:
            raise DataError(f"no whole document (ending in token {eot}) in the shards; data.packing="
                            f"{packing} needs documents separated by the end-of-document token")

    def __len__(self) -> int:
        return self.offsets[-1]

    def documents(self, i: int) -> list[torch.Tensor]:
        """Row ``i``'s documents (each with its end-of-document token), for tests and checks."""
        row = self._row(i)
        ends = (row == self.eot).nonzero().flatten().tolist()
        out, start = [], 0
        for e in ends:
            out.append(row[start:e + 1])
            start = e + 1
        return [d for d in out if len(d) > 1 or int(d[0]) != self.eot]

    def _row(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start, length = self.rows[shard][i - self.offsets[shard]].tolist()
        row = np.full(self.seq_len + 1, self.eot, dtype=np.int64)
        row[:length] = self.maps[shard][start:start + length]
        return torch.from_numpy(row)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self._row(i)
        x, y = row[:-1], row[1:].clone()
        y[x == self.eot] = IGNORE  # the next document's first token, or padding
        return x, y

"""Instruction examples on disk, read as fixed-length rows whose prompt targets carry no loss.

Layout written by ``allhands prepare`` of instruction data (instruct.py)::

    DIR/meta.json     {"format": 1, "kind": "instruct", ..., "pad": ID, "splits": {"train":
                       [{"file": "tokens.bin", "mask": "mask.bin", "index": "index.bin",
                         "first": 0, "examples": N, "tokens": T}], "val": [...]}}
    DIR/tokens.bin    every example's ids, one after another (uint16/uint32)
    DIR/mask.bin      one uint8 per id: 1 where the id is a target the loss is taken on
                      (the response, and the end-of-turn after it), 0 elsewhere
    DIR/index.bin     int64 offsets: example ``k`` is ids ``[index[k], index[k+1])``

Sample ``i`` of a split is one whole example (no packing, so no example attends to another):
its first ``seq_len + 1`` ids, padded with the pad id; ``x = row[:-1]``, ``y = row[1:]`` with
every target that is padding or not in the mask set to -100, the ``ignore_index`` of
``F.cross_entropy``. An example longer than ``seq_len + 1`` ids is cut to that length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from allhands.errors import DataError

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index
TOKENS, MASK, INDEX = "tokens.bin", "mask.bin", "index.bin"


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"instruction data file {str(path)!r} is missing; re-run `allhands prepare`")
    size = path.stat().st_size
    if size != count * np.dtype(dtype).itemsize:
        raise DataError(f"instruction data file {str(path)!r} has {size} bytes, meta.json says "
                        f"{count} entries; the data is truncated, re-run `allhands prepare`")
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)


class ExampleDataset(torch.utils.data.Dataset):
    """Examples ``[first, first + count)`` of a prepared instruction directory as rows."""

    masked_targets = True  # the trainer averages the loss over the step's unmasked targets

    def __init__(self, root: Path, meta: dict, entry: dict, dtype, seq_len: int):
        total = int(meta["examples"])
        index = np.asarray(_map(root / entry["index"], np.int64, total + 1))
        tokens = int(index[-1])
        self.tokens = _map(root / entry["file"], dtype, tokens)
        self.mask = _map(root / entry["mask"], np.uint8, tokens)
        first, count = int(entry["first"]), int(entry["examples"])
        self.starts = index[first:first + count]
        self.ends = np.minimum(index[first + 1:first + count + 1], self.starts + seq_len + 1)
        self.seq_len, self.pad = seq_len, int(meta["pad"])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s, e = int(self.starts[i]), int(self.ends[i])
        row = np.full(self.seq_len + 1, self.pad, dtype=np.int64)
        row[:e - s] = self.tokens[s:e]
        keep = np.zeros(self.seq_len + 1, dtype=bool)
        keep[:e - s] = self.mask[s:e]
        target = np.where(keep[1:], row[1:], IGNORE)
        return torch.from_numpy(row[:-1]), torch.from_numpy(target)

    def valid_targets(self, indices: list[int]) -> int:
        """How many targets of the samples at ``indices`` carry loss (read from the mask only)."""
        return sum(int(np.count_nonzero(self.mask[self.starts[i] + 1:self.ends[i]])) for i in indices)


def valid_targets(ds, indices: list[int]) -> int:
    """Targets that carry loss among the samples at ``indices`` of any dataset of (x, y) pairs."""
    if hasattr(ds, "valid_targets"):
        return ds.valid_targets(indices)
    return sum(int((torch.as_tensor(ds[i][1]) != IGNORE).sum()) for i in indices)


def example_splits(root: Path, meta: dict, dtype, seq_len: int) -> list[ExampleDataset]:
    """The train and val splits of an instruction directory."""
    out = []
    for split in ("train", "val"):
        entries = meta["splits"].get(split, [])
        if len(entries) != 1:
            raise DataError(f"{str(root / 'meta.json')!r}: split {split!r} must have one entry; "
                            f"re-run `allhands prepare`")
        ds = ExampleDataset(root, meta, entries[0], dtype, seq_len)
        if len(ds) == 0:
            raise DataError(f"{split} split of {str(root)!r} holds no example; give more examples")
        out.append(ds)
    return out

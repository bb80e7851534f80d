"""An ``IterableDataset`` as a stream read in order: the same step arithmetic as map-style data,
without shuffling, so that every layout and an exact resume work on it.

The rule: step ``s`` consumes stream items ``[s*B, (s+1)*B)`` (B = run.global_batch), and
data-parallel rank ``r`` of ``W`` keeps the contiguous slice ``[s*B + r*B/W, s*B + (r+1)*B/W)``
of it, exactly as :class:`GlobalSampler` slices a map-style step but with the identity order
(``data.seed`` does not apply: a stream's order is its own). Each rank iterates the stream and
keeps its share, skipping the rest, as torch's ``sharding_filter`` does. A resume at step ``k``
skips the first ``k*B`` items, so the stream must yield the same items in the same order on
every pass (seed any randomness inside it); then a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from allhands.data.sampler import GlobalSampler
from allhands.errors import DataError


class StreamView:
    """Items of an ``IterableDataset`` by stream position, read forwards. Asking for an earlier
    position starts a fresh pass (an evaluation reads the same first batches every time)."""

    def __init__(self, stream: torch.utils.data.IterableDataset, name: str = "data"):
        self.stream = stream
        self.name = name
        self._it: Iterator[Any] | None = None
        self._pos = 0  # position of the item the iterator yields next

    def __getitem__(self, i: int) -> Any:
        if self._it is None or i < self._pos:
            self._it, self._pos = iter(self.stream), 0
        while self._pos < i:  # another rank's share, or the steps a resume has already done
            self._next(i)
        return self._next(i)

    def _next(self, wanted: int) -> Any:
        try:
            item = next(self._it)
        except StopIteration:
            raise DataError(f"{self.name}: the IterableDataset ended after {self._pos} items but "
                            f"item {wanted} is needed; make it longer (e.g. repeat it), or lower "
                            f"run.steps or run.global_batch") from None
        self._pos += 1
        return item


class StreamSampler(GlobalSampler):
    """GlobalSampler's slicing over stream positions in order: no permutation, no epochs."""

    def __init__(self, global_batch: int):
        super().__init__(1, global_batch, seed=0)

    def indices(self, start: int, count: int) -> list[int]:
        return list(range(start, start + count))

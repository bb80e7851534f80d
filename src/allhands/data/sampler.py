"""The global sample order: a pure function of (seed, step, global batch).

Step ``s`` consumes global sample positions ``[s*B, (s+1)*B)`` of an endless stream made of one
seeded permutation of the dataset per epoch. Data-parallel rank ``r`` of ``W`` takes the contiguous
slice ``[r*B/W, (r+1)*B/W)`` of that step's batch and cuts it into micro-batches. So a run on 1, 2 or
3 workers sees the same samples in the same order, and resume at any world size is arithmetic.
"""

from __future__ import annotations

import torch


class GlobalSampler:
    def __init__(self, n_samples: int, global_batch: int, seed: int):
        if n_samples < 1:
            raise ValueError("dataset is empty")
        self.n = n_samples
        self.global_batch = global_batch
        self.seed = seed
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        # a list, read once: indexing a tensor element by element reads each one back
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of global stream positions ``[start, start + count)``."""
        out = []
        for pos in range(start, start + count):
            epoch, k = divmod(pos, self.n)
            out.append(self._permutation(epoch)[k])
        return out

    def global_batch_indices(self, step: int) -> list[int]:
        return self.indices(step * self.global_batch, self.global_batch)

    def local_micro_batches(self, step: int, rank: int, world: int, micro_batches: int) -> list[list[int]]:
        """This rank's share of step ``step``, as ``micro_batches`` equal lists of indices."""
        per_rank = self.global_batch // world
        per_micro = per_rank // micro_batches
        if per_micro * micro_batches * world != self.global_batch:
            raise ValueError(f"global batch {self.global_batch} is not divisible by "
                             f"{world} workers x {micro_batches} micro-batches")
        mine = self.indices(step * self.global_batch + rank * per_rank, per_rank)
        return [mine[i * per_micro:(i + 1) * per_micro] for i in range(micro_batches)]


def collate(dataset, indices: list[int]):
    """Stack the items at ``indices`` with torch's default collation (items are (input, target))."""
    return torch.utils.data.default_collate([dataset[i] for i in indices])

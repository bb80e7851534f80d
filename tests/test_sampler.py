"""The global sample order does not depend on the number of workers or micro-batches."""

from __future__ import annotations

import pytest

from allhands.data import GlobalSampler


@pytest.mark.parametrize("world,micro", [(1, 1), (2, 1), (3, 2), (4, 3), (6, 2)])
def test_ranks_partition_the_global_batch(world, micro):
    s = GlobalSampler(n_samples=101, global_batch=24, seed=7)
    for step in range(12):  # crosses several epochs
        union = []
        for rank in range(world):
            parts = s.local_micro_batches(step, rank, world, micro)
            assert len(parts) == micro and all(len(p) == 24 // world // micro for p in parts)
            union += [i for p in parts for i in p]
        assert union == s.global_batch_indices(step)


def test_each_epoch_is_a_permutation_and_seeds_differ():
    s = GlobalSampler(n_samples=50, global_batch=10, seed=1)
    epoch0 = [i for step in range(5) for i in s.global_batch_indices(step)]
    epoch1 = [i for step in range(5, 10) for i in s.global_batch_indices(step)]
    assert sorted(epoch0) == list(range(50)) and sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1
    assert GlobalSampler(50, 10, seed=2).global_batch_indices(0) != s.global_batch_indices(0)
    # a fresh sampler (as after a resume) continues the same stream
    assert GlobalSampler(50, 10, seed=1).global_batch_indices(7) == s.global_batch_indices(7)


def test_indivisible_batch_is_refused():
    with pytest.raises(ValueError, match="not divisible"):
        GlobalSampler(50, 10, seed=1).local_micro_batches(0, 0, 3, 1)

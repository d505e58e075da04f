"""eval_ranges (train/data.py): how the held-out split is cut into evaluation batches so that every rank
gets at least one sample of every batch (a transformers model cannot run on an empty one)."""

import pytest

from dynmoe_dist.train.data import eval_ranges, shard_sizes


@pytest.mark.parametrize(
    "size, chunk, world, expected",
    [
        (12, 6, 2, [(0, 6), (6, 12)]),  # whole batches
        (13, 6, 2, [(0, 6), (6, 13)]),  # 1 sample left < 2 ranks: joins the batch before (7 samples)
        (14, 6, 2, [(0, 6), (6, 12), (12, 14)]),  # 2 left, one per rank: a batch of its own
        (7, 6, 3, [(0, 7)]),  # 1 left < 3 ranks
        (8, 6, 3, [(0, 8)]),  # 2 left < 3 ranks
        (9, 6, 3, [(0, 6), (6, 9)]),
        (5, 6, 3, [(0, 5)]),  # less than one batch, still one sample per rank
        (7, 6, 1, [(0, 6), (6, 7)]),  # one process: the old chunks
    ],
)
def test_ranges(size, chunk, world, expected):
    got = eval_ranges(size, chunk, world)
    assert got == expected
    assert [r for rng in got for r in range(*rng)] == list(range(size))  # every sample once, in order
    assert all(min(shard_sizes(end - start, world)) >= 1 for start, end in got)


def test_a_split_smaller_than_the_world_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"held-out split \(2 samples\) is smaller than the world size \(3\)"):
        eval_ranges(2, 6, 3)

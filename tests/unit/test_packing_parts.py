"""The packer's parts on hand-worked cases (planning/packing.py): the LPT rank renaming, the item order,
the least-loaded rank with its tie-breaks, and the maximum load. An item is (expert, share, load)."""

import pytest

from dynmoe_dist.planning.packing import Bins, _best_renaming, _by_load, make_items, max_load


def test_renaming_gives_each_bin_the_rank_most_of_its_items_came_from():
    # homes: expert e lives on rank homes[e][0]. Bin 0 holds experts 1, 2 (both from rank 2) and 0 (rank 0);
    # bin 1 holds expert 3 (rank 0); bin 2 holds expert 4 (rank 1).
    homes = [[0], [2], [2], [0], [1]]
    assigned = [((1, 0, 1.0), 0), ((2, 0, 1.0), 0), ((0, 0, 1.0), 0), ((3, 0, 1.0), 1), ((4, 0, 1.0), 2)]
    # overlaps: (bin 0, rank 2) = 2, (0, 0) = 1, (1, 0) = 1, (2, 1) = 1. Greedy by overlap: bin 0 -> rank 2
    # first (count 2, not 1: a counter that only marks presence would tie it with (0, 0) and pick rank 0);
    # then (0, 0) is skipped (bin 0 is named), (1, 0) -> bin 1 gets rank 0, (2, 1) -> bin 2 gets rank 1.
    assert _best_renaming(assigned, homes, 3) == [2, 0, 1]


def test_renaming_breaks_overlap_ties_by_bin_then_rank_and_never_reuses_a_rank():
    # Every pair overlaps once: (0, 1), (0, 2), (1, 1), (2, 0). Ties go by (bin, rank): bin 0 -> rank 1;
    # (0, 2) skipped (bin 0 named); (1, 1) skipped (rank 1 used); (2, 0) -> bin 2 gets rank 0; bin 1 gets
    # the lowest rank still free, 2.
    homes = [[1], [2], [1], [0]]
    assigned = [((0, 0, 1.0), 0), ((1, 0, 1.0), 0), ((2, 0, 1.0), 1), ((3, 0, 1.0), 2)]
    assert _best_renaming(assigned, homes, 3) == [1, 2, 0]


def test_renaming_without_any_home_is_the_identity():
    # New experts have no home: no overlap anywhere, every bin takes the lowest free rank in bin order.
    assert _best_renaming([((0, 0, 1.0), 1), ((1, 0, 1.0), 0)], [[], []], 2) == [0, 1]


def test_items_go_largest_first_then_by_expert_then_share():
    # Loads 2.0, 3.0, 2.0 / 2 shares of 4.0 (2.0 each): largest first; the four 2.0 items by expert id,
    # expert 2's two shares by share index.
    items = make_items([2.0, 3.0, 4.0], [1, 1, 2])
    assert items == [(0, 0, 2.0), (1, 0, 3.0), (2, 0, 2.0), (2, 1, 2.0)]
    assert _by_load(list(reversed(items))) == [(1, 0, 3.0), (0, 0, 2.0), (2, 0, 2.0), (2, 1, 2.0)]
    assert _by_load([(5, 1, 1.0), (5, 0, 1.0), (3, 1, 1.0)]) == [(3, 1, 1.0), (5, 0, 1.0), (5, 1, 1.0)]


def test_least_loaded_rank_breaks_ties_by_item_count_then_rank_and_skips_holders():
    bins = Bins(3)
    assert bins.least_loaded(0) == 0  # all empty: the lowest rank
    bins.put(0, (0, 0, 2.0))  # loads [2, 0, 0], counts [1, 0, 0]
    bins.put(1, (1, 0, 1.0))
    bins.put(1, (2, 0, 1.0))  # loads [2, 2, 0], counts [1, 2, 0]
    assert bins.least_loaded(3) == 2
    bins.put(2, (3, 0, 2.0))  # loads [2, 2, 2], counts [1, 2, 1]
    assert bins.least_loaded(4) == 0  # equal loads: fewer items first, then the lower rank (0 before 2)
    assert bins.least_loaded(0) == 2  # rank 0 holds expert 0 already: the next in (load, count, rank)
    assert (bins.load, bins.count) == ([2.0, 2.0, 2.0], [1, 2, 1])
    assert bins.allowed(1) == [0, 2]
    bins.put(0, (1, 1, 0.5))
    bins.put(2, (1, 2, 0.5))  # expert 1 now on all three ranks
    with pytest.raises(ValueError, match="every rank already holds expert 1"):
        bins.least_loaded(1)


def test_max_load_sums_each_rank():
    assigned = [((0, 0, 1.5), 1), ((1, 0, 2.0), 0), ((2, 0, 0.75), 1)]
    assert max_load(assigned, 3) == 2.25  # rank 1: 1.5 + 0.75; rank 0: 2.0; rank 2: nothing
    assert max_load([], 2) == 0.0

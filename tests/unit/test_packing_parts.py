"""The packer's parts on hand-worked cases (planning/packing.py): the LPT rank renaming, the item order,
the least-loaded rank with its tie-breaks, the maximum load, the two greedy packings, the move count and
the lower bound on the maximum load. An item is (expert, share, load)."""

import pytest

from dynmoe_dist.planning.packing import (
    Bins,
    _best_renaming,
    _by_load,
    count_moves,
    load_lower_bound,
    make_items,
    max_load,
    place_lpt,
    place_sticky,
)


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


def test_sticky_packing_sorts_the_items_itself_and_keeps_items_home_up_to_the_cap():
    # Loads 1, 3, 2 (experts 0, 1, 2), homes e0 -> 0, e1 -> 0, e2 -> 1; no order given, so it sorts:
    # e1 (3), e2 (2), e0 (1). Without a cap all stay home: rank 0 gets 3 + 1.
    items = make_items([1.0, 3.0, 2.0], [1, 1, 1])
    homes = [[0], [0], [1]]
    assert place_sticky(items, homes, 2, cap=None) == [((1, 0, 3.0), 0), ((2, 0, 2.0), 1), ((0, 0, 1.0), 0)]
    # Cap 3.5: e0 at home would make rank 0 3 + 1 = 4 > 3.5, so it goes to the least loaded rank, 1 (2 -> 3).
    assert place_sticky(items, homes, 2, cap=3.5) == [((1, 0, 3.0), 0), ((2, 0, 2.0), 1), ((0, 0, 1.0), 1)]
    # Giving up above 3.5: rank 0 reaches 4 with the last item, so the packing is abandoned.
    assert place_sticky(items, homes, 2, cap=None, give_up_above=3.5) is None


def test_lpt_packing_sorts_the_items_itself_then_renames_the_bins():
    # Same loads; LPT: e1 (3) -> bin 0, e2 (2) -> bin 1, e0 (1) -> bin 1 (load 2 < 3). Homes e0 -> 1,
    # e1 -> 1, e2 -> 0: overlaps (bin 0, rank 1), (bin 1, rank 0), (bin 1, rank 1), one each; by (bin, rank)
    # bin 0 -> rank 1, then bin 1 -> rank 0 (rank 1 is taken).
    items = make_items([1.0, 3.0, 2.0], [1, 1, 1])
    homes = [[1], [1], [0]]
    assert place_lpt(items, homes, 2) == [((1, 0, 3.0), 1), ((2, 0, 2.0), 0), ((0, 0, 1.0), 0)]


def test_moves_count_new_holdings_of_existing_experts_only():
    # e0 lives on ranks 0 and 1: its share on 0 stays, its share on 2 is a move; e1 (home 0) now on 1 is a
    # move; e2 is new (no home), so placing it anywhere is not a move. 2 moves, with or without the sets.
    assigned = [((0, 0, 1.0), 0), ((0, 1, 1.0), 2), ((1, 0, 1.0), 1), ((2, 0, 1.0), 0)]
    homes = [[0, 1], [0], []]
    assert count_moves(assigned, homes) == 2
    assert count_moves(assigned, homes, [set(h) for h in homes]) == 2


def test_lower_bound_mean_term_stays_at_or_below_a_perfect_packing():
    # Six experts of load 1 on 2 ranks: 3 per rank is a packing, so the bound must not exceed 3.0. The
    # mean (3) is the largest term (largest share 1; 2nd + 3rd largest shares 2), shrunk by a relative 1e-9.
    bound = load_lower_bound([1.0] * 6, [1] * 6, 2)
    assert 3.0 * (1 - 2e-9) < bound <= 3.0


def test_lower_bound_largest_share_term():
    # Loads 10, 1, 1 on 3 ranks: mean 4, largest share 10; only 3 items, so no 3rd + 4th largest pair.
    assert load_lower_bound([10.0, 1.0, 1.0], [1, 1, 1], 3) == 10.0


def test_lower_bound_pair_term_across_experts():
    # Loads 8 (2 replicas), 3, 1 on 2 ranks: shares 4, 4, 3, 1. Mean 6, largest 4; the 2nd and 3rd largest
    # shares (4 from e0, 3 from e1) sit on one rank together: 7 (and {4, 3} | {4, 1} reaches it).
    assert load_lower_bound([8.0, 3.0, 1.0], [2, 1, 1], 2) == 7.0


def test_lower_bound_pair_term_inside_a_later_run_of_shares():
    # Loads 5, 4, 6 (2 replicas) on 3 ranks: shares sorted 5, 4, 3, 3; the 3rd and 4th largest are both
    # shares of e2 (positions 2 and 3, after runs of one share each): 3 + 3 = 6 > mean 5 = largest share.
    assert load_lower_bound([5.0, 4.0, 6.0], [1, 1, 2], 3) == 6.0


def test_lower_bound_without_experts_is_zero():
    assert load_lower_bound([], [], 2) == 0.0

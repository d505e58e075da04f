"""Packing (planning/packing.py) and imbalance on hand-worked loads: when an expert is hot, how many
replicas it gets, per-rank loads with replicas, and that no rank ever holds two shares of one expert."""

import pytest

from dynmoe_dist.planning.packing import pack_experts, rank_loads, replica_counts, replica_options
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import imbalance


@pytest.mark.parametrize(
    "loads, ep_size, factor, max_replicas, want",
    [
        ([6.0, 2.0, 0.0, 0.0], 4, 1.5, 0, [3, 1, 1, 1]),  # mean 2: 6 > 3 -> ceil(6 / 2) = 3 (exactly 3, not 4)
        ([3.0, 1.0], 2, 1.5, 0, [1, 1]),  # mean 2: 3 is not above 1.5 x 2 = 3
        ([1.0, 0.0], 2, 1.5, 0, [2, 1]),  # mean 0.5 (below 1): 1 > 0.75 -> ceil(2) = 2
        ([6.0, 2.0, 0.0, 0.0], 4, 1.5, 2, [2, 1, 1, 1]),  # capped by max_replicas
        ([0.0, 0.0], 2, 1.5, 0, [1, 1]),  # nothing routed: nothing is hot
    ],
)
def test_replica_counts(loads, ep_size, factor, max_replicas, want):
    assert replica_counts(loads, ep_size, factor, max_replicas) == want


def test_replica_options_add_one_replica_at_a_time_up_to_the_cap():
    # 8 ranks, total 8, mean 1: e0 (6) -> 6 replicas, then 7, then 8 (the cap); e1, e2 (1) are not hot.
    loads = [6.0, 1.0, 1.0] + [0.0] * 5
    assert replica_options(loads, 8, 1.5, 0) == [[6] + [1] * 7, [7] + [1] * 7, [8] + [1] * 7]
    # max_replicas 2 caps the extra options too: only the base remains.
    assert replica_options([6.0, 2.0, 0.0, 0.0], 4, 1.5, 2) == [[2, 1, 1, 1]]


def test_rank_loads_share_a_replicated_expert_evenly():
    # e0 (load 10) on ranks 0 and 1 -> 5 each; e1 (4) on rank 1 -> ranks [5, 9].
    p = Placement.from_rank_lists(2, 2, [[0], [0, 1]])
    assert rank_loads(p, [10.0, 4.0]) == [5.0, 9.0]


def test_two_shares_of_one_expert_never_land_on_one_rank():
    # Loads [10, 6] on 2 ranks (homes e0 -> 0, e1 -> 1), factor 1.1: mean 8, e0 > 8.8 -> 2 shares of 5.
    # Largest first: e1 (6) stays on rank 1, e0 share 0 (5) stays on rank 0; share 1 (5) would fit best
    # on rank 0 (5 < 6) but rank 0 already holds e0 -> rank 1. Ranks [5, 11]; LPT gives the same after
    # renaming its bins. 1 move: the new copy of e0 on rank 1.
    placement, moves = pack_experts([10.0, 6.0], [[0], [1]], 2, replicate_factor=1.1)
    assert placement.replicas == (((0, 0), (1, 0)), ((1, 1),))
    assert moves == 1


@pytest.mark.parametrize(
    "loads, want",
    [
        ([3.0, 1.0], 1.5),  # max 3 / mean 2
        ([4.0], 1.0),  # one rank is always balanced
        ([0.5, 0.25], 0.5 / 0.375),  # a mean below 1 still divides
        ([0.0, 0.0], 1.0),  # nothing routed: balanced by definition (no division by zero)
        ([], 1.0),
    ],
)
def test_imbalance(loads, want):
    assert imbalance(loads) == pytest.approx(want)


def test_a_replica_option_after_a_pruned_one_can_still_win():
    # Loads 1, 6, 10 on 5 ranks, factor 1.1: mean 3.4, hot above 3.74: e1 -> ceil(6 / 3.4) = 2 replicas,
    # e2 -> ceil(10 / 3.4) = 3. Options [1, 2, 3], [1, 3, 4], [1, 4, 5], [1, 5, 5].
    # [1, 2, 3]: shares 3.33 x 3, 3 x 2, 1: five ranks, the 1 joins a 3 -> best max 4 (LPT reaches it).
    # [1, 3, 4]: shares 2.5 x 4, 2 x 3, 1: its 5th + 6th largest shares 2 + 2 = 4 cannot beat 4 with more
    #   replicas: skipped, but the search goes on.
    # [1, 4, 5]: shares 2 x 5, 1.5 x 4, 1: 2 + 1.5 on four ranks, 2 + 1 on one -> max 3.5 < 4: wins.
    # [1, 5, 5]: every rank holds 2 + 1.2, one also the 1 -> 4.2: loses.
    placement, _ = pack_experts([1.0, 6.0, 10.0], [[0], [1], [2]], 5, replicate_factor=1.1)
    assert [placement.num_replicas(e) for e in range(3)] == [1, 4, 5]
    assert max(rank_loads(placement, [1.0, 6.0, 10.0])) == 3.5


def test_max_loads_equal_to_six_decimals_tie_and_fewer_moves_win():
    # Homes: e0, e1 on rank 0, e2, e3 on rank 1; loads 5, 5.0000001, 5, 4.9999999 (not hot).
    # Staying put: ranks 10.0000001 and 9.9999999, no move. LPT: e1 -> 0, e0 -> 1, e2 -> 1 (5 < 5.0000001),
    # e3 -> 0: ranks 10.0 and 10.0 (to the last bit), two moves (e0, e3); the capped sticky packing is the same.
    # Rounded to 6 decimals both maxima are 10.0, so the placement with no move wins.
    loads = [5.0, 5.0000001, 5.0, 4.9999999]
    placement, moves = pack_experts(loads, [[0], [0], [1], [1]], 2)
    assert (placement.experts_on(0), placement.experts_on(1), moves) == ([0, 1], [2, 3], 0)

"""No move without gain: a plan moves experts between ranks only when that lowers the planned imbalance
(max / mean rank load) by at least adaptive.min_rebalance_gain of the imbalance with nothing moved, and
it is never planned worse than leaving every expert where it is. Hand-worked against
planning/packing.py (pack_experts, place_unmoved) and planning/planner.py (plan_layer, worth_it)."""

import random

import pytest
import torch
from planner_configs import planner_cfg

from dynmoe_dist.config import load_config
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import plan_layer, worth_it
from dynmoe_dist.planning.stats import WindowStats


def _stats(counts):
    s = WindowStats.empty(len(counts), 2, 8)
    s.counts_E += torch.tensor(counts, dtype=torch.float64)
    return s


def _plan(counts, placement, **adaptive):
    return plan_layer(0, _stats(counts), placement, planner_cfg(max_experts=8, **adaptive), has_discarded=False)


def test_a_move_with_no_planned_gain_is_not_made():
    # e0 replicated on both ranks, e1 on rank 0, e2 and e3 on rank 1; window counts [4, 6, 3, 3].
    # As placed: rank 0 = 4/2 + 6 = 8, rank 1 = 4/2 + 3 + 3 = 8: imbalance 1.0, and that is the unmoved plan.
    # pack_experts drops e0's replica first (no expert is above 1.5 x the mean rank load 8): its best
    # packing of [6, 4, 3, 3] is {e1, e3} | {e0, e2} = 9 | 7, which moves e3 to rank 0 (1 move) for a
    # planned imbalance of 9/8. That move gains nothing (it loses): the layer keeps its placement.
    placement = Placement.from_rank_lists(2, 4, [[0, 1], [0, 2, 3]])
    lp = _plan([4, 6, 3, 3], placement)
    assert lp.moves == 0 and lp.placement == placement
    assert lp.imbalance_unmoved == 1.0 and lp.imbalance_after == 1.0 and lp.imbalance_before == 1.0


def test_a_gain_below_the_margin_keeps_the_placement_and_one_above_it_moves():
    # e0, e1 on rank 0 and e2, e3 on rank 1 with counts [50, 50, 49, 49]: ranks 100 | 98, imbalance
    # 100 / 99 = 1.0101. Swapping e1 and e2 gives 99 | 99 (imbalance 1.0) for 2 moves: a gain of 1 %.
    placement = Placement.balanced(4, 2)
    kept = _plan([50, 50, 49, 49], placement, min_rebalance_gain=0.02)
    assert kept.moves == 0 and kept.placement == placement
    assert kept.imbalance_after == kept.imbalance_unmoved == pytest.approx(100 / 99)
    moved = _plan([50, 50, 49, 49], placement, min_rebalance_gain=0.005)
    assert moved.moves == 2 and moved.imbalance_after == pytest.approx(1.0)
    assert moved.imbalance_unmoved == pytest.approx(100 / 99)
    assert sorted(len(moved.placement.experts_on(r)) for r in (0, 1)) == [2, 2]


def test_a_large_gain_moves_under_the_default_margin():
    # Counts [90, 10, 10, 10]: ranks 100 | 20, imbalance 100 / 60 = 1.667. Moving e1 to rank 1 gives
    # 90 | 30 = 1.5 (a 10 % gain; 90 is not above 1.5 x 60, so no replica).
    lp = _plan([90, 10, 10, 10], Placement.balanced(4, 2))
    assert lp.moves == 1 and lp.placement.experts_on(0) == [0] and lp.placement.experts_on(1) == [1, 2, 3]
    assert lp.imbalance_unmoved == pytest.approx(100 / 60) and lp.imbalance_after == pytest.approx(1.5)


def test_zero_margin_still_refuses_a_move_without_any_gain():
    placement = Placement.from_rank_lists(2, 4, [[0, 1], [0, 2, 3]])
    assert _plan([4, 6, 3, 3], placement, min_rebalance_gain=0.0).moves == 0


@pytest.mark.parametrize("margin", [0.0, 0.02, 0.1])
def test_random_plans_never_move_for_less_than_the_margin(margin):
    rng = random.Random(7)
    for _ in range(200):
        ep_size = rng.randint(2, 4)
        num_experts = rng.randint(ep_size, 8)
        counts = [float(rng.choice([0, 1, 5, 20, 100]) + rng.randint(0, 9)) for _ in range(num_experts)]
        if sum(counts) == 0:
            continue
        lp = _plan(counts, Placement.balanced(num_experts, ep_size), min_rebalance_gain=margin)
        assert lp.imbalance_after <= lp.imbalance_unmoved + 1e-9, (counts, ep_size)
        if lp.moves:
            assert lp.imbalance_after <= lp.imbalance_unmoved * (1 - margin) + 1e-9, (counts, ep_size)
            assert lp.imbalance_after < lp.imbalance_unmoved, (counts, ep_size)


def test_worth_it_rules():
    assert worth_it(1.10, 1.07, moves=2, min_gain=0.02)  # 2.7 % gain
    assert not worth_it(1.10, 1.09, moves=2, min_gain=0.02)  # 0.9 %
    assert not worth_it(1.10, 1.10, moves=4, min_gain=0.0)  # "4 moves; imbalance 1.10 -> 1.10"
    assert worth_it(1.10, 1.10, moves=0, min_gain=0.02)  # nothing moves: nothing to pay for
    assert not worth_it(1.03, 1.07, moves=0, min_gain=0.02)  # worse than standing still


def test_the_margin_is_an_adaptive_option_with_a_checked_range():
    assert load_config(None, ["adaptive.min_rebalance_gain=0.05"]).adaptive.min_rebalance_gain == 0.05
    with pytest.raises(ValueError, match=r"adaptive.min_rebalance_gain \(1.5\) must be in \[0, 1\)"):
        load_config(None, ["adaptive.min_rebalance_gain=1.5"])

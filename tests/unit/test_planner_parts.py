"""The planner's parts on hand-worked inputs: removals at the bound, init strategies' coefficients,
new gates, estimated loads, and plan_layer passing each PlannerConfig knob to the packer."""

import math

import pytest
import torch
from planner_configs import planner_cfg

from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import (
    AddSpec,
    choose_removals,
    estimated_loads,
    init_strategy,
    new_gates,
    plan_layer,
)
from dynmoe_dist.planning.stats import WindowStats

D = 2


def _stats(counts, unrouted_ED=None, num_unrouted_E=None):
    s = WindowStats.empty(len(counts), D, 8)
    s.counts_E += torch.tensor(counts, dtype=torch.float64)
    if unrouted_ED is not None:
        s.unrouted_sum_ED += torch.tensor(unrouted_ED, dtype=torch.float64)
        s.num_unrouted_E += torch.tensor(num_unrouted_E, dtype=torch.float64)
    return s


def test_removals_stop_at_min_experts():
    assert choose_removals([0.0, 5.0], planner_cfg(min_experts=2, max_experts=4)) == []
    assert choose_removals([0.0, 0.0, 5.0], planner_cfg(min_experts=2, max_experts=4)) == [0]  # lowest id first
    assert choose_removals([0.0], planner_cfg(min_experts=1, max_experts=2)) == []


@pytest.mark.parametrize(
    "counts, want",
    [
        ([0.0, 3.0, 1.0], ("weighted_average", "experts", ((1, 0.75), (2, 0.25)))),  # zero-count e0 left out
        ([0.0, 1.0, 0.0], ("weighted_average", "experts", ((1, 1.0),))),  # a total of exactly 1
        ([0.0, 0.0, 0.0], ("average", "experts", ((0, 1 / 3), (1, 1 / 3), (2, 1 / 3)))),  # nothing used: average
    ],
)
def test_weighted_average_coefficients(counts, want):
    assert init_strategy("weighted_average", counts, [0, 1, 2], [], False) == want


def test_most_activated_breaks_ties_by_lowest_id_and_random_without_experts():
    assert init_strategy("most_activated", [2.0, 5.0, 5.0], [0, 1, 2], [], False) == (
        "most_activated",
        "experts",
        ((1, 1.0),),
    )
    assert init_strategy("average", [1.0], [], [0], False) == ("random", "random", ())


def test_unknown_strategy_is_refused_with_the_setting_name():
    with pytest.raises(ValueError, match=r"adaptive\.expert_init \('copy'\) is not a known strategy"):
        init_strategy("copy", [1.0, 2.0], [0, 1], [], False)


def test_one_add_uses_the_sum_of_all_unrouted_states():
    # Unrouted: two tokens near e0 summing to (2, 0), one near e1 at (0, 1). One add -> the reference's
    # single gate (2, 1) / sqrt(5); two adds -> one per neighbourhood, most crowded first; none -> [].
    s = _stats([1.0, 1.0], [[2.0, 0.0], [0.0, 1.0]], [2.0, 1.0])
    (gate,) = new_gates(s, 1)
    assert gate == pytest.approx((2 / math.sqrt(5), 1 / math.sqrt(5)))
    assert new_gates(s, 2) == [(1.0, 0.0), (0.0, 1.0)]
    assert new_gates(s, 0) == []


def test_estimated_loads_of_kept_and_new_experts():
    # kept old ids [0, 2, 3] with counts 5, 7, 2; two new experts share 20 unrouted tokens: 10 each,
    # which beats the busiest kept expert (7) -> [5, 7, 2, 10, 10].
    s = _stats([5.0, 0.0, 7.0, 2.0], [[1.0, 0.0]] + [[0.0, 0.0]] * 3, [20.0, 0.0, 0.0, 0.0])
    adds = [AddSpec("random", (1.0, 0.0), "random"), AddSpec("random", (1.0, 0.0), "random")]
    assert estimated_loads([5.0, 0.0, 7.0, 2.0], [0, 2, 3], adds, s) == [5.0, 7.0, 2.0, 10.0, 10.0]
    # History by old id [1, 99, 3, 6]: 0.5 * (5 + 1), 0.5 * (7 + 3), 0.5 * (2 + 6) = [3, 5, 4]; no adds.
    assert estimated_loads([5.0, 0.0, 7.0, 2.0], [0, 2, 3], [], s, history=[1.0, 99.0, 3.0, 6.0]) == [3.0, 5.0, 4.0]


def test_plan_layer_refuses_statistics_of_another_size():
    with pytest.raises(ValueError, match=r"layer 0: statistics for 3 experts, placement has 4"):
        plan_layer(0, _stats([1.0, 1.0, 1.0]), Placement.balanced(4, 2), planner_cfg(1, 8), False)


def test_plan_layer_passes_rebalance_and_replication_settings_to_the_packer():
    balanced = Placement.balanced(4, 2)  # e0, e1 | e2, e3
    # Loads [30, 30, 1, 1]: rebalancing swaps a heavy expert (2 moves); without it nothing moves.
    skewed = _stats([30.0, 30.0, 1.0, 1.0])
    stay = plan_layer(0, skewed, balanced, planner_cfg(1, 8, rebalance=False, replicate_factor=10.0), False)
    assert stay.placement == balanced and stay.moves == 0
    moved = plan_layer(0, skewed, balanced, planner_cfg(1, 8, replicate_factor=10.0), False)
    assert moved.moves == 2
    # Loads [60, 1, 1, 1] on 2 ranks: mean 31.5 per rank. Factor 1.5 -> 60 > 47.25: e0 gets 2 replicas;
    # factor 3 -> 60 < 94.5: one copy; max_replicas 1 -> one copy whatever the factor.
    hot = _stats([60.0, 1.0, 1.0, 1.0])
    assert plan_layer(0, hot, balanced, planner_cfg(1, 8, replicate_factor=1.5), False).placement.num_replicas(0) == 2
    assert plan_layer(0, hot, balanced, planner_cfg(1, 8, replicate_factor=3.0), False).placement.num_replicas(0) == 1
    assert (
        plan_layer(
            0, hot, balanced, planner_cfg(1, 8, replicate_factor=1.5, max_replicas=1), False
        ).placement.num_replicas(0)
        == 1
    )


def test_plan_layer_default_seed_is_zero():
    lp = plan_layer(
        0,
        _stats([1.0, 1.0], [[1.0, 0.0], [0.0, 0.0]], [1.0, 0.0]),
        Placement.balanced(2, 1),
        planner_cfg(1, 8, expert_init="random"),
        False,
    )
    assert lp.added[0].source == "random" and lp.added[0].seed == 0

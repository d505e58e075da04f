"""planner.plan(): how its per-layer inputs (has_discarded, load_history, seeds) reach each layer, and the
Plan value it returns. Hand-worked against planning/planner.py and planning/packing.py."""

import pytest
import torch
from planner_configs import planner_cfg

from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import LayerPlan, Plan, plan
from dynmoe_dist.planning.stats import WindowStats

D = 2


def _stats(counts, unrouted=None):
    s = WindowStats.empty(len(counts), D, 8)
    s.counts_E += torch.tensor(counts, dtype=torch.float64)
    if unrouted is not None:
        s.unrouted_sum_ED[0] += torch.tensor(unrouted, dtype=torch.float64)
        s.num_unrouted_E[0] += 1
    return s


CFG = planner_cfg(min_experts=1, max_experts=8)


def test_plan_carries_version_step_planner_and_per_layer_seeds():
    # Two layers, each with one unrouted token (-> one add) and no unused expert. Layer 0 has a discarded
    # expert remembered (-> 'discarded'); layer 1 has none (-> falls back to the average of its experts).
    # Seeds: plan seeds layer i with version * 1000 + i, an add j with seed * 16 + j:
    #   version 2: layer 0 -> 2000 * 16 = 32000, layer 1 -> 2001 * 16 = 32016.
    stats = [_stats([1, 1], unrouted=(0.0, 3.0)), _stats([1, 1], unrouted=(4.0, 0.0))]
    placements = (Placement.balanced(2, 1), Placement.balanced(2, 1))
    p = plan(stats, placements, (CFG, CFG), version=2, step=40, has_discarded=(True, False))
    assert isinstance(p, Plan) and (p.version, p.step, p.planned_by) == (2, 40, "collective")
    assert [lp.layer for lp in p.layers] == [0, 1]
    first, second = p.layers
    assert (first.added[0].init, first.added[0].source, first.added[0].seed) == ("reuse_discarded", "discarded", 32000)
    assert first.added[0].gate == (0.0, 1.0)
    assert (second.added[0].init, second.added[0].source) == ("reuse_discarded->average", "experts")
    assert second.added[0].coeffs == ((0, 0.5), (1, 0.5)) and second.added[0].seed == 32016
    assert second.added[0].gate == (1.0, 0.0)
    assert (
        plan(
            stats, placements, (CFG, CFG), version=2, step=40, has_discarded=(True, False), planned_by="ray"
        ).planned_by
        == "ray"
    )


def test_load_history_is_averaged_into_each_layers_loads():
    # 4 experts on 2 ranks (e0, e1 | e2, e3), window counts [4, 4, 4, 4]: balanced, nothing to do.
    # With history [12, 0, 0, 0] the loads are 0.5 * (count + history) = [8, 2, 2, 2] (mean per rank 7,
    # nobody above 1.5 x 7: no replicas). Staying put gives ranks [10, 4]; the LPT bound is 8, and
    # staying put under that cap moves e1 (8 + 2 > 8) to rank 1: ranks [8, 6], 1 move, imbalance 8/7.
    placement = Placement.balanced(4, 2)
    stats = [_stats([4, 4, 4, 4])]
    quiet = plan(stats, (placement,), (CFG,), version=1, step=9, has_discarded=(False,)).layers[0]
    assert quiet.placement == placement and quiet.moves == 0 and quiet.imbalance_after == 1.0
    lp = plan(
        stats, (placement,), (CFG,), version=1, step=9, has_discarded=(False,), load_history=((12.0, 0.0, 0.0, 0.0),)
    ).layers[0]
    assert lp.placement.experts_on(0) == [0] and lp.placement.experts_on(1) == [1, 2, 3]
    assert lp.moves == 1 and lp.imbalance_after == pytest.approx(8 / 7)


def test_plan_refuses_inputs_for_different_numbers_of_layers():
    with pytest.raises(ValueError, match=r"stats 1, placements 2, configs 1, has_discarded 1"):
        plan([_stats([1, 1])], (Placement.balanced(2, 1),) * 2, (CFG,), version=1, step=0, has_discarded=(False,))


def test_plan_digest_is_16_hex_chars_and_changes_with_the_plan():
    p = plan([_stats([1, 0])], (Placement.balanced(2, 1),), (CFG,), version=1, step=3, has_discarded=(False,))
    q = plan([_stats([1, 0])], (Placement.balanced(2, 1),), (CFG,), version=1, step=4, has_discarded=(False,))
    assert len(p.digest()) == 16 and int(p.digest(), 16) >= 0
    assert p.digest() != q.digest()


def test_changes_experts_means_a_removal_or_an_addition():
    base = plan(
        [_stats([1, 1])], (Placement.balanced(2, 1),), (CFG,), version=1, step=0, has_discarded=(False,)
    ).layers[0]
    assert not base.changes_experts()
    only_removed = LayerPlan(0, (1,), (0,), (), Placement.balanced(1, 1), 1, 0, 1.0, 1.0)
    assert only_removed.changes_experts()
    added = plan(
        [_stats([1, 1], unrouted=(1.0, 0.0))],
        (Placement.balanced(2, 1),),
        (CFG,),
        version=1,
        step=0,
        has_discarded=(False,),
    ).layers[0]
    assert added.removed == () and len(added.added) == 1 and added.changes_experts()


def test_two_adds_get_consecutive_seeds_and_the_imbalance_before_uses_the_old_placement():
    # One layer, version 2: seed 2000 * 16 = 32000 for the first add, 32001 for the second. Unrouted tokens
    # in two neighbourhoods (e0: two tokens, e1: one) -> two adds, the most crowded first.
    s = _stats([3, 1])
    s.unrouted_sum_ED += torch.tensor([[2.0, 0.0], [0.0, 5.0]], dtype=torch.float64)
    s.num_unrouted_E += torch.tensor([2.0, 1.0], dtype=torch.float64)
    cfg = planner_cfg(min_experts=1, max_experts=8, max_adds_per_event=2)
    lp = plan([s], (Placement.balanced(2, 2),), (cfg,), version=2, step=1, has_discarded=(False,)).layers[0]
    assert [a.seed for a in lp.added] == [32000, 32001]
    assert [a.gate for a in lp.added] == [(1.0, 0.0), (0.0, 1.0)]
    assert lp.imbalance_before == 1.5  # old ranks [3, 1]: max 3 / mean 2


def test_imbalance_before_is_reported_for_a_balanced_layer():
    lp = plan(
        [_stats([4, 4, 4, 4])],
        (Placement.balanced(4, 2),),
        (CFG,),
        version=1,
        step=9,
        has_discarded=(False,),
        load_history=((12.0, 0.0, 0.0, 0.0),),
    ).layers[0]
    assert lp.imbalance_before == 1.0  # measured on the window counts, not the history

"""The plan actor's logic (PlanServer) without Ray: merging, plan cache, re-sends after a restart.

Two ranks, one MoE layer of 4 experts on ep 2 (balanced: e0, e1 on rank 0; e2, e3 on rank 1), D = 3.
Each rank sends different statistics:
  rank 0: counts [2, 0, 1, 0], 3 tokens with k = 1
  rank 1: counts [1, 0, 0, 0], 1 token with k = 1, and 1 token with k = 0 at x = (2, 0, 0), nearest e0
Summed: counts [3, 0, 1, 0], k histogram [1, 4, 0, ...], one unrouted token, unrouted sum (2, 0, 0).
(Rank 0 alone would add nothing; rank 1 alone would also remove e2: only the sum gives the plan below.)

The plan, worked by hand (planning/planner.py, planning/packing.py):
  remove: zero counts -> e1, e3 (4 - min_experts 1 = 3 may go); kept = (0, 2); remember e3 (last removed)
  add:    one token unrouted -> one expert (room 6 - 2), gate (2, 0, 0) / 2 = (1, 0, 0), init
          reuse_discarded of the removed e3 (coefficient 1), seed (version 1 * 1000 + layer 0) * 16 + 0
  loads of the new set [old e0, old e2, new] = [3, 1, max(1 unrouted / 1 add, 3, 1) = 3]; mean per rank
          3.5, nothing above 1.5 x 3.5: no replicas
  place:  sticky, largest first: new 0 (home 0) -> rank 0; the new expert (no home) -> the emptier rank
          1; new 1 (old e2, home 1) -> rank 1. Ranks [3, 4], 0 moves (LPT reaches max 4 too, with 1 move)
          -> placement rank 0: [0], rank 1: [1, 2]
  imbalance before: old ranks [3 + 0, 1 + 0] -> 3 / 2 = 1.5; after: [3, 4] -> 4 / 3.5 = 8/7, the same
          as with nothing moved (imbalance_unmoved: kept experts stay, the new one goes to rank 1)
"""

import asyncio

import numpy as np
import pytest
import torch
from dynmoe_dist.cluster.coordinator import PlanServer, merge_rank_stats

from dynmoe_dist.config import AdaptiveConfig
from dynmoe_dist.coordination import PlanMismatch, PlanRequest
from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import AddSpec, LayerPlan, Plan, PlannerConfig
from dynmoe_dist.planning.stats import WindowStats

D = 3


def _request(version=1, step=26):
    return PlanRequest(
        version=version,
        step=step,
        placements=(Placement.balanced(4, 2),),
        configs=(PlannerConfig(MoEConfig(num_experts=4, max_experts=6), AdaptiveConfig()),),
        has_discarded=(False,),
        dims=(D,),
    )


def _arrays(counts, unrouted=None):
    s = WindowStats.empty(4, D, 6)
    s.counts_E += torch.tensor(counts, dtype=torch.float64)
    s.k_hist_K[1] += sum(counts)
    if unrouted is not None:
        s.unrouted_sum_ED[0] += torch.tensor(unrouted, dtype=torch.float64)
        s.num_unrouted_E[0] += 1
        s.k_hist_K[0] += 1
    return [s.to_flat().numpy()]


RANK0 = _arrays([2, 0, 1, 0])
RANK1 = _arrays([1, 0, 0, 0], unrouted=(2.0, 0.0, 0.0))

# Flat layout of one layer (WindowStats.to_flat): counts_E (4) | unrouted_sum_ED (4 x 3) | num_unrouted_E (4)
# | k_hist_K (max_experts 6 + 1 = 7).
SUMMED_FLAT = [3, 0, 1, 0] + [2, 0, 0] + [0, 0, 0] * 3 + [1, 0, 0, 0] + [1, 4, 0, 0, 0, 0, 0]

EXPECTED_LAYER = LayerPlan(
    layer=0,
    removed=(1, 3),
    kept=(0, 2),
    added=(AddSpec(init="reuse_discarded", gate=(1.0, 0.0, 0.0), source="experts", coeffs=((3, 1.0),), seed=16000),),
    placement=Placement(2, (((0, 0),), ((1, 0),), ((1, 1),))),
    remember_discarded=3,
    moves=0,
    imbalance_before=1.5,
    imbalance_after=4 / 3.5,
    imbalance_unmoved=4 / 3.5,
    dead=(1, 3),  # no token chose experts 1 and 3 in the window (the ones removed)
)
EXPECTED = Plan(version=1, step=26, layers=(EXPECTED_LAYER,), planned_by="ray")


def test_hand_worked_plan_is_what_the_planner_gives_for_the_summed_statistics():
    # The fixture itself: the hand-worked plan, field by field (a mismatch names the field).
    merged = merge_rank_stats({0: RANK0, 1: RANK1}, 2)
    assert merged[0].tolist() == SUMMED_FLAT
    got = asyncio.run(_both(PlanServer(2)))[0][0].layers[0]
    for field in ("removed", "kept", "placement", "remember_discarded", "moves", "imbalance_before"):
        assert getattr(got, field) == getattr(EXPECTED_LAYER, field), field
    assert got.imbalance_after == pytest.approx(8 / 7)
    assert got.added == EXPECTED_LAYER.added
    assert got.placement.experts_on(0) == [0] and got.placement.experts_on(1) == [1, 2]


async def _both(server, order=(0, 1)):
    stats = {0: RANK0, 1: RANK1}
    calls = [server.submit(1, rank, _request(), stats[rank]) for rank in order]
    return await asyncio.wait_for(asyncio.gather(*calls), timeout=5)


def test_every_rank_gets_the_plan_of_the_summed_statistics():
    results = asyncio.run(_both(PlanServer(2)))
    assert [r[0] for r in results] == [EXPECTED, EXPECTED]
    assert [r[1] for r in results] == [EXPECTED.digest()] * 2


def test_arrival_order_does_not_change_the_plan():
    forward = asyncio.run(_both(PlanServer(2), order=(0, 1)))
    backward = asyncio.run(_both(PlanServer(2), order=(1, 0)))
    assert forward[0][0] == backward[0][0] == EXPECTED
    assert forward[0][1] == backward[0][1] == EXPECTED.digest()


def test_restarted_server_rebuilds_the_window_from_resent_statistics():
    async def scenario():
        first = PlanServer(2)
        waiting = asyncio.ensure_future(first.submit(1, 0, _request(), RANK0))
        await asyncio.sleep(0.01)
        assert first.info()["pending_versions"] == {1: [0]}
        waiting.cancel()  # the actor died holding rank 0's statistics: they are gone with it
        restarted = PlanServer(2)
        # rank 1 arrives at the restarted actor; rank 0's call failed, so rank 0 sends the same again
        return await asyncio.wait_for(
            asyncio.gather(restarted.submit(1, 1, _request(), RANK1), restarted.submit(1, 0, _request(), RANK0)),
            timeout=5,
        )

    results = asyncio.run(scenario())
    assert [r[1] for r in results] == [EXPECTED.digest()] * 2


def test_repeated_or_late_submission_gets_the_cached_plan():
    async def scenario():
        server = PlanServer(2)
        first = await _both(server)
        # A worker group restarted from an older checkpoint asks for version 1 again; whatever it sends,
        # the decision already taken for version 1 stands (and nobody waits for the other rank).
        again = await asyncio.wait_for(server.submit(1, 0, _request(), _arrays([0, 0, 0, 0])), timeout=5)
        return first, again

    first, again = asyncio.run(scenario())
    assert again[1] == first[0][1] == EXPECTED.digest()


def test_a_resent_submission_replaces_the_earlier_one_of_that_rank():
    async def scenario():
        server = PlanServer(2)
        stale = asyncio.ensure_future(server.submit(1, 0, _request(), _arrays([9, 9, 9, 9])))
        await asyncio.sleep(0.01)
        results = await asyncio.wait_for(
            asyncio.gather(server.submit(1, 0, _request(), RANK0), server.submit(1, 1, _request(), RANK1)), timeout=5
        )
        await asyncio.wait_for(stale, timeout=5)
        return results

    results = asyncio.run(scenario())
    assert results[0][0] == EXPECTED  # rank 0's stale counts 9 would have removed nothing
    assert results[0][1] == EXPECTED.digest()


def test_conflicting_request_for_the_same_version_is_refused():
    async def scenario():
        server = PlanServer(2)
        asyncio.ensure_future(server.submit(1, 0, _request(step=26), RANK0))
        await asyncio.sleep(0.01)
        await server.submit(1, 1, _request(step=27), RANK1)

    with pytest.raises(PlanMismatch, match="version 1 differs"):
        asyncio.run(scenario())


def test_bad_submissions_are_refused_with_the_values():
    server = PlanServer(2)
    with pytest.raises(ValueError, match=r"rank \(2\) outside the job's world of 2"):
        asyncio.run(server.submit(1, 2, _request(), RANK0))
    with pytest.raises(ValueError, match="request version 1"):
        asyncio.run(server.submit(2, 0, _request(), RANK0))
    with pytest.raises(ValueError, match=r"world_size \(0\)"):
        PlanServer(0)


def test_merge_adds_in_rank_order():
    # Three ranks, two layers, every rank contributing something different, arriving as 2, 0, 1.
    # Layer 0, entry 0: float addition does not associate. In rank order (1 + 1) + 1e16 = 1e16 + 2
    # (representable: the spacing of doubles at 1e16 is 2); in arrival order (1e16 + 1) + 1 = 1e16
    # (each +1 rounds away). No single rank gives 1e16 + 2.
    # Layer 0, entry 1: 10 + 200 + 3000 = 3210 (every rank counted once). Layer 1: [1, 2] + [30, 40] + [500, 600].
    by_rank = {
        2: [np.array([1e16, 3000.0]), np.array([500.0, 600.0])],
        0: [np.array([1.0, 10.0]), np.array([1.0, 2.0])],
        1: [np.array([1.0, 200.0]), np.array([30.0, 40.0])],
    }
    merged = merge_rank_stats(by_rank, 3)
    assert [m.tolist() for m in merged] == [[1e16 + 2, 3210.0], [531.0, 642.0]]
    assert merged[0][0] != 1e16
    # The submissions themselves are left as they came (the sum is a new array).
    assert by_rank[0][0].tolist() == [1.0, 10.0] and by_rank[0][1].tolist() == [1.0, 2.0]


def test_merge_refuses_a_missing_rank():
    with pytest.raises(AssertionError, match=r"ranks \[1\]"):
        merge_rank_stats({0: [np.zeros(2)], 2: [np.zeros(2)]}, 3)

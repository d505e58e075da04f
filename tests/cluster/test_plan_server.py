"""The plan actor's logic (PlanServer) without Ray: merging, plan cache, re-sends after a restart.

Two ranks, one MoE layer of 4 experts on ep 2, D = 3. Summed window: counts [3, 0, 1, 0] -> experts 1 and 3
are removed; one token (on rank 1) found no expert -> one expert is added with gate (1, 0, 0).
"""

import asyncio

import numpy as np
import pytest
import torch
from dynmoe_dist.cluster.coordinator import PlanServer, merge_rank_stats, stats_from_arrays

from dynmoe_dist.config import AdaptiveConfig
from dynmoe_dist.coordination import PlanMismatch, PlanRequest
from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import PlannerConfig
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
    return [s.to_flat().numpy()]


RANK0 = _arrays([2, 0, 1, 0])
RANK1 = _arrays([1, 0, 0, 0], unrouted=(2.0, 0.0, 0.0))


def _expected(request=None):
    request = request or _request()
    return request.make_plan(stats_from_arrays(merge_rank_stats({0: RANK0, 1: RANK1}, 2), request), "ray")


async def _both(server, order=(0, 1)):
    stats = {0: RANK0, 1: RANK1}
    calls = [server.submit(1, rank, _request(), stats[rank]) for rank in order]
    return await asyncio.wait_for(asyncio.gather(*calls), timeout=5)


def test_every_rank_gets_the_plan_of_the_summed_statistics():
    results = asyncio.run(_both(PlanServer(2)))
    expected = _expected()
    assert [r[1] for r in results] == [expected.digest()] * 2
    plan = results[0][0]
    assert plan.planned_by == "ray" and plan.version == 1
    assert plan.layers[0].removed == (1, 3)
    assert len(plan.layers[0].added) == 1 and plan.layers[0].added[0].gate == pytest.approx((1.0, 0.0, 0.0))


def test_arrival_order_does_not_change_the_plan():
    forward = asyncio.run(_both(PlanServer(2), order=(0, 1)))
    backward = asyncio.run(_both(PlanServer(2), order=(1, 0)))
    assert forward[0][1] == backward[0][1] == _expected().digest()


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
    assert [r[1] for r in results] == [_expected().digest()] * 2


def test_repeated_or_late_submission_gets_the_cached_plan():
    async def scenario():
        server = PlanServer(2)
        first = await _both(server)
        # A worker group restarted from an older checkpoint asks for version 1 again; whatever it sends,
        # the decision already taken for version 1 stands (and nobody waits for the other rank).
        again = await asyncio.wait_for(server.submit(1, 0, _request(), _arrays([0, 0, 0, 0])), timeout=5)
        return first, again

    first, again = asyncio.run(scenario())
    assert again[1] == first[0][1] == _expected().digest()


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
    assert results[0][1] == _expected().digest()  # counts 9 would have removed nothing


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
    # float addition does not associate: (1e16 + 1) + 1 == 1e16, but (1 + 1) + 1e16 == 1e16 + 2
    by_rank = {2: [np.array([1.0])], 0: [np.array([1e16])], 1: [np.array([1.0])]}
    assert merge_rank_stats(by_rank, 3)[0].tolist() == [1e16]

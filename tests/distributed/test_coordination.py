"""The torchrun coordinator refuses to plan when the ranks' requests disagree: every rank raises, none
applies a plan made for another rank's state (the Ray path's check is in tests/cluster/test_plan_server.py)."""

import pytest

from dynmoe_dist.parallel.simulate import run_simulated


def _request(step):
    from dynmoe_dist.config import AdaptiveConfig
    from dynmoe_dist.coordination import PlanRequest
    from dynmoe_dist.moe import MoEConfig
    from dynmoe_dist.planning.placement import Placement
    from dynmoe_dist.planning.planner import PlannerConfig

    return PlanRequest(
        version=1,
        step=step,
        placements=(Placement.balanced(4, 2),),
        configs=(PlannerConfig(MoEConfig(dim=3, num_experts=4), AdaptiveConfig()),),
        has_discarded=(False,),
        dims=(3,),
    )


def submit(diverge: bool):
    import torch.distributed as dist

    from dynmoe_dist.coordination import CollectiveCoordinator, PlanMismatch
    from dynmoe_dist.parallel.groups import build_groups
    from dynmoe_dist.planning.stats import WindowStats

    rank = dist.get_rank()
    stats = WindowStats.empty(4, 3, 8)
    stats.counts_E += 1.0
    request = _request(step=10 + (rank if diverge else 0))
    try:
        plan = CollectiveCoordinator(build_groups(2)).submit(request, [stats])
    except PlanMismatch as err:
        return f"mismatch: {err}"
    return plan.digest()


@pytest.mark.parametrize("diverge", [False, True])
def test_every_rank_checks_that_the_requests_agree(diverge):
    results = run_simulated(submit, 2, args=(diverge,), timeout_s=120)
    if diverge:
        assert all(r.startswith("mismatch") and "different plans for version 1" in r for r in results), results
    else:
        assert results[0] == results[1] and not results[0].startswith("mismatch")

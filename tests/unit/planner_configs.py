"""The planner's inputs for unit tests, built from the run config's own section types ([moe], [adaptive])."""

from dynmoe_dist.config import AdaptiveConfig
from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.planning.planner import PlannerConfig


def planner_cfg(min_experts=1, max_experts=8, adapt_experts=True, **adaptive) -> PlannerConfig:
    """A layer with min/max experts (top-any, or top-k when adapt_experts is False) and [adaptive] options."""
    moe = MoEConfig(
        num_experts=min_experts,
        min_experts=min_experts,
        max_experts=max_experts,
        router="top_any" if adapt_experts else "top_k",
        top_k=1,
    )
    return PlannerConfig(moe, AdaptiveConfig(**adaptive))

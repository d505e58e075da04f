"""adaptive.min_unrouted_share: add an expert only when enough of the window's tokens selected none."""

import pytest
import torch

from dynmoe_dist.config import AdaptiveConfig, load_config
from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import PlannerConfig, plan_layer, wants_new_expert
from dynmoe_dist.planning.stats import WindowStats


def _window(num_tokens: int, num_unrouted: int) -> WindowStats:
    """A window of num_tokens tokens over 2 experts (D = 2): the unrouted ones all nearest expert 0, at x = (1, 0);
    the others select expert 1 alone."""
    stats = WindowStats.empty(2, 2, 4)
    selected_TE = torch.zeros(num_tokens, 2, dtype=torch.bool)
    selected_TE[num_unrouted:, 1] = True
    scores_TE = torch.tensor([[0.9, 0.1]]).expand(num_tokens, 2)
    stats.add_tokens(selected_TE, scores_TE, torch.tensor([[1.0, 0.0]]).expand(num_tokens, 2))
    return stats


def _num_added(stats: WindowStats, share: float) -> int:
    cfg = PlannerConfig(MoEConfig(num_experts=2, max_experts=4), AdaptiveConfig(min_unrouted_share=share))
    return len(plan_layer(0, stats, Placement.default(2, 1), cfg, has_discarded=False).added)


def test_hand_worked_threshold():
    # 3 of 100 tokens with k = 0: share 0.03
    window = _window(100, 3)
    assert (window.num_tokens, window.num_unrouted) == (100.0, 3.0)
    assert _num_added(window, 0.0) == 1  # the reference: any unrouted token adds an expert
    assert _num_added(window, 0.02) == 1  # 0.03 > 0.02
    assert _num_added(window, 0.03) == 0  # not strictly above
    assert _num_added(window, 0.5) == 0
    assert _num_added(_window(100, 0), 0.0) == 0  # nobody unrouted: no add, whatever the share


def test_wants_new_expert_is_the_rule_alone():
    assert wants_new_expert(_window(10, 6), AdaptiveConfig(min_unrouted_share=0.5))  # 0.6 > 0.5
    assert not wants_new_expert(_window(10, 5), AdaptiveConfig(min_unrouted_share=0.5))  # 0.5 is not above


def test_option_is_validated_and_documented():
    assert load_config(None, ["adaptive.min_unrouted_share=0.1"]).adaptive.min_unrouted_share == 0.1
    with pytest.raises(ValueError, match=r"adaptive.min_unrouted_share \(1.0\) must be in \[0, 1\)"):
        AdaptiveConfig(min_unrouted_share=1.0)


def test_a_one_token_window_divides_by_its_one_token():
    # 1 token, unrouted: share 1 / 1 = 1.0 > 0.75 (a floor of 2 tokens would make it 0.5 and grow nothing).
    assert wants_new_expert(_window(1, 1), AdaptiveConfig(min_unrouted_share=0.75))
    assert not wants_new_expert(_window(1, 0), AdaptiveConfig(min_unrouted_share=0.0))  # nobody unrouted

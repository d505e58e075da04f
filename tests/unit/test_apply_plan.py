"""Applying a plan in one process: init strategies on hand-made weights, remove-only events keep the
function, the router's optimizer moments follow its rows, added experts start with fresh state."""

import pytest
import torch

from dynmoe_dist.config import AdaptiveConfig
from dynmoe_dist.moe import MoEConfig, MoELayer
from dynmoe_dist.parallel.expert_parallel import parallelize
from dynmoe_dist.parallel.groups import single_process
from dynmoe_dist.parallel.migrate import apply_layer_plan
from dynmoe_dist.planning.planner import PlannerConfig, plan_layer
from dynmoe_dist.planning.stats import WindowStats

D, F, E = 4, 6, 4


def _layer():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=D, ffn_dim=F, num_experts=E, max_experts=8)).double()
    with torch.no_grad():  # hand-made experts: every parameter of expert e equals e + 1
        for e, expert in enumerate(layer.experts.experts):
            for p in expert.parameters():
                p.fill_(e + 1.0)
    return layer, parallelize(layer, single_process())[0]


def _stats(counts, unrouted=True):
    s = WindowStats.empty(len(counts), D, 8)
    s.counts_E += torch.tensor(counts, dtype=torch.float64)
    if unrouted:
        s.unrouted_sum_ED[0] += torch.tensor([0.0, 3.0, 4.0, 0.0], dtype=torch.float64)
        s.num_unrouted_E[0] += 2
    return s


def _cfg(layer, strategy="reuse_discarded"):
    return PlannerConfig(layer.config, AdaptiveConfig(expert_init=strategy))


def _apply(built, counts, strategy, discarded=None, optimizer=None):
    """Plan and apply one event; returns (layer plan, new shard, remembered discarded expert)."""
    layer, shard = built
    lp = plan_layer(
        0, _stats(counts), shard.placement, _cfg(layer, strategy), has_discarded=discarded is not None, seed=5
    )
    optimizer = optimizer or torch.optim.AdamW(layer.parameters())
    return (lp, *apply_layer_plan(lp, shard, optimizer, single_process(), discarded))


@pytest.mark.parametrize(
    "strategy, counts, value",
    [
        ("average", [1, 1, 2, 4], (1 + 2 + 3 + 4) / 4),
        ("weighted_average", [1, 1, 2, 4], (1 * 1 + 2 * 1 + 3 * 2 + 4 * 4) / 8),
        ("most_activated", [1, 1, 2, 4], 4.0),
        ("reuse_discarded", [1, 0, 2, 0], 4.0),  # experts 1 and 3 removed: the last one removed is reused
    ],
)
def test_new_expert_weights(strategy, counts, value):
    layer, shard = _layer()
    lp, shard, _ = _apply((layer, shard), counts, strategy)
    assert shard.local_experts == list(range(lp.num_experts))
    new = layer.experts.experts[-1]
    assert len(layer.experts) == lp.num_experts == layer.num_experts
    for p in new.parameters():
        torch.testing.assert_close(p, torch.full_like(p, value))
    torch.testing.assert_close(layer.router.weight[-1], torch.tensor([0.0, 0.6, 0.8, 0.0], dtype=torch.float64))
    assert layer.router.threshold[-1] == 0


def test_reuse_discarded_remembers_across_events():
    layer, shard = _layer()
    _, shard, discarded = _apply((layer, shard), [3, 0, 3, 3], "reuse_discarded")  # removes 1 (value 2), adds a copy
    assert [float(t.flatten()[0]) for t in discarded] == [2.0] * 4
    _apply((layer, shard), [3, 3, 3, 3], "reuse_discarded", discarded=discarded)  # nothing removed now
    for p in layer.experts.experts[-1].parameters():
        assert torch.all(p == 2.0)


def test_random_init_is_seeded():
    (a, shard_a), (b, shard_b) = _layer(), _layer()
    _apply((a, shard_a), [1, 1, 1, 1], "random")
    _apply((b, shard_b), [1, 1, 1, 1], "random")
    for p, q in zip(a.experts.experts[-1].parameters(), b.experts.experts[-1].parameters()):
        assert torch.equal(p, q)
    assert a.experts.experts[-1].w_in.std() > 0


def test_remove_only_event_keeps_outputs_on_recorded_batch():
    layer, shard = _layer()
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.normal_()
        layer.router.threshold[2] = 10.0  # never selected
    x = torch.randn(30, D, dtype=torch.float64)
    before = layer(x)
    counts = before.routing.gates.detach().gt(0).sum(0).tolist()
    assert counts[2] == 0
    stats = _stats(counts, unrouted=False)
    lp = plan_layer(0, stats, shard.placement, _cfg(layer), has_discarded=False)
    assert lp.removed == (2,) and lp.added == ()
    apply_layer_plan(lp, shard, torch.optim.AdamW(layer.parameters()), single_process(), None)
    torch.testing.assert_close(layer(x).output, before.output, rtol=0, atol=0)


def test_router_moments_follow_rows_and_new_experts_start_fresh():
    layer, shard = _layer()
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(8, D, dtype=torch.float64)).output.sum().backward()
    opt.step()
    moments = opt.state[layer.router.weight]["exp_avg"].clone()
    kept_expert = layer.experts.experts[0]
    _apply((layer, shard), [1, 0, 2, 3], "average", optimizer=opt)  # remove 1, add one
    state = opt.state[layer.router.weight]
    torch.testing.assert_close(state["exp_avg"][:3], moments[[0, 2, 3]])
    assert torch.all(state["exp_avg"][3] == 0)
    assert layer.experts.experts[0] is kept_expert and kept_expert.w_in in opt.state
    assert layer.experts.experts[-1].w_in not in opt.state

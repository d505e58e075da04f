"""Adaptive experts across ranks (gloo), against one process:
- a training run whose windows remove and add experts keeps world-size invariance (1 vs 2 vs 3 ranks);
- the same hand-made plan (remove, add, move, replicate) applied on 1 and on 3 ranks gives the same
  model function and the same losses over the next 10 steps;
- a moved expert's optimizer state is bitwise equal after the move;
- replicas stay bitwise identical (weights and optimizer state) over several steps.
"""

import functools

import pytest
import torch
from tiny_runs import tiny_run_overrides

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated
from dynmoe_dist.planning.placement import Placement
from dynmoe_dist.planning.planner import AddSpec, LayerPlan, Plan

STEPS = 16


def _config(ep_size):
    return load_config(None, tiny_run_overrides(ep_size, STEPS, period=6, expert_init="average"))


def _trainer(ep_size):
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller

    trainer = Trainer(_config(ep_size))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    layer0, layer1 = trainer.moe_layers
    with torch.no_grad():
        layer0.router.threshold[1] = 10.0  # expert 1 of layer 0 is never chosen: removed at the first event
        layer1.router.threshold.fill_(0.35)  # many tokens of layer 1 find no expert: one is added
    return trainer, adaptive


def adaptive_run(ep_size):
    from dynmoe_dist.train.run import step_once

    trainer, adaptive = _trainer(ep_size)
    losses, experts, events = [], [], []
    for _ in range(STEPS):
        record, new_events = step_once(trainer, adaptive, [])
        losses.append(record["loss"])
        experts.append(record["num_experts"])
        events += new_events
    return losses, experts, events


def _hand_plan(ep_size, version=1, step=3):
    """Layer 0: remove expert 1, add an 'average' expert, and on 3 ranks move experts and replicate 0."""
    if ep_size == 1:
        placement = Placement.balanced(5, 1)
    else:  # new ids 0..4 = old 0, 2, 3, 4, new. expert 0 on every rank; old 4 (new 3) moves to rank 0
        placement = Placement.from_rank_lists(3, 5, [[0, 3], [0, 1, 4], [0, 2]])
    added = AddSpec("average", tuple([0.25] * 16), "experts", tuple((e, 0.25) for e in (0, 2, 3, 4)))
    lp0 = LayerPlan(0, (1,), (0, 2, 3, 4), (added,), placement, 1, 0, 1.0, 1.0)
    lp1 = LayerPlan(1, (), (0, 1, 2, 3, 4), (), Placement.balanced(5, ep_size), None, 0, 1.0, 1.0)
    return Plan(version, step, (lp0, lp1))


def _expert_state(trainer, layer_index, expert):
    for e, module in trainer.parts.experts.shards[layer_index].local_modules():
        if e == expert:
            return {
                n: (p.detach().clone(), {k: v.clone() for k, v in trainer.parts.optimizer.state.get(p, {}).items()})
                for n, p in module.named_parameters()
            }
    return None


def hand_plan_run(ep_size):
    trainer, adaptive = _trainer(ep_size)
    adaptive.schedule = adaptive.schedule.__class__(10**9, 0, 1)  # no automatic events
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    moved_before = _expert_state(trainer, 0, 4)  # old id 4 lives on rank 2 of 3 before the plan
    adaptive.apply(_hand_plan(ep_size))
    moved_after = _expert_state(trainer, 0, 3)  # new id 3 on rank 0 after it
    losses += [trainer.train_step()["loss"] for _ in range(10)]
    replica = _expert_state(trainer, 0, 0)
    return dict(
        losses=losses,
        moved_before=moved_before,
        moved_after=moved_after,
        replica=replica,
        num_experts=[layer.num_experts for layer in trainer.moe_layers],
    )


def world_worker(world):
    out = {"adaptive": adaptive_run(world)}
    if world == 3:
        out["hand"] = hand_plan_run(3)
    return out


@pytest.fixture(scope="module")
def reference():
    return {"adaptive": adaptive_run(1), "hand": hand_plan_run(1)}


@functools.lru_cache(maxsize=None)
def _cluster(size):
    return run_simulated(world_worker, size, args=(size,), timeout_s=300)


@pytest.fixture(scope="module", params=[2, 3])
def world(request):
    return request.param, _cluster(request.param)


@pytest.fixture(scope="module")
def three():
    return _cluster(3)


def _assert_losses(got, want, label):
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-9 * abs(b), f"{label} step {step}: {a} vs {b}"


def test_adaptive_training_is_world_size_invariant(world, reference):
    size, results = world
    losses, experts, events = results[0]["adaptive"]
    ref_losses, ref_experts, ref_events = reference["adaptive"]
    # the setup really removes and adds experts
    changes = [e for e in ref_events if e["kind"] == "event"]
    assert any(e["removed"] for e in changes) and any(e["added"] for e in changes)
    # every window's summary names the experts no token chose, the same on every world size
    windows = [e for e in events if e["kind"] == "window"]
    assert windows == [e for e in ref_events if e["kind"] == "window"] != []
    assert any(w["dead_experts"] != [[]] * len(w["dead_experts"]) for w in windows)
    assert experts == ref_experts, f"world {size}: expert counts {experts} vs {ref_experts}"
    _assert_losses(losses, ref_losses, f"world {size}")
    for rank_result in results[1:]:
        assert rank_result["adaptive"][0] == losses


def test_same_plan_on_one_and_three_ranks(three, reference):
    results = three
    ref = reference["hand"]
    _assert_losses(results[0]["hand"]["losses"], ref["losses"], "hand plan")
    assert results[0]["hand"]["num_experts"] == ref["num_experts"] == [5, 5]


def test_moved_expert_keeps_optimizer_state_bitwise(three):
    results = three
    before = results[2]["hand"]["moved_before"]  # rank 2 held old expert 4
    after = results[0]["hand"]["moved_after"]  # rank 0 holds it (new id 3) after the plan
    assert before is not None and after is not None
    for name, (param, state) in before.items():
        assert torch.equal(param, after[name][0])
        assert state.keys() == after[name][1].keys() and "exp_avg" in state
        for key in state:
            assert torch.equal(state[key], after[name][1][key]) and state[key].dtype == after[name][1][key].dtype


def test_replicas_stay_bitwise_identical(three):
    results = three
    copies = [r["hand"]["replica"] for r in results]
    assert all(c is not None for c in copies)
    for other in copies[1:]:
        for name, (param, state) in copies[0].items():
            assert torch.equal(param, other[name][0])
            for key in state:
                assert torch.equal(state[key], other[name][1][key])

"""The out-of-gradient controllers (moe/balance.py) on 1, 2 and 3 ranks: a top-any run with a compute budget and
the bias balance, and a top-k run with the bias balance, give the same losses, mean k and moved thresholds /
choice biases on every world size (float64, an uneven global batch of 7 sequences, adaptive events on), and a
run saved on 2 ranks mid-way resumes on 3 with the uninterrupted run's losses and router tensors."""

import pytest
from tiny_runs import tiny_run_overrides

from dynmoe_dist.parallel.simulate import run_simulated

STEPS, SAVE_AT = 12, 5  # adaptive events after steps 6 and 12
CASES = {
    "top_any": ["moe.target_k=2.0", "moe.balance='bias'", "moe.balance_rate=0.01"],
    "top_k": ["moe.router='top_k'", "moe.top_k=2", "moe.balance='bias'", "moe.balance_rate=0.01"],
}


def _config(case, out_dir, ep_size, resume=""):
    from dynmoe_dist.config import load_config

    return load_config(
        None,
        [
            *tiny_run_overrides(ep_size, STEPS),
            "train.global_batch_size=7",  # 4 + 3 and 3 + 2 + 2 sequences: uneven shares
            *CASES[case],
            f"output.out_dir='{out_dir}'",
            f"output.resume='{resume}'",
        ],
    )


def controlled(router):
    """What the controllers move: a top-any router's thresholds, a top-k router's choice bias."""
    tensor = router.threshold if hasattr(router, "threshold") else router.choice_bias
    return tensor.detach().tolist()


def train(case, out_dir, ep_size, save_at=None, resume=""):
    """Train to STEPS with the adaptive hooks (resuming first when asked; writing a checkpoint after
    ``save_at`` steps when asked): the step records' losses and mean k, the router tensors at the end."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, step_once

    trainer = Trainer(_config(case, out_dir, ep_size, resume))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    checkpoints = trainer.checkpoint_manager(adaptive)
    if resume:
        checkpoints.resume(resume)
    losses, mean_k, saved = {}, {}, None
    while trainer.step < STEPS:
        record, _ = step_once(trainer, adaptive, [])
        losses[record["step"]], mean_k[record["step"]] = record["loss"], record["mean_k"]
        if trainer.step == save_at:
            saved = str(checkpoints.save(trainer.step))
    routers = [controlled(layer.router) for layer in trainer.moe_layers]
    return {"losses": losses, "mean_k": mean_k, "routers": routers, "checkpoint": saved}


def world_worker(out_dir, world, checkpoints):
    """Every case trained whole at ep = world; at world 2 also saved mid-way, at world 3 also resumed."""
    results = {}
    for case in CASES:
        results[case] = train(case, f"{out_dir}/{case}", world, save_at=SAVE_AT if world == 2 else None)
        if world == 3:
            results[(case, "resumed")] = train(case, f"{out_dir}/{case}-resumed", world, resume=checkpoints[case])
    return results


def _assert_same(got, want, what):
    assert sorted(got["losses"]) == sorted(want["losses"]) != [], what
    for step, loss in got["losses"].items():
        assert abs(loss - want["losses"][step]) <= 1e-9 * abs(loss), f"{what}: loss at step {step}"
        assert got["mean_k"][step] == want["mean_k"][step], f"{what}: mean k at step {step}"  # integer counts
    for layer, (mine, theirs) in enumerate(zip(got["routers"], want["routers"], strict=True)):
        assert len(mine) == len(theirs) and max(abs(a - b) for a, b in zip(mine, theirs)) <= 1e-9, (what, layer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_rank")
    return {case: train(case, f"{out}/{case}", 1) for case in CASES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    return run_simulated(world_worker, 2, args=(str(out), 2, {}), timeout_s=300)


def test_the_controllers_move_the_routers(reference):
    top_any, top_k = reference["top_any"], reference["top_k"]
    assert all(max(t) - min(t) > 0.01 for t in top_any["routers"]) and all(max(b) > 0 for b in top_k["routers"])
    # one step of 7 sequences varies its k by about 0.2: the later half's mean is what the budget holds
    later = [top_any["mean_k"][step][0] for step in range(STEPS // 2 + 1, STEPS + 1)]
    assert abs(top_any["mean_k"][1][0] - 2.0) > 0.3 and abs(sum(later) / len(later) - 2.0) < 0.2


def test_two_ranks_move_the_routers_as_one(reference, two_ranks):
    for rank, results in enumerate(two_ranks):
        for case in CASES:
            _assert_same(results[case], reference[case], f"world 2 rank {rank} {case}")


def test_three_ranks_move_them_as_one_and_resume_the_two_rank_run_exactly(reference, two_ranks, tmp_path):
    saved = {case: two_ranks[0][case]["checkpoint"] for case in CASES}
    assert all(saved.values())
    three = run_simulated(world_worker, 3, args=(str(tmp_path), 3, saved), timeout_s=300)
    for rank, results in enumerate(three):
        for case in CASES:
            _assert_same(results[case], reference[case], f"world 3 rank {rank} {case}")
            resumed = results[(case, "resumed")]
            assert sorted(resumed["losses"]) == list(range(SAVE_AT + 1, STEPS + 1))
            later = {
                key: {s: v for s, v in reference[case][key].items() if s > SAVE_AT} for key in ("losses", "mean_k")
            }
            _assert_same(resumed, {**later, "routers": reference[case]["routers"]}, f"resumed on 3, rank {rank} {case}")

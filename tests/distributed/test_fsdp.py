"""FSDP2 beside expert parallelism (gloo, float64), against one process with no sharding:

- every combination of parallel.dense_sharding and parallel.expert_sharding gives the single-process
  losses and expert counts through adaptive events (experts removed, added, moved, replicated) on 2 and
  4 ranks (ep 2: the expert-dp groups have 1 and 2 ranks), and 3 ranks for the dense-only case;
- dense parameters really are sharded (each rank holds about 1/W of them), and stay so after an evaluation;
- expert sharding survives a rank whose experts get no rows for several steps;
- activation checkpointing gives the same gradients and counts every routed token once;
- checkpoints resume across sharding options (replicate -> fsdp -> replicate) with the uninterrupted losses.
"""

import functools
import json

import pytest
import torch
from tiny_runs import tiny_run_overrides

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated

STEPS = 14


def _config(dense="replicate", experts="replicate", ep_size=0, extra=()):
    return load_config(
        None,
        [
            *tiny_run_overrides(ep_size, STEPS, period=5, expert_init="average"),
            f"parallel.dense_sharding='{dense}'",
            f"parallel.expert_sharding='{experts}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
            *extra,
        ],
    )


def _trainer(config):
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller

    trainer = Trainer(config)
    layer0, layer1 = trainer.moe_layers
    with torch.no_grad():
        layer0.router.threshold[1] = 10.0  # never chosen: removed at the first event
        layer1.router.threshold.fill_(0.35)  # tokens find no expert: one is added
    return trainer, adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))


def adaptive_run(dense, experts, ep_size, extra=()):
    from dynmoe_dist.parallel.fsdp import is_sharded, local
    from dynmoe_dist.parallel.reshard import dense_named_parameters
    from dynmoe_dist.train.run import step_once

    trainer, adaptive = _trainer(_config(dense, experts, ep_size, extra=extra))
    losses, counts, events = [], [], []
    for _ in range(STEPS):
        record, new = step_once(trainer, adaptive, [])
        losses.append(record["loss"])
        counts.append(record["num_experts"])
        events += [e for e in new if e["kind"] == "event" and (e["removed"] or e["added"] or e["replicas"])]
    dense = [p for _, p in dense_named_parameters(trainer.model, trainer.parts.experts.shards) if is_sharded(p)]
    dense_local, dense_total = sum(local(p).numel() for p in dense), sum(p.numel() for p in dense)
    sharded = {n for n, p in trainer.model.named_parameters() if is_sharded(p)}
    trainer.evaluate()  # the end of a run: FSDP's root keeps its weights gathered after a forward; not here
    gathered = sorted(sharded - {n for n, p in trainer.model.named_parameters() if is_sharded(p)})
    return dict(
        losses=losses,
        counts=counts,
        events=len(events),
        dense_local=dense_local,
        dense_total=dense_total,
        gathered_after_evaluation=gathered,
    )


@functools.lru_cache(maxsize=None)
def _reference():
    return adaptive_run("replicate", "replicate", 1)


COMBOS = [("fsdp", "replicate"), ("replicate", "fsdp"), ("fsdp", "fsdp")]


def world_worker(combos, ep_size):
    return [adaptive_run(dense, experts, ep_size) for dense, experts in combos]


@functools.lru_cache(maxsize=None)
def _cluster(world):
    """ep 2 on 2 and 4 ranks (expert-dp groups of 1 and 2); on 3 ranks ep 3 (expert-dp groups of 1)."""
    ep_size = 3 if world == 3 else 2
    return COMBOS, run_simulated(world_worker, world, args=(COMBOS, ep_size), timeout_s=600)


def _assert_losses(got, want, label):
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-9 * abs(b), f"{label} step {step}: {a} vs {b}"


@pytest.mark.parametrize("world", [2, 4, 3])
def test_sharded_training_matches_one_process(world):
    ref = _reference()
    assert ref["events"] > 0, "the run must remove, add or replicate experts"
    combos, per_rank = _cluster(world)
    for index, (dense, experts) in enumerate(combos):
        label = f"world {world} dense={dense} experts={experts}"
        got = per_rank[0][index]
        assert got["counts"] == ref["counts"], label
        _assert_losses(got["losses"], ref["losses"], label)
        for rank in per_rank[1:]:
            assert rank[index]["losses"] == got["losses"], label
        assert all(r[index]["gathered_after_evaluation"] == [] for r in per_rank), label
        if dense == "fsdp":  # the ranks' shards partition the dense weights: about 1/W each
            shares = [r[index]["dense_local"] for r in per_rank]
            assert sum(shares) == got["dense_total"] > 0, label
            assert max(shares) <= 1.25 * got["dense_total"] / world, (label, shares)


# -- a rank whose experts get no rows ------------------------------------------------------------------
def starved_run(experts):
    """ep 2 on 4 ranks: the experts of ep rank 1 (3 and 4) are never chosen, so ranks 1 and 3 run them
    on zero rows every step; with expert_sharding = fsdp those ranks must still all-gather and
    reduce-scatter with their expert-dp peers."""
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(_config("fsdp", experts, 2, extra=["adaptive.enabled=false"]))
    for layer in trainer.moe_layers:
        with torch.no_grad():
            layer.router.threshold.copy_(torch.tensor([-1.0, -1.0, -1.0, 10.0, 10.0]))
    records = [trainer.train_step() for _ in range(6)]
    return [r["loss"] for r in records], [r["rank_load"] for r in records]


def test_expert_sharding_survives_ranks_with_no_rows():
    per_rank = run_simulated(_starved_both, 4, timeout_s=300)
    (ref_losses, loads), (losses, _) = per_rank[0]
    assert all(layer[1] == 0 for step in loads for layer in step), "ep rank 1 must receive no rows"
    _assert_losses(losses, ref_losses, "fsdp experts with starved ranks")


def _starved_both():
    return starved_run("replicate"), starved_run("fsdp")


# -- checkpoints across sharding options -------------------------------------------------------------
def _ckpt_config(out_dir, dense, experts, resume="", steps=STEPS, ep_size=2):
    return _config(
        dense,
        experts,
        ep_size,
        extra=[
            f"output.out_dir='{out_dir}'",
            f"output.resume='{resume}'",
            "output.checkpoint_every=6",
            "output.keep_checkpoints=5",
            f"train.max_steps={steps}",
        ],
    )


def run_to_end(out_dir, dense, experts, resume="", ep_size=2):
    from dynmoe_dist.train.run import run

    config = _ckpt_config(out_dir, dense, experts, resume, ep_size=ep_size)
    trainer, _ = _trainer(config)
    return run(config, trainer=trainer if not resume else None)


def _step_losses(out_dir):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}


def test_checkpoints_move_between_replicate_and_fsdp(tmp_path):
    """replicate (2 ranks) -> resume with both FSDP options (4 ranks) -> resume replicated (1 rank): every
    leg continues the uninterrupted run's losses, through the adaptive events after the resumes."""
    first, second, third = tmp_path / "replicate", tmp_path / "fsdp", tmp_path / "back"
    run_simulated(run_to_end, 2, args=(str(first), "replicate", "replicate"), timeout_s=300)
    reference = _step_losses(first)
    from_replicate = str(first / "checkpoints" / "step_000006")
    run_simulated(run_to_end, 4, args=(str(second), "fsdp", "fsdp", from_replicate), timeout_s=300)
    from_fsdp = str(second / "checkpoints" / "step_000012")
    run_to_end(str(third), "replicate", "replicate", from_fsdp, ep_size=1)
    for leg, first_step in ((_step_losses(second), 7), (_step_losses(third), 13)):
        assert sorted(leg) == list(range(first_step, STEPS + 1))
        for step, loss in leg.items():
            assert abs(loss - reference[step]) <= 1e-9 * abs(reference[step]), step


# -- bf16 with FSDP: the planner's gate edits survive the next optimizer step ----------------------------
def gate_edit_run():
    from dynmoe_dist.planning.placement import Placement
    from dynmoe_dist.planning.planner import AddSpec, LayerPlan, Plan

    config = _config("fsdp", "fsdp", 2, extra=["train.precision='bf16'", "train.lr=0.001", "train.warmup_steps=0"])
    trainer, adaptive = _trainer(config)
    trainer.train_step()
    gate = tuple(float(v) for v in torch.linspace(-1, 1, 16) / torch.linspace(-1, 1, 16).norm())
    added = AddSpec("random", gate, "random", seed=7)
    lp0 = LayerPlan(0, (), (0, 1, 2, 3, 4), (added,), Placement.balanced(6, 2), None, 0, 1.0, 1.0)
    lp1 = LayerPlan(1, (), (0, 1, 2, 3, 4), (), Placement.balanced(5, 2), None, 0, 1.0, 1.0)
    adaptive.apply(Plan(1, 1, (lp0, lp1)))
    router = trainer.moe_layers[0].router
    edited = (router.weight[5].detach().clone(), router.threshold[5].detach().clone())
    record = trainer.train_step()
    after = (router.weight[5].detach().clone(), router.threshold[5].detach().clone())
    return dict(
        gate=torch.tensor(gate),
        edited=edited,
        after=after,
        dtype=str(router.weight.dtype),
        lr=record["lr"],
        loss=record["loss"],
    )


def test_gate_edits_survive_the_next_step_under_bf16_and_fsdp():
    for result in run_simulated(gate_edit_run, 2, timeout_s=300):
        gate, lr = result["gate"], result["lr"]
        assert result["dtype"] == "torch.float32"  # routers keep fp32 master weights, outside FSDP
        torch.testing.assert_close(result["edited"][0], gate.float(), rtol=0, atol=1e-7)
        assert float(result["edited"][1]) == 0.0
        # one fresh Adam step moves each entry by at most lr: the edit is there, not reverted
        assert float((result["after"][0] - gate).abs().max()) <= 1.001 * lr
        assert abs(float(result["after"][1])) <= 1.001 * lr
        assert torch.isfinite(torch.tensor(result["loss"]))


def gathered_weights_kept_run():
    return adaptive_run("fsdp", "fsdp", 2, extra=["parallel.fsdp_reshard_after_forward=false"])


def test_keeping_gathered_weights_until_the_backward_changes_nothing_but_memory():
    ref = _reference()
    for rank in run_simulated(gathered_weights_kept_run, 2, timeout_s=300):
        assert rank["counts"] == ref["counts"]
        _assert_losses(rank["losses"], ref["losses"], "fsdp_reshard_after_forward=false")

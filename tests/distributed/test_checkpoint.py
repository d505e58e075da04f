"""Checkpoints keyed by logical expert: resuming on another world size / ep size continues with the
same losses as the uninterrupted run, also across expert add/remove events and from the middle of a
recording window (float64, 1e-9)."""

import json

import pytest
import torch
from tiny_runs import tiny_run_overrides, tweaked_trainer

from dynmoe_dist.parallel.simulate import run_simulated

STEPS, SAVE_AT = 16, 9  # events after steps 4, 10, 16; step 9 is inside the third window


def _config(out_dir, ep_size=0, resume=""):
    from dynmoe_dist.config import load_config

    return load_config(
        None,
        [
            *tiny_run_overrides(ep_size, STEPS, period=6, expert_init="reuse_discarded"),
            f"output.out_dir='{out_dir}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
            f"output.resume='{resume}'",
        ],
    )


def full_run(out_dir):
    from dynmoe_dist.train.run import run

    return run(_config(out_dir), trainer=tweaked_trainer(_config(out_dir)))


def partial_run(out_dir):
    """Train to SAVE_AT with the adaptive hooks and write a checkpoint there (then 'crash')."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.run import adaptive_controller, step_once

    trainer = tweaked_trainer(_config(out_dir))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    for _ in range(SAVE_AT):
        step_once(trainer, adaptive, [])
    assert trainer.recorders[0].window is not None, "the checkpoint must fall inside a window"
    return str(trainer.checkpoint_manager(adaptive).save(trainer.step)), [
        layer.num_experts for layer in trainer.moe_layers
    ]


def resumed_run(out_dir, checkpoint, ep_size):
    from dynmoe_dist.train.run import run

    return run(_config(out_dir, ep_size=ep_size, resume=checkpoint))


def _losses(out_dir):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, [
        (r["step"], r["layer"], r["num_experts"])
        for r in records
        if r["kind"] == "event" and (r["removed"] or r["added"])
    ]  # placement-only events depend on ep size


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    final = full_run(str(out))
    return final, *_losses(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    path, experts = run_simulated(partial_run, 2, args=(str(out),), timeout_s=300)[0]
    return path, experts


@pytest.mark.parametrize("world, ep_size", [(3, 3), (1, 1), (2, 1)])
def test_resume_on_another_world_size_matches_uninterrupted(reference, checkpoint, tmp_path, world, ep_size):
    final_ref, losses_ref, events_ref = reference
    path, experts_at_save = checkpoint
    assert experts_at_save != [5, 5], "experts must have changed before the checkpoint"
    if world == 1:
        final = resumed_run(str(tmp_path), path, ep_size)
    else:
        final = run_simulated(resumed_run, world, args=(str(tmp_path), path, ep_size), timeout_s=300)[0]
    losses, events = _losses(tmp_path)
    assert sorted(losses) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - losses_ref[step]) <= 1e-9 * abs(losses_ref[step]), f"step {step}"
    assert events == [e for e in events_ref if e[0] > SAVE_AT] != []
    assert final["num_experts"] == final_ref["num_experts"]
    assert abs(final["test_loss"] - final_ref["test_loss"]) <= 1e-9 * final_ref["test_loss"]


def resume_and_report(out_dir, checkpoint, ep_size):
    """Resume (no training) and report the placements in force and the expert files this rank read."""
    from dynmoe_dist.train import checkpoint_parts as ckpt
    from dynmoe_dist.train.loop import Trainer

    opened = []
    original = ckpt.read_tensors

    def recording(path, *args):
        opened.append(path.name)
        return original(path, *args)

    ckpt.read_tensors = recording
    try:
        trainer = Trainer(_config(out_dir, ep_size=ep_size))
        trainer.checkpoint_manager().resume(checkpoint)
    finally:
        ckpt.read_tensors = original
    return (
        [shard.placement.to_lists() for shard in trainer.parts.experts.shards],
        sorted(n for n in opened if n.startswith("experts")),
        trainer.groups.ep_rank,
        trainer.step,
    )


def test_resume_at_the_same_ep_size_keeps_the_saved_placement(checkpoint, tmp_path):
    """Rebalanced layouts and replicas survive a resume at the same ep size (not rebuilt as the default)."""
    from dynmoe_dist.parallel.reshard import owner_files_needed
    from dynmoe_dist.planning.placement import Placement

    path, _ = checkpoint
    meta = torch.load(f"{path}/meta.pt", weights_only=True)
    saved = [Placement.from_lists(json.loads(p)) for p in meta["states"]["experts"]["placements"]]
    assert any(p != Placement.default(p.num_experts, 2) for p in saved), "the saved layout must not be the default"
    results = run_simulated(resume_and_report, 2, args=(str(tmp_path), path, 2), timeout_s=300)
    for placements, opened, ep_rank, step in results:
        assert [Placement.from_lists(p) for p in placements] == saved
        assert step == SAVE_AT
        # a rank opens exactly the files of the owners of the experts it holds
        assert opened == [f"experts_ep{o}.safetensors" for o in owner_files_needed(saved, saved, ep_rank)]

"""LoRA runs (lora.enabled) of an imported Qwen3-MoE on 1, 2 and 3 gloo ranks (expert parallel over the whole
world: ep 1 / 2 / 3 with 8 experts, which 3 does not divide; an uneven global batch of 7) give the one-process
run's losses in float64 (1e-9): with the dense weights replicated and FSDP-sharded (frozen base, sharded
adapters), and converted to top-any, whose adaptive events remove and add experts (their adapters going and
coming with them) and re-place them across ranks. The adapters are drawn by name, so every world starts from
the same ones. A run saved on 2 ranks after an event resumes on 3 with the uninterrupted run's losses; its
checkpoint holds only what trains (the frozen base is rebuilt from model.path, train/checkpoint_base.py).
Top-any with lora.added_experts 'fresh_adapter' and 'trainable' (an added expert's fresh adapters drawn from the
event's seed; its own weights trained, replicated gradients summed in the layer's slots) train the same on every
world. With no expert adapters (lora.targets = ['attention']) and events that only remove and move experts, the
moved experts stay frozen and hold the base's weights, and the losses are the one-process run's.

Each world's group is spawned once: one run_simulated call trains every case."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import moe_run_settings, save_moe_run_files, train_saving  # noqa: E402

from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS, SAVE_AT = 6, 4  # events after steps 3 and 6 (adaptive.period_steps = 3)
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16")
CASES = {
    "native": (),
    "fsdp": ("parallel.dense_sharding='fsdp'",),
    "top-any": TOP_ANY,
    # what an added expert is (lora.added_experts): fresh adapters drawn from the event's seed, or trainable whole
    "fresh-adapter": (*TOP_ANY, "lora.added_experts='fresh_adapter'"),
    "trainable": (*TOP_ANY, "lora.added_experts='trainable'"),
}
RESUMED = ("native", "fsdp", "top-any")
# the experts frozen whole (no expert adapters), no adds: the events only remove experts and move them across ranks
FROZEN_EXPERTS = (*TOP_ANY, "lora.targets=['attention']", "adaptive.min_unrouted_share=0.999")


def train_case(root, out, world, extra, save_at=None, resume=""):
    """step -> loss to STEPS, the expert changes of the events, the test loss, the checkpoint written after
    ``save_at`` steps (resumed from ``resume`` first)."""
    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", world, *LORA, *extra, steps=STEPS, batch=7)
    trainer, losses, events, saved = train_saving(settings, out, STEPS, save_at, resume)
    test_loss = trainer.evaluate()["test_loss"]
    return {"losses": losses, "events": events, "test_loss": test_loss, "checkpoint": str(saved or "")}


def frozen_experts_case(root, out, world):
    """FROZEN_EXPERTS' losses, how many experts its events moved, and whether every expert (on this rank) is still
    frozen and holds the base's weights (a moved one was rebuilt on its new rank: parallel/migrate.py)."""
    from hf_tiny import changes

    from dynmoe_dist.config import load_config
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, calibrate_at_start, step_once

    files = (root / "qwen3_moe", root / "corpus.txt")
    settings = moe_run_settings(*files, world, *LORA, *FROZEN_EXPERTS, steps=STEPS, batch=7)
    trainer = Trainer(load_config(None, [*settings, f"output.out_dir='{out}'"]))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    calibrate_at_start(trainer)
    losses, events, moves = {}, [], 0
    while trainer.step < STEPS:
        record, records = step_once(trainer, adaptive, [])
        losses[record["step"]] = record["loss"]
        events += changes(records)
        moves += sum(r["moves"] for r in records if r["kind"] == "event")
    return {
        "losses": losses,
        "events": events,
        "test_loss": trainer.evaluate()["test_loss"],
        "moves": moves,
        "base_kept": experts_hold_their_base(trainer),
    }


def experts_hold_their_base(trainer):
    """Every expert this rank holds has no parameter that trains and equals the base expert its recipe names."""
    recipes = trainer.parts.experts.layout(trainable_only=True)["recipes"]
    for shard in trainer.parts.experts.shards:
        for expert, module in shard.local_modules():
            [(term, coeff)] = recipes[shard.index][expert]
            base = trainer.source.base_expert(shard.index, int(term.split("/")[1]))
            for name, p in module.named_parameters():
                if p.requires_grad or not torch.equal(p, base[name].to(p.dtype)):
                    return False
    return True


def worker(root, world, saved):
    """Every case whole at ep = world; at world 2 also saved after SAVE_AT steps, at world 3 also resumed."""
    results = {}
    for name, extra in CASES.items():
        out = root / f"{name}-{world}"
        save_at = SAVE_AT if world == 2 and name in RESUMED else None
        results[name] = train_case(root, out, world, extra, save_at=save_at)
        if name in saved:
            results[(name, "resumed")] = train_case(root, f"{out}-resumed", world, extra, resume=saved[name])
    results["frozen-experts"] = frozen_experts_case(root, root / f"frozen-experts-{world}", world)
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora"), "qwen3_moe", 8)


@pytest.fixture(scope="module")
def reference(root):
    return worker(root, 1, {})


@pytest.fixture(scope="module")
def two_ranks(root):
    return run_simulated(worker, 2, args=(root, 2, {}), timeout_s=900)


def assert_alike(got, want, what, steps=range(1, STEPS + 1)):
    assert sorted(got["losses"]) == list(steps), what
    for step in steps:
        a, b = got["losses"][step], want["losses"][step]
        assert abs(a - b) <= 1e-9 * abs(b), f"{what} step {step}: {a} != {b}"
    assert abs(got["test_loss"] - want["test_loss"]) <= 1e-9 * want["test_loss"], what


def test_two_ranks_train_like_one(reference, two_ranks):
    assert reference["top-any"]["events"], "the top-any case must add or remove experts"
    for rank, results in enumerate(two_ranks):
        for name in CASES:
            assert_alike(results[name], reference[name], f"{name} world 2 rank {rank}")
            assert results[name]["events"] == reference[name]["events"], name


def assert_frozen_experts_stay(results, reference, what):
    """Moved frozen experts stay frozen: the one-process losses, and every expert still the base's."""
    got = results["frozen-experts"]
    assert got["moves"] > 0, f"{what}: the events must move experts"
    assert_alike(got, reference["frozen-experts"], what)
    assert got["events"] == reference["frozen-experts"]["events"] and got["base_kept"], what


def test_moved_frozen_experts_stay_frozen(reference, two_ranks):
    assert reference["frozen-experts"]["base_kept"] and reference["frozen-experts"]["events"]
    for rank, results in enumerate(two_ranks):
        assert_frozen_experts_stay(results, reference, f"frozen experts world 2 rank {rank}")


def assert_trainable_only(checkpoint):
    """Every expert file holds adapters (and their Adam state) only; the experts' frozen weights are recipes."""
    from dynmoe_dist.train.checkpoint import read_meta
    from dynmoe_dist.train.checkpoint_parts import expert_file, expert_file_owners
    from dynmoe_dist.train.tensor_file import read_tensors

    owners = expert_file_owners(checkpoint)
    assert owners == [0, 1], owners
    for owner in owners:
        assert all(name.split("/")[3].startswith("lora_") for name in read_tensors(expert_file(checkpoint, owner)))
    assert read_meta(checkpoint)["states"]["experts"]["frozen_base"] == "model.path"


def test_three_ranks_train_like_one_and_resume_the_two_rank_run(root, reference, two_ranks):
    saved = {name: two_ranks[0][name]["checkpoint"] for name in RESUMED}
    assert all(saved.values())
    assert any(step <= SAVE_AT and removed for step, _, removed, *_ in reference["top-any"]["events"])
    for checkpoint in saved.values():
        assert_trainable_only(Path(checkpoint))
    for rank, results in enumerate(run_simulated(worker, 3, args=(root, 3, saved), timeout_s=900)):
        for name in CASES:
            assert_alike(results[name], reference[name], f"{name} world 3 rank {rank}")
            assert results[name]["events"] == reference[name]["events"], name
            if name in saved:
                later = range(SAVE_AT + 1, STEPS + 1)
                assert_alike(results[(name, "resumed")], reference[name], f"{name} resumed on 3, rank {rank}", later)
        assert_frozen_experts_stay(results, reference, f"frozen experts world 3 rank {rank}")

"""LoRA runs with a low-precision frozen base (lora.base_dtype 'bfloat16' and 'nf4') of an imported Qwen3-MoE on
1, 2 and 3 gloo ranks (ep 1 / 2 / 3 with 8 experts; an uneven global batch of 7) give the one-process run's
losses in float64 (1e-9), converted to top-any so that adaptive events add, remove and re-place experts (their
stored base moving with them bit for bit, new ones stored as the base is), with the dense weights replicated and
FSDP-sharded (a bf16 base sharded, an NF4 base whole on every rank, its adapters sharded), and a bf16 base's
experts FSDP-sharded over the world (ep 1); an expert sent as an event sends a replica or a moved expert arrives
holding the sender's stored bits. A bf16 and an NF4 run saved on 2 ranks after the event that added and removed
experts resume on 3 with the one-process run's losses (1e-9; the NF4 one's added experts re-quantised as the event
re-quantised them). Each world's group is spawned once: one run_simulated call trains every case; the test checks
how every case stores its base. The 3-rank world is marked slow (make test-slow)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import changes, moe_run_settings, save_moe_run_files, train_saving  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

pytest.importorskip("torchao")

STEPS, SAVE_AT = 6, 4  # events after steps 3 and 6 (adaptive.period_steps = 3)
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")
TOP_ANY = (
    "moe.router='top_any'",
    "moe.calibrate_k=1",
    "moe.calibrate_samples=16",
    "train.seed=2",
)  # seed 2: events remove too
FSDP = ("parallel.dense_sharding='fsdp'",)
CASES = {
    "bfloat16": ("lora.base_dtype='bfloat16'",),
    "bfloat16-fsdp": ("lora.base_dtype='bfloat16'", *FSDP),
    "nf4": ("lora.base_dtype='nf4'", "lora.added_experts='fresh_adapter'"),  # an added expert: fresh adapters
    "nf4-fsdp": ("lora.base_dtype='nf4'", *FSDP),
    # every expert on every ep rank (ep 1), FSDP-sharded over the world: a bf16 base gathered and re-sharded at events
    "bfloat16-fsdp-experts": ("lora.base_dtype='bfloat16'", "parallel.expert_sharding='fsdp'", "parallel.ep_size=1"),
}
RESUMED = ("bfloat16", "nf4")  # saved on 2 ranks after SAVE_AT steps, resumed on 3


def stored_kinds(model):
    """'bf16' / 'nf4' / 'plain' -> how many frozen expert weights are held so (every rank's own experts)."""
    from dynmoe_dist.moe import nf4
    from dynmoe_dist.moe.layer import find_moe_layers

    kinds = {"bf16": 0, "nf4": 0, "plain": 0}
    for _, layer in find_moe_layers(model):
        for expert in layer.experts.experts:
            for name in ("w_gate", "w_in", "w_out"):
                p = getattr(expert, name)
                kinds["nf4" if nf4.is_nf4(p) else "bf16" if str(p.dtype) == "torch.bfloat16" else "plain"] += 1
    return kinds


def case_settings(root, world, extra):
    return moe_run_settings(
        root / "qwen3_moe", root / "corpus.txt", world, *LORA, *TOP_ANY, *extra, steps=STEPS, batch=7
    )


def train_case(root, out, world, extra, save_at=None):
    """step -> loss, the expert changes of the events, the test loss, how the experts' base is held at the end, the
    checkpoint written after ``save_at`` steps."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, calibrate_at_start, step_once

    trainer = Trainer(load_config(None, [*case_settings(root, world, extra), f"output.out_dir='{out}'"]))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    checkpoints = trainer.checkpoint_manager(adaptive)
    calibrate_at_start(trainer)
    losses, events, saved = {}, [], None
    while trainer.step < STEPS:
        record, new_events = step_once(trainer, adaptive, [])
        losses[record["step"]] = record["loss"]
        events += changes(new_events)
        if trainer.step == save_at:
            saved = checkpoints.save(trainer.step)
    kinds = stored_kinds(trainer.parts.model)
    dense = dense_kinds(trainer.parts.model)
    copied = replica_bits(trainer) if world > 1 else None
    test_loss = trainer.evaluate()["test_loss"]
    return {
        "losses": losses,
        "events": events,
        "test_loss": test_loss,
        "kinds": kinds,
        "dense": dense,
        "copied": copied,
        "checkpoint": str(saved or ""),
    }


def replica_bits(trainer):
    """Rank 0's first expert of MoE layer 0 sent to rank 1 as an event sends a replica or a moved expert
    (parallel.migrate): the tensors that hold its parameters on each side (an NF4 weight's codes and scales)."""
    from dynmoe_dist.moe.frozen_base import storage_tensors
    from dynmoe_dist.parallel.migrate import recv_expert, send_expert

    groups, layer, optimizer = trainer.groups, trainer.parts.experts.layers[0], trainer.parts.optimizer
    if trainer.parts.experts.sharded:  # FSDP-sharded experts travel whole, gathered first (parallel.fsdp)
        return None
    if groups.rank == 0:
        module = layer.experts.experts[0]
        send_expert(module, optimizer, 1, groups)
    elif groups.rank == 1:
        module = recv_expert(layer.config, layer.router.weight, optimizer, 0, groups)
    else:
        return None
    return [t.detach().clone() for p in module.parameters() for t in storage_tensors(p)]


def dense_kinds(model):
    """How every adapted projection holds its frozen weight and its adapters: sorted set of (weight kind, weight
    sharded by FSDP, adapters sharded)."""
    import torch.nn as nn

    from dynmoe_dist.moe import nf4
    from dynmoe_dist.parallel.fsdp import is_sharded, local

    found = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and hasattr(module, "lora_a"):
            weight = module.weight
            kind = "nf4" if nf4.is_nf4(weight) else str(local(weight).dtype).removeprefix("torch.")
            found.add((kind, is_sharded(weight), is_sharded(module.lora_a)))
    return sorted(found)


def worker(root, world, saved=None):
    """Every case at ep = world; at world 2 the RESUMED ones also saved after SAVE_AT steps; with ``saved`` (name ->
    checkpoint) those also resumed from it (step -> loss, under (name, 'resumed'))."""
    results = {}
    for name, extra in CASES.items():
        save_at = SAVE_AT if world == 2 and name in RESUMED else None
        results[name] = train_case(root, root / f"{name}-{world}", world, extra, save_at)
        if saved and name in saved:
            out = root / f"{name}-{world}-resumed"
            _, losses, _, _ = train_saving(case_settings(root, world, extra), out, STEPS, resume=saved[name])
            results[(name, "resumed")] = losses
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora-base"), "qwen3_moe", 8)


@pytest.fixture(scope="module")
def reference(root):
    return worker(root, 1)


def assert_alike(got, want, what):
    assert sorted(got["losses"]) == list(range(1, STEPS + 1)), what
    for step, loss in want["losses"].items():
        assert abs(got["losses"][step] - loss) <= 1e-9 * abs(loss), (
            f"{what} step {step}: {got['losses'][step]} != {loss}"
        )
    assert abs(got["test_loss"] - want["test_loss"]) <= 1e-9 * want["test_loss"], what
    assert got["events"] == want["events"], what


def check_stored(results, name, world):
    """Every expert's base as the case stores it; every adapted projection's too: a bf16 one sharded by FSDP with
    its adapters, an NF4 one whole on every rank while its adapters are sharded."""
    kind = "bf16" if name.startswith("bfloat16") else "nf4"
    assert results["kinds"][kind] > 0 and sum(results["kinds"].values()) == results["kinds"][kind], (name, results)
    fsdp = name.endswith("fsdp") and world > 1
    dense = "bfloat16" if kind == "bf16" else "nf4"
    assert results["dense"] == [(dense, fsdp and kind == "bf16", fsdp)], (name, world, results["dense"])


def test_the_one_rank_runs_store_their_base_and_change_experts(reference):
    for name, results in reference.items():
        check_stored(results, name, 1)
        removed = any(removed for _, _, removed, _, _ in results["events"])
        assert removed and any(added for *_, added, _ in results["events"]), (name, results["events"])


@pytest.fixture(scope="module")
def two_ranks(root):
    return run_simulated(worker, 2, args=(root, 2), timeout_s=900)


def test_two_ranks_train_like_one(reference, two_ranks):  # about 30 s
    check_ranks(two_ranks, reference, 2)


@pytest.mark.slow
def test_three_ranks_train_like_one_and_resume_the_two_rank_run(root, reference, two_ranks):  # about 50 s
    """The RESUMED cases saved on 2 ranks after the event that added and removed experts resume on 3 with the
    one-process run's losses: the added experts rebuilt as the event formed them (an NF4 one re-quantised from its
    source's dequantised bits), whatever the world."""
    saved = {name: two_ranks[0][name]["checkpoint"] for name in RESUMED}
    assert all(saved.values())
    assert all(any(added for step, *_, added, _ in reference[name]["events"] if step < SAVE_AT) for name in RESUMED)
    ranks = run_simulated(worker, 3, args=(root, 3, saved), timeout_s=900)
    check_ranks(ranks, reference, 3)
    for rank, results in enumerate(ranks):
        for name in RESUMED:
            resumed, want = results[(name, "resumed")], reference[name]["losses"]
            assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1)), name
            for step, loss in resumed.items():
                assert abs(loss - want[step]) <= 1e-9 * abs(want[step]), f"{name} resumed on 3, rank {rank}, {step}"


def check_ranks(ranks, reference, world):
    for rank, results in enumerate(ranks):
        for name in CASES:
            assert_alike(results[name], reference[name], f"{name} world {world} rank {rank}")
            check_stored(results[name], name, world)
    copied = [name for name in CASES if ranks[0][name]["copied"] is not None]
    assert copied == [name for name in CASES if "experts" not in name]
    for name in copied:  # the copy holds the sender's stored bits (7 parameters; NF4 weights are 5 tensors each)
        sent, received = (ranks[r][name]["copied"] for r in (0, 1))
        assert len(sent) == len(received) == (7 if name.startswith("bfloat16") else 7 + 3 * 4), name
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(sent, received)), name

"""train.activation_checkpointing = 'block' with LoRA on an imported Qwen3-MoE, every lora.base_dtype ('run',
'bfloat16', 'nf4'), on 1, 2 and 3 gloo ranks (ep = world, 8 experts; an uneven global batch of 7), the dense
weights replicated or FSDP-sharded, and a bf16 base's experts FSDP-sharded over the world (ep 1): every step's
loss, the expert changes of the adaptive events (top-any: experts removed, added and moved) and every gradient the
optimizer steps with (adapters only: each rank's own tensors, FSDP shards included) equal the same run's without
checkpointing (float64; a bf16 or NF4 base computed in float64 against its stored weights, so 1e-12 holds for them
too), and the checkpointed losses equal the one-process run's (1e-9). The 'run' case keeps the import's native
routing (what bench lora trains). Each world's group is spawned once; the 3-rank world is marked slow."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import changes, moe_run_settings, save_moe_run_files  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

pytest.importorskip("torchao")

STEPS = 4  # an event after step 3 (adaptive.period_steps = 3), one step after it
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16", "train.seed=2")
FSDP = ("parallel.dense_sharding='fsdp'",)
CASES = {
    "run": ("lora.base_dtype='run'",),  # native routing, as bench lora runs it
    "bfloat16": ("lora.base_dtype='bfloat16'", *TOP_ANY),
    "nf4": ("lora.base_dtype='nf4'", *TOP_ANY),
    "bfloat16-fsdp": ("lora.base_dtype='bfloat16'", *TOP_ANY, *FSDP),
    "nf4-fsdp": ("lora.base_dtype='nf4'", *TOP_ANY, *FSDP),
    "bfloat16-fsdp-experts": (
        "lora.base_dtype='bfloat16'",
        *TOP_ANY,
        "parallel.expert_sharding='fsdp'",
        "parallel.ep_size=1",
    ),
}
SETTINGS = ("none", "block")


def train_case(root, out, world, extra):
    """Losses per step, the events' expert changes, per step the gradients the optimizer steps with (name -> this
    rank's tensor), and how many times the MoE layers ran."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.moe.layer import find_moe_layers
    from dynmoe_dist.parallel.fsdp import local
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, calibrate_at_start, step_once

    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", world, *LORA, *extra, steps=STEPS, batch=7)
    trainer = Trainer(load_config(None, [*settings, f"output.out_dir='{out}'"]))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    calibrate_at_start(trainer)
    grads = []

    def keep_gradients(optimizer, args, kwargs):  # after the gradient sync, before the update
        grads.append({n: local(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.parts.optimizer.register_step_pre_hook(keep_gradients)
    forwards = []  # every MoE layer's forward, the replays of checkpointed blocks included
    for _, layer in find_moe_layers(trainer.model):
        layer.register_forward_pre_hook(lambda *_: forwards.append(1))
    losses, events = [], []
    while trainer.step < STEPS:
        record, new_events = step_once(trainer, adaptive, [])
        losses.append(record["loss"])
        events += changes(new_events)
    return {"losses": losses, "events": events, "grads": grads, "forwards": len(forwards)}


def worker(root, world):
    return {
        (name, ac): train_case(
            root, root / f"{name}-{ac}-{world}", world, (*extra, f"train.activation_checkpointing='{ac}'")
        )
        for name, extra in CASES.items()
        for ac in SETTINGS
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora-ac"), "qwen3_moe", 8)


@pytest.fixture(scope="module")
def reference(root):
    return worker(root, 1)


def assert_checkpointing_changes_nothing(results, what):
    for name in CASES:
        plain, checkpointed = results[(name, "none")], results[(name, "block")]
        label = f"{name} {what}"
        assert checkpointed["events"] == plain["events"], label
        assert checkpointed["forwards"] == 2 * plain["forwards"] > 0, f"{label}: each block replayed once"
        for step, (got, want) in enumerate(zip(checkpointed["losses"], plain["losses"])):
            assert abs(got - want) <= 1e-12 * abs(want), f"{label} step {step + 1}: {got} != {want}"
        assert len(checkpointed["grads"]) == len(plain["grads"]) == STEPS, label
        for step, (got, want) in enumerate(zip(checkpointed["grads"], plain["grads"])):
            assert got.keys() == want.keys() and len(want) > 0, f"{label} step {step + 1}"
            assert all("lora_" in n for n in want), f"{label}: only adapters train"
            for n, grad in want.items():
                torch.testing.assert_close(got[n], grad, rtol=1e-12, atol=1e-12, msg=f"{label} step {step + 1} {n}")


def test_one_rank_checkpointed_equals_plain(reference):
    assert_checkpointing_changes_nothing(reference, "world 1")
    events = [e for name in CASES if name != "run" for e in reference[(name, "none")]["events"]]
    assert events, "top-any runs change experts at the event"


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # about 25 s and 35 s
def test_more_ranks_checkpointed_equal_plain_and_one_rank(root, reference, world):
    ranks = run_simulated(worker, world, args=(root, world), timeout_s=900)
    for rank, results in enumerate(ranks):
        assert_checkpointing_changes_nothing(results, f"world {world} rank {rank}")
        for name in CASES:
            got, want = results[(name, "block")], reference[(name, "none")]
            assert got["events"] == want["events"], (name, world, rank)
            for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
                assert abs(a - b) <= 1e-9 * abs(b), f"{name} world {world} rank {rank} step {step + 1}: {a} != {b}"

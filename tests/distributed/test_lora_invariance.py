"""LoRA runs (lora.enabled) of an imported Qwen3-MoE on 1, 2 and 3 gloo ranks (expert parallel over the whole
world: ep 1 / 2 / 3 with 8 experts, which 3 does not divide; an uneven global batch of 7) give the one-process
run's losses in float64 (1e-9): with the dense weights replicated and FSDP-sharded (frozen base, sharded
adapters), and converted to top-any, whose adaptive events remove and add experts (their adapters going and
coming with them) and re-place them across ranks. The adapters are drawn by name, so every world starts from
the same ones.

Each world's group is spawned once for the module: one run_simulated call trains every case."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hf_tiny import corpus_lines, moe_run_settings, save_moe_checkpoint, train_recorded  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS = 6  # events after steps 2 and 5 (adaptive.period_steps = 3)
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16")
CASES = {
    "native": (),
    "fsdp": ("parallel.dense_sharding='fsdp'",),
    "top-any": TOP_ANY,
}


def train_case(root, world, extra):
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import calibrate_at_start

    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", world, *LORA, *extra, steps=STEPS, batch=7)
    trainer = Trainer(load_config(None, settings))
    calibrate_at_start(trainer)
    _, losses, counts, events = train_recorded(trainer, STEPS)
    return {"losses": losses, "counts": counts, "events": events, "test_loss": trainer.evaluate()["test_loss"]}


def worker(root, world):
    return {name: train_case(root, world, extra) for name, extra in CASES.items()}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    save_moe_checkpoint("qwen3_moe", root / "qwen3_moe", 8)
    (root / "corpus.txt").write_text("\n".join(corpus_lines(80, 5)) + "\n")
    return root


@pytest.mark.parametrize("world", [2, 3])
def test_lora_trains_alike_on_two_and_three_ranks(root, world):
    reference = worker(root, 1)
    assert reference["top-any"]["events"], "the top-any case must add or remove experts"
    for rank, results in enumerate(run_simulated(worker, world, args=(root, world), timeout_s=900)):
        for name, want in reference.items():
            got = results[name]
            for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
                assert abs(a - b) <= 1e-9 * abs(b), f"{name} rank {rank} step {step}: {a} != {b}"
            assert got["counts"] == want["counts"] and got["events"] == want["events"], name
            assert abs(got["test_loss"] - want["test_loss"]) <= 1e-9 * want["test_loss"], name

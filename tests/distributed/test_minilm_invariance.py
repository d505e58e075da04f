"""minilm-sentiment (transformers.BertModel, the quick start's model with its upcycled top layer) trains the
same on 1 and 2 ranks, experts expert-parallel over both (float64 per-step losses to 1e-9), like the built
models do (tests/distributed/test_invariance.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS = 4


def minilm_losses(world):
    from dynmoe_dist.train.loop import Trainer

    config = load_config(
        None,
        [
            "task.name='minilm-sentiment'",
            "task.num_samples=120",
            "task.max_len=16",
            "task.seed=3",
            "model.num_layers=2",
            "model.moe_layers=[1]",
            "model.freeze=['embeddings']",
            "moe.num_experts=4",
            f"parallel.ep_size={world}",
            "train.precision='float64'",
            f"train.max_steps={STEPS}",
            "train.global_batch_size=8",
            "train.lr=5e-5",
            "train.warmup_steps=1",
            "adaptive.enabled=false",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
        ],
    )
    trainer = Trainer(config)
    assert type(trainer.model).__name__ == "HFSentenceClassifier", type(trainer.model)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def test_transformers_minilm_same_losses_on_one_and_two_ranks():
    ref = minilm_losses(1)
    for losses in run_simulated(minilm_losses, 2, args=(2,), timeout_s=300):
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: {got} vs {want}"

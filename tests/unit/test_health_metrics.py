"""The MoE health metrics of a step record (train/loop.py, train/recorder.py) agree with its counts."""

import pytest

from dynmoe_dist.config import load_config
from dynmoe_dist.train.loop import Trainer


def test_a_steps_k_histogram_utilisation_and_load_cv_agree_with_its_counts():
    trainer = Trainer(load_config(None, ["moe.num_experts=4", "train.global_batch_size=8", "task.max_len=16"]))
    record = trainer.train_step()
    for layer, hist in enumerate(record["k_histogram"]):
        tokens = sum(hist)
        assert tokens == 8 * 16  # every token of the batch, once
        assert sum(k * n for k, n in enumerate(hist)) / tokens == pytest.approx(record["mean_k"][layer])
        use = record["expert_utilization"][layer]
        assert use == pytest.approx([c / tokens for c in record["expert_load"][layer]])
        assert sum(use) == pytest.approx(record["mean_k"][layer])  # each token counted once per chosen expert
        loads = record["expert_load"][layer]
        mean = sum(loads) / len(loads)
        std = (sum((c - mean) ** 2 for c in loads) / len(loads)) ** 0.5
        assert record["load_cv"][layer] == pytest.approx(std / mean)

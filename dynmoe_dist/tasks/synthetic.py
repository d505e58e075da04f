"""A seeded text-classification task for tests and quick runs: no files, no downloads.

Each class owns a few "topic" tokens; a sample mixes topic tokens of its class with shared noise
tokens, so the label is learnable and different tokens favour different experts.
"""

from __future__ import annotations

import torch

from .base import ModelNeeds, Task, register

VOCAB = 64
NUM_CLASSES = 4
TOPIC_TOKENS = 8  # tokens 0..31 are topics (8 per class), 32..63 noise
SAMPLES = 2048


def make_split(n: int, seq_len: int, generator: torch.Generator):
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    topic = labels.unsqueeze(1) * TOPIC_TOKENS + torch.randint(0, TOPIC_TOKENS, (n, seq_len), generator=generator)
    noise = NUM_CLASSES * TOPIC_TOKENS + torch.randint(
        0, VOCAB - NUM_CLASSES * TOPIC_TOKENS, (n, seq_len), generator=generator
    )
    tokens = torch.where(torch.rand(n, seq_len, generator=generator) < 0.35, topic, noise)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=generator)
    valid = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)
    return {"tokens_BL": tokens * valid, "valid_BL": valid, "targets": labels}


class SyntheticTask(Task):
    name = "synthetic"

    def model_needs(self) -> ModelNeeds:
        seq_len = self.splits["train"]["tokens_BL"].shape[1]
        return ModelNeeds("token-classifier", NUM_CLASSES, max_len=seq_len, vocab_size=VOCAB)


@register(
    "synthetic",
    model_kind="token-classifier",
    reads=("task.test_fraction", "task.max_len", "model.dim", "model.num_heads", "model.ffn_dim", "model.freeze"),
    summary="seeded random token sequences and a small built-in encoder: tests and demos, nothing to download",
)
def build(task_config) -> SyntheticTask:
    total = task_config.num_samples or SAMPLES
    num_test = max(1, int(round(total * task_config.test_fraction)))
    generator = torch.Generator().manual_seed(task_config.seed)
    splits = {
        "train": make_split(total - num_test, task_config.max_len, generator),
        "test": make_split(num_test, task_config.max_len, generator),
    }
    return SyntheticTask(splits, NUM_CLASSES)

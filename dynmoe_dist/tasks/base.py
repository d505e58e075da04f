"""What the trainer needs from a task: indexed batches, a summed loss, and what its model must fit.

Every sample is addressed by its index in a split, so any rank can build any slice of a global batch
and the batch order does not depend on the world size. Losses are *sums* over items; the trainer
divides by the item count of the global batch, which makes the gradient independent of how the batch
was split over ranks.

Tasks do not build models: ``Task.model_needs()`` says what the task knows (its kind of model, class or
vocabulary counts, lengths, the tokenizer it used), and ``models.build.build_model`` builds the model
from the run's [model] and [moe] sections and those needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ModelNeeds:
    """What a task hands the model builder (models/build.py reads it as its TaskNeeds protocol)."""

    kind: str
    """'token-classifier', 'image-classifier', 'minilm-classifier' or 'causal-lm'."""
    num_outputs: int
    """Classes of a classifier; the tokenizer's vocabulary of a causal LM."""
    max_len: int = 0
    """Tokens per sample (positions of a model built from scratch)."""
    vocab_size: int = 0
    """Token ids of the task's own vocabulary (a token classifier built from scratch)."""
    image_size: int = 0
    channels: int = 0
    tokenizer: str = ""
    """The pre-trained tokenizer the task used (a directory or .gguf file), if any."""


@dataclass
class Batch:
    inputs: Dict[str, Tensor]
    """Keyword arguments of the model's forward."""
    targets: Tensor
    """Class labels (B,)."""

    def to(self, device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.targets.to(device))

    def __len__(self) -> int:
        return self.targets.shape[0]


class Task:
    """A classification task held in memory as tensors, split into 'train' and 'test'."""

    name = "task"
    scores_perplexity = False
    """A language model: its test score is the held-out perplexity, exp(test_loss per token)."""

    def __init__(self, splits: Dict[str, Dict[str, Tensor]], num_classes: int):
        self.splits = splits
        self.num_classes = num_classes
        for split, tensors in splits.items():
            if "targets" not in tensors:
                raise ValueError(f"split {split!r} has no 'targets'")

    def size(self, split: str) -> int:
        return self.splits[split]["targets"].shape[0]

    def batch(self, split: str, indices: Tensor) -> Batch:
        tensors = self.splits[split]
        inputs = {k: v.index_select(0, indices) for k, v in tensors.items() if k != "targets"}
        return Batch(inputs, tensors["targets"].index_select(0, indices))

    def count_items(self, split: str, indices: Tensor) -> int:
        """Loss items in these samples (one per sample for classification)."""
        return int(indices.numel())

    def loss_terms(self, logits: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
        """(summed cross-entropy in at least fp32, number of correct predictions as a 0-d tensor).

        Both stay on the device: the trainer reads them back once per step, not once per batch."""
        loss_sum = F.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)), targets, reduction="sum"
        )
        correct = (logits.detach().argmax(-1) == targets).sum()
        return loss_sum, correct

    def model_needs(self) -> ModelNeeds:
        raise NotImplementedError(f"task {self.name!r} must say what its model needs")


# Options whose effect depends on the task. Each task declares the ones it reads; setting any other
# one is a start-up warning (train/startup.py), because it would silently do nothing.
TASK_OPTIONS: FrozenSet[str] = frozenset(
    {
        "task.path",
        "task.test_path",
        "task.test_fraction",
        "task.max_len",
        "model.dim",
        "model.num_heads",
        "model.ffn_dim",
        "model.patch_size",
        "model.freeze",
        # a transformers model and its tokenizer (tasks/causal_lm.py); other tasks build their own model
        "model.source",
        "model.path",
        "task.tokenizer",
        "task.text_field",
        "task.cache_dir",
        "task.prepare_workers",
        "task.chat_template",  # tasks/chat.py
    }
)


@dataclass(frozen=True)
class TaskSpec:
    build: Callable[..., Task]
    """build(task_config) -> Task: loads the data."""
    reads: Optional[FrozenSet[str]] = None
    """The TASK_OPTIONS this task reads; None = not declared (no warnings about unread options)."""
    validate: Optional[Callable[..., None]] = None
    """validate(run_config): raise ValueError for settings the task cannot run, without loading data."""
    model_kind: str = ""
    """The ModelNeeds.kind of the task's model, known before any data is loaded (config-time checks)."""
    summary: str = ""
    """One line for `dynmoe-train --help` (task.name): what the task trains on, with which model."""
    path_forms: str = ""
    """What task.path names for this task, for --help (empty when the task reads no task.path)."""
    packs_sequences: bool = False
    """Whether the task packs several examples into one row, told apart by restarting position ids (the
    config check asks models/ whether model.path's attention keeps them apart)."""


TASKS: Dict[str, Callable[..., Task]] = {}
TASK_SPECS: Dict[str, TaskSpec] = {}


def register(
    name: str,
    model_kind: str,
    reads: Optional[Iterable[str]] = None,
    validate: Optional[Callable[..., None]] = None,
    summary: str = "",
    path_forms: str = "",
    packs_sequences: bool = False,
):
    """Decorator of a task factory; its arguments as the TaskSpec fields of the same names."""
    unknown = set(reads or ()) - TASK_OPTIONS
    assert not unknown, f"task {name!r} declares options outside TASK_OPTIONS: {sorted(unknown)}"

    def wrap(factory):
        TASKS[name] = factory
        frozen = None if reads is None else frozenset(reads)
        TASK_SPECS[name] = TaskSpec(factory, frozen, validate, model_kind, summary, path_forms, packs_sequences)
        return factory

    return wrap


def split_indices(n: int, test_fraction: float, seed: int) -> Tuple[Tensor, Tensor]:
    """A seeded shuffle of 0..n-1 cut into (train, test)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    num_test = max(1, int(round(n * test_fraction)))
    return order[num_test:], order[:num_test]

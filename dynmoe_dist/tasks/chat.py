"""'chat': instruction finetuning of a transformers model on conversations, the loss on the assistant's tokens.

Shape legend: B packed sequences in a batch, L = task.max_len positions, V vocabulary.

Data: task.path is a .jsonl, .parquet or .arrow file (or a directory of them) whose records hold 'messages'
(a list of {role, content}) or 'prompt' and 'completion' (data/chat.py). Each conversation is rendered with
the tokenizer's own chat template (task.tokenizer, default model.path) or task.chat_template's, and
tokenised into the token cache once, the assistant's tokens marked (python -m dynmoe_dist.data prepare
does it ahead of time); a bad record is one line naming its file and line (or row).

Conversations are split into train / held-out as whole conversations (a seeded shuffle), and each split is
packed in that order into sequences of L positions (data/packed.py): position ids restart with every
conversation and attention is block-diagonal, so a conversation's loss and gradient are those it has alone.
A conversation longer than L + 1 tokens is dropped, and the start says how many. Every rank reads only its
own sequences from the memmap.

The loss is summed over the assistant's tokens and ``count_items`` is their number in the batch, so the
gradient is the mean over assistant tokens whatever the split over ranks; held-out perplexity = exp(test_loss),
per assistant token. 'accuracy' is the mean over sequences of the share of assistant tokens predicted right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..data import CorpusSpec, open_corpus
from ..data.cache import say
from ..data.packed import IGNORE, PackedExamples
from ..paths import missing
from .base import Batch, ModelNeeds, Task, register, split_indices
from .common import subset_indices

PATH_FORMS = (
    "a .jsonl / .parquet / .arrow file or a directory of them: per record 'messages' "
    "([{role, content}, ...]) or 'prompt' and 'completion'"
)


class ChatTask(Task):
    """Train and held-out packed sequences read from the token cache; ``splits`` stays empty."""

    name = "chat"
    scores_perplexity = True

    def __init__(self, packed: Dict[str, PackedExamples], vocab_size: int, seq_len: int, tokenizer_path: str):
        super().__init__({}, vocab_size)
        self.packed = packed
        self.seq_len = seq_len
        self.tokenizer_path = tokenizer_path

    def size(self, split: str) -> int:
        return len(self.packed[split])

    def batch(self, split: str, indices: Tensor) -> Batch:
        inputs, targets_BL = self.packed[split].read(indices.numpy())
        return Batch({k: torch.from_numpy(v) for k, v in inputs.items()}, torch.from_numpy(targets_BL))

    def count_items(self, split: str, indices: Tensor) -> int:
        """The assistant tokens of these sequences (from the plan: no token is read)."""
        return int(self.packed[split].targets_S[indices.numpy()].sum())

    def loss_terms(self, logits_BLV: Tensor, targets_BL: Tensor) -> Tuple[Tensor, Tensor]:
        """(summed cross-entropy over the assistant's tokens, per sequence the share of them predicted right)."""
        dtype = torch.promote_types(logits_BLV.dtype, torch.float32)
        loss_sum = F.cross_entropy(
            logits_BLV.reshape(-1, logits_BLV.shape[-1]).to(dtype),
            targets_BL.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        scored_BL = targets_BL != IGNORE
        right_B = ((logits_BLV.detach().argmax(-1) == targets_BL) & scored_BL).sum(-1).to(dtype)
        correct = (right_B / scored_BL.sum(-1).clamp(min=1).to(dtype)).sum()
        return loss_sum, correct

    def model_needs(self) -> ModelNeeds:
        return ModelNeeds("causal-lm", self.num_classes, max_len=self.seq_len, tokenizer=self.tokenizer_path)


def corpus_spec(task_config, path: str, field: str) -> CorpusSpec:
    return CorpusSpec(
        path=path,
        tokenizer=task_config.tokenizer,
        max_len=task_config.max_len,
        cache_dir=task_config.cache_dir,
        num_proc=task_config.prepare_workers,
        field=field,
        format="chat",
        chat_template=task_config.chat_template,
    )


def packed_split(corpus, doc_ids_D: np.ndarray, seq_len: int, where: str) -> PackedExamples:
    """The conversations doc_ids_D packed; one line on what was dropped; ValueError when nothing is left."""
    packed = corpus.packed(doc_ids_D, seq_len)
    if packed.dropped:
        say(
            f"{where}: dropped {len(packed.dropped)} of {len(doc_ids_D)} conversations longer than task.max_len + 1 "
            f"({seq_len + 1}) tokens (the first: {corpus.where(packed.dropped[0])}); raise task.max_len to keep them"
        )
    if len(packed) == 0:
        raise ValueError(f"{where}: no conversation fits task.max_len ({seq_len}) + 1 tokens")
    say(
        f"{where}: {packed.num_examples} conversations packed into {len(packed)} sequences of {seq_len} "
        f"({packed.fill():.0%} of the positions used, {int(packed.targets_S.sum())} assistant tokens)"
    )
    return packed


def split_packed(task_config) -> Tuple[Dict[str, PackedExamples], int]:
    """({'train': ..., 'test': ...}, vocabulary size): a seeded subset (task.num_samples) of the conversations,
    split into whole conversations unless task.test_path names held-out ones."""
    t, seq_len = task_config, task_config.max_len
    corpus = open_corpus(corpus_spec(t, t.path, "task.path"))
    keep_D = subset_indices(corpus.num_docs, t.num_samples, t.seed).numpy()
    if t.test_path:
        held_out = open_corpus(corpus_spec(t, t.test_path, "task.test_path"))
        test_D = subset_indices(held_out.num_docs, t.num_samples, t.seed).numpy()
        train = packed_split(corpus, keep_D, seq_len, "task.path")
        return {"train": train, "test": packed_split(held_out, test_D, seq_len, "task.test_path")}, corpus.vocab_size
    if len(keep_D) < 2:
        raise ValueError(f"task.path ({t.path!r}) has {len(keep_D)} conversation; a held-out split needs >= 2")
    train_idx, test_idx = split_indices(len(keep_D), t.test_fraction, t.seed)
    packed = {
        "train": packed_split(corpus, keep_D[train_idx.numpy()], seq_len, "task.path (train split)"),
        "test": packed_split(corpus, keep_D[test_idx.numpy()], seq_len, "task.path (held-out split)"),
    }
    return packed, corpus.vocab_size


def validate(run_config) -> None:
    """A transformers model is named and the named files exist (their content is read when the task is
    built). An empty task.tokenizer becomes model.path here, as for causal-lm."""
    m, t = run_config.model, run_config.task
    if m.source != "hf":
        raise ValueError(f"task 'chat' needs model.source = 'hf' (got {m.source!r}) and model.path")
    if not t.tokenizer:
        t.tokenizer = m.path
    if not t.path:
        raise ValueError(f"task.path ('') must name {PATH_FORMS} for task 'chat'")
    for option, value in (
        ("model.path", m.path),
        ("task.tokenizer", t.tokenizer),
        ("task.path", t.path),
        ("task.test_path", t.test_path),
        ("task.chat_template", t.chat_template),
    ):
        if value and not value.startswith("package:") and not Path(value).expanduser().exists():
            raise missing(option, value)


@register(
    "chat",
    model_kind="causal-lm",
    summary="instruction finetuning on conversations, the loss on the assistant's tokens (model.source = 'hf')",
    path_forms=PATH_FORMS,
    validate=validate,
    reads=(
        "task.path",
        "task.test_path",
        "task.test_fraction",
        "task.max_len",
        "task.tokenizer",
        "task.chat_template",
        "task.cache_dir",
        "task.prepare_workers",
        "model.source",
        "model.path",
        "model.freeze",
    ),
)
def _chat(task_config) -> ChatTask:
    if not task_config.tokenizer:
        raise ValueError("task.tokenizer ('') must name the model's tokenizer (validate fills it in from model.path)")
    packed, vocab_size = split_packed(task_config)
    return ChatTask(packed, vocab_size, task_config.max_len, task_config.tokenizer)

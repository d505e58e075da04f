"""The in-memory packing that 'causal-lm' used before its windows were read from the token cache: every
document tokenised in this process, joined with EOS, cut into L + 1 windows held as tensors. The tests
hold the memory-mapped task to it (the same windows, hence the same losses)."""

from typing import Dict, List

import torch
from torch import Tensor

from dynmoe_dist.tasks.base import Task, split_indices
from dynmoe_dist.tasks.causal_lm import CausalLMTask
from dynmoe_dist.tasks.common import subset_indices


def pack(docs: List[str], tokenizer, seq_len: int) -> Dict[str, Tensor]:
    """Documents -> {'input_ids': (N, L), 'targets': (N, L)}: one token stream cut into L + 1 windows."""
    eos = tokenizer.eos_token_id
    stream: List[int] = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += ids + ([eos] if eos is not None else [])
    num_seq = len(stream) // (seq_len + 1)
    windows_NL1 = torch.tensor(stream[: num_seq * (seq_len + 1)], dtype=torch.long).view(num_seq, seq_len + 1)
    return {"input_ids": windows_NL1[:, :-1].contiguous(), "targets": windows_NL1[:, 1:].contiguous()}


class InMemoryLMTask(CausalLMTask):
    """CausalLMTask over tensors (the base Task's batch and size)."""

    def __init__(self, splits, vocab_size, seq_len, tokenizer_path):
        Task.__init__(self, splits, vocab_size)
        self.seq_len, self.tokenizer_path = seq_len, tokenizer_path

    size = Task.size
    batch = Task.batch


def in_memory_task(task_config, docs: List[str]) -> InMemoryLMTask:
    """The old build: seeded document subset, shuffled document split, each split packed in memory."""
    from dynmoe_dist.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(task_config.tokenizer)
    docs = [docs[i] for i in subset_indices(len(docs), task_config.num_samples, task_config.seed).tolist()]
    train_idx, test_idx = split_indices(len(docs), task_config.test_fraction, task_config.seed)
    splits = {
        name: pack([docs[i] for i in idx.tolist()], tokenizer, task_config.max_len)
        for name, idx in (("train", train_idx), ("test", test_idx))
    }
    return InMemoryLMTask(splits, len(tokenizer), task_config.max_len, task_config.tokenizer)

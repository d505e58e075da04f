"""Filling an imported MoE built on the meta device (models/hf/imported.py) once the run has placed its experts
and sharded its dense weights (train/parts.py): every rank reads from the checkpoint files only what it
holds: the experts of its slots, and each dense tensor whole when replicated or only its own rows under
FSDP (parallel/fsdp.fill_local).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor

from ..models.hf.imported import ImportedCheckpoint, allocate, dense_tensors
from ..models.hf.loading import resolve
from ..models.hf.wrappers import HFCausalLM
from ..parallel.fsdp import fill_local
from ..parallel.shard import LayerShard


def fill_imported(model: nn.Module, path: str, shards: Sequence[LayerShard], device: torch.device) -> None:
    """Allocate the meta-built model on ``device`` and read this rank's share of the checkpoint at ``path``."""
    assert isinstance(model, HFCausalLM), "only imported transformers MoE models are built on the meta device"
    hf_model = model.transformers_model()
    directory, _ = resolve(path)
    checkpoint = ImportedCheckpoint(Path(directory), hf_model)
    allocate(model, hf_model, device)
    tensors = dict(hf_model.named_parameters()) | dict(hf_model.named_buffers())
    with torch.no_grad():
        for name, _ in dense_tensors(hf_model):
            initial = checkpoint.initial(name)  # a converted router's thresholds: not in the files
            if initial is not None:
                tensors[name].fill_(initial)
            else:
                fill_local(tensors[name], partial(checkpoint.rows, name))
        for shard in shards:
            for expert, module in zip(shard.local_experts, shard.layer.experts.experts):
                read = checkpoint.expert(shard.index, expert)  # an expert is small: read whole, cut here
                for name, p in module.named_parameters():
                    fill_local(p, partial(_rows, read[name]))


def _rows(full: Tensor, start: int, stop: int) -> Tensor:
    return full[start:stop]

"""Filling an imported MoE built on the meta device (models/hf/imported.py) once the run has placed its experts
and sharded its dense weights (train/parts.py): every rank reads from the checkpoint files only what it
holds: the experts of its slots, and each dense tensor whole when replicated or only its own rows under
FSDP (a DTensor sharded on dim 0 over a 1-D mesh: rank r holds rows [r * ceil(N / W), ...), torch.chunk's cut).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from ..models.hf.imported import ImportedCheckpoint, allocate, dense_tensors
from ..models.hf.loading import resolve
from ..models.hf.wrappers import HFCausalLM
from ..parallel.shard import LayerShard


def local_rows(p: DTensor) -> Tuple[int, int]:
    """[start, stop) of the rows of the full tensor that this rank's shard of ``p`` holds."""
    assert p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),), f"unexpected sharding {p.placements}"
    size, index, rows = p.device_mesh.size(), p.device_mesh.get_local_rank(), p.shape[0]
    chunk = math.ceil(rows / size)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def _copy(p: Tensor, full: Tensor) -> None:
    """A full tensor into ``p``, or into this rank's rows of it when ``p`` is an FSDP shard."""
    if isinstance(p, DTensor):
        start, stop = local_rows(p)
        p.to_local().copy_(full[start:stop])
    else:
        p.copy_(full)


def _read_into(p: Tensor, checkpoint: ImportedCheckpoint, name: str) -> None:
    """A dense tensor from the files: only this rank's rows of a sharded one (or its initial value, for a
    tensor the checkpoint does not hold: a converted router's thresholds)."""
    initial = checkpoint.initial(name)
    if initial is not None:
        p.fill_(initial)
    elif isinstance(p, DTensor):
        start, stop = local_rows(p)
        p.to_local().copy_(checkpoint.rows(name, start, stop))
    else:
        p.copy_(checkpoint.tensor(name))


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
            _read_into(tensors[name], checkpoint, name)
        for shard in shards:
            for expert, module in zip(shard.local_experts, shard.layer.experts.experts):
                read = checkpoint.expert(shard.index, expert)
                for name, p in module.named_parameters():
                    _copy(p, read[name])

"""Helpers shared by the real-data tasks: sample subsets, splits, parameter freezing.

Shape legend: N samples in a pool (before splitting).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .base import split_indices


def subset_indices(n: int, num_samples: int, seed: int) -> Tensor:
    """Indices of the samples a run uses: all n (num_samples 0), else a seeded random subset.

    A random subset rather than the first rows: data files are often sorted (by label, by movie), and
    the first rows would be a biased sample. Returned sorted, so the subset keeps the file's order."""
    if num_samples < 0:
        raise ValueError(f"task.num_samples ({num_samples}) must be >= 0")
    if num_samples == 0 or num_samples >= n:
        return torch.arange(n)
    # seed + 1: keeps the subset draw independent of split_indices' permutation under the same seed.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    return order[:num_samples].sort().values


def take(tensors: Dict[str, Tensor], indices_N: Tensor) -> Dict[str, Tensor]:
    return {name: t.index_select(0, indices_N) for name, t in tensors.items()}


def split_pool(tensors: Dict[str, Tensor], test_fraction: float, seed: int) -> Dict[str, Dict[str, Tensor]]:
    """One pool of samples -> {'train': ..., 'test': ...} by ``split_indices``."""
    n = next(iter(tensors.values())).shape[0]
    if n < 2:
        raise ValueError(f"a train/test split needs at least 2 samples, got {n}")
    train_idx, test_idx = split_indices(n, test_fraction, seed)
    return {"train": take(tensors, train_idx), "test": take(tensors, test_idx)}


def check_built_model(run_config) -> None:
    """Shapes of a transformer built from model.* (not loaded): attention heads must split dim evenly."""
    m = run_config.model
    if m.dim % m.num_heads:
        raise ValueError(f"model.dim ({m.dim}) is not divisible by model.num_heads ({m.num_heads})")


def freeze_parameters(model: nn.Module, prefixes: Iterable[str]) -> List[str]:
    """Set requires_grad=False on every parameter named ``prefix`` or ``prefix.<anything>``.

    Matching stops at dots, so 'layers.1' freezes layer 1 and not layer 10. A prefix that matches no
    parameter is a mistake (a typo would otherwise silently train everything): ValueError.
    Returns the names of the frozen parameters."""
    named = dict(model.named_parameters())
    frozen: List[str] = []
    for prefix in prefixes:
        prefix = prefix.rstrip(".")
        hits = [name for name in named if name == prefix or name.startswith(prefix + ".")]
        if not hits:
            tops = sorted({name.split(".")[0] for name in named})
            raise ValueError(f"model.freeze entry ({prefix!r}) matches no parameter; top-level names: {tops}")
        for name in hits:
            named[name].requires_grad_(False)
        frozen += hits
    return sorted(set(frozen))


def class_ids(labels: List, where: str) -> Tuple[List, Dict]:
    """Raw labels (all str or all int) -> (sorted class names, name -> id)."""
    kinds = {type(label) for label in labels}
    if len(kinds) > 1:
        raise ValueError(
            f"labels in {where} mix types {sorted(k.__name__ for k in kinds)}; use all strings or all integers"
        )
    names = sorted(set(labels))
    if len(names) < 2:
        raise ValueError(f"labels in {where} have {len(names)} distinct value(s) ({names}); need >= 2 classes")
    return names, {name: i for i, name in enumerate(names)}

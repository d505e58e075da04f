"""Helpers shared by the real-data tasks: sample subsets, splits, class ids.

Shape legend: N samples in a pool (before splitting).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
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

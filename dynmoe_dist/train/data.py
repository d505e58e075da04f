"""Deterministic global batches, split over ranks.

Every step's global batch is the same set of sample indices in the same order whatever the world
size: epoch e uses the permutation seeded by (seed, e), step s of that epoch takes the s-th block of
``global_batch_size`` indices (the remainder of an epoch is dropped, so every step is full), and
micro-batch m is the m-th contiguous part of that block. Rank r of W takes the r-th contiguous part of
a micro-batch: sizes differ by at most one (uneven splits are allowed; empty ones are not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

import torch
from torch import Tensor


def shard_sizes(total: int, world_size: int) -> List[int]:
    base, extra = divmod(total, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard(indices: Tensor, rank: int, world_size: int) -> Tensor:
    sizes = shard_sizes(indices.numel(), world_size)
    start = sum(sizes[:rank])
    return indices[start : start + sizes[rank]]


def eval_ranges(size: int, chunk: int, world_size: int) -> List[Tuple[int, int]]:
    """[start, end) ranges of the held-out split, evaluated one after the other, each sharded over the
    ranks: `chunk` samples each, except that a last range shorter than the world joins the one before
    it. Every rank then gets at least one sample of every range: a transformers model cannot run on an
    empty batch (its attention reshapes 0 elements), and a rank that skipped a forward would miss the
    expert all-to-alls of the others. The loss is a sum, so the ranges do not change it."""
    if size < world_size:
        raise ValueError(
            f"the held-out split ({size} samples) is smaller than the world size ({world_size}): some ranks "
            "would get no samples (use more data, a larger task.test_fraction or fewer ranks)"
        )
    starts = list(range(0, size, chunk))
    if len(starts) > 1 and size - starts[-1] < world_size:
        starts.pop()
    return [(start, nxt) for start, nxt in zip(starts, starts[1:] + [size])]


@dataclass(frozen=True)
class BatchSchedule:
    num_train: int
    global_batch_size: int
    grad_accum: int
    epochs: float
    max_steps: int
    seed: int

    def __post_init__(self):
        if self.num_train < self.global_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) exceeds the train split ({self.num_train} samples)"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_train // self.global_batch_size

    @property
    def total_steps(self) -> int:
        steps = max(1, math.ceil(self.epochs * self.steps_per_epoch))
        return min(steps, self.max_steps) if self.max_steps > 0 else steps

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.grad_accum

    def check_world(self, world_size: int) -> None:
        """Every rank needs at least one sample per micro-batch (checked before any collective)."""
        if self.micro_batch_size < world_size:
            raise ValueError(
                f"micro-batch size ({self.micro_batch_size} = train.global_batch_size "
                f"{self.global_batch_size} / train.grad_accum {self.grad_accum}) < world size "
                f"({world_size}): some ranks would get no samples"
            )

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def position(self, step: int) -> Dict[str, int]:
        """Where the data stream stands before optimizer step `step` (the order is a pure function of it),
        with what must match for a resumed run to continue the same order."""
        return {
            "step": step,
            "epoch": self.epoch_of(step),
            "batch_in_epoch": step % self.steps_per_epoch,
            "num_train": self.num_train,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
        }

    def check_position(self, saved: Dict[str, int]) -> int:
        """The step to continue from; raises when this schedule would replay a different data order."""
        mine = self.position(int(saved["step"]))
        for key in ("num_train", "global_batch_size", "seed"):
            if int(saved[key]) != mine[key]:
                raise ValueError(
                    f"the checkpoint's data order does not continue here: saved {key} "
                    f"({saved[key]}) != this run's ({mine[key]})"
                )
        return mine["step"]

    def micro_indices(self, step: int, micro: int) -> Tensor:
        """Global sample indices of micro-batch `micro` of optimizer step `step`."""
        order = _epoch_order(self.num_train, self.seed, self.epoch_of(step))
        start = (step % self.steps_per_epoch) * self.global_batch_size + micro * self.micro_batch_size
        return order[start : start + self.micro_batch_size]


@lru_cache(maxsize=4)
def _epoch_order(num_train: int, seed: int, epoch: int) -> Tensor:
    return torch.randperm(num_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))

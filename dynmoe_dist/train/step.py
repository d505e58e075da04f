"""One training step, the only one: micro-batches (forward, loss, backward), gradient sync, clipping,
the optimizer step. The trainer and every benchmark call ``train_step``; nothing else steps an optimizer.
Beside it, its counterpart without gradients: ``evaluate_totals`` over held-out batches.

The loss of a micro-batch is its summed item losses divided by the item count of the *global*
micro-batch and by the number of micro-batches, plus the MoE aux loss divided by the number of
micro-batches: summed over ranks and micro-batches, the gradients are those of the global batch's mean
loss, whatever the world size (train/loop.py's invariance). The step never sees the trainer: it is given
the parts it trains and the micro-batches, built lazily by the caller.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor
from torch.profiler import record_function

from ..parallel.fsdp import reshard_gathered
from ..parallel.groups import sum_over_ranks
from .parts import TrainParts

# (logits, targets) -> (summed item losses, correct predictions): a task's ``loss_terms``.
LossTerms = Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]


@dataclass
class MicroBatch:
    """This rank's share of one global micro-batch, on the model's device."""

    inputs: Dict[str, Tensor]
    """Keyword arguments of the model's forward."""
    targets: Tensor
    items_global: int
    """Loss items (tokens, samples) of the whole global micro-batch, every rank's share included."""

    def __len__(self) -> int:
        return self.targets.shape[0]


class StepTotals:
    """What one rank contributes to a step's metrics, accumulated on the device (no host sync per
    micro-batch) and summed over ranks with one all-reduce."""

    def __init__(self, device: torch.device):
        self.loss_sum, self.correct, self.aux = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
        self.items = 0

    def vector(self) -> torch.Tensor:
        items = self.loss_sum.new_tensor(float(self.items))
        return torch.stack([self.loss_sum, self.correct, items, self.aux]).cpu()  # NOTE: device-to-host sync

    def loss(self) -> float:
        """This rank's share of the step's loss (task + aux); summed over ranks it is the step's loss."""
        return float(self.loss_sum + self.aux)  # NOTE: device-to-host sync


def forward_backward(
    model: torch.nn.Module,
    batch: MicroBatch,
    loss_terms: LossTerms,
    accum: int,
    totals: StepTotals,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> None:
    """One micro-batch: forward, its share of the global loss, backward (gradients accumulate)."""
    with record_function("phase: forward"):
        with autocast():
            out = model(**batch.inputs)
        loss_sum, correct = loss_terms(out.logits, batch.targets)
        loss = loss_sum / batch.items_global / accum + out.aux_loss / accum
    with record_function("phase: backward"):
        loss.backward()
    totals.loss_sum += loss_sum.detach().double() / batch.items_global / accum
    totals.correct += correct
    totals.items += len(batch)
    totals.aux += out.aux_loss.detach().double() / accum


def apply_gradients(parts: TrainParts, clip: float = 0.0) -> Optional[float]:
    """Sum the gradients over ranks, clip them (``clip`` > 0: the global norm, returned), step the
    optimizer and free the gradients, so nothing after the step (evaluation, a checkpoint) holds them."""
    shards = parts.experts.shards
    with record_function("phase: grad_sync"):
        parts.grad_sync.sync(shards)
        grad_norm = parts.grad_sync.clip(shards, clip) if clip > 0 else None
    with record_function("phase: optimizer"):
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(
    parts: TrainParts,
    micro_batches: Iterable[MicroBatch],
    loss_terms: LossTerms,
    accum: int,
    totals: StepTotals,
    clip: float = 0.0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Optional[float]:
    """One optimizer step over ``accum`` micro-batches (an iterable, so the caller may build each one
    only when it is needed); the metrics accumulate in ``totals``. Returns the gradient norm when
    clipping (``clip`` > 0), else None. The learning rate is the caller's (set before the step)."""
    parts.model.train()
    count = 0
    for batch in micro_batches:
        forward_backward(parts.model, batch, loss_terms, accum, totals, autocast)
        count += 1
    if count != accum:
        raise ValueError(f"train_step: {count} micro-batches given, accum is {accum}")
    return apply_gradients(parts, clip)


@torch.no_grad()
def evaluate_totals(
    parts: TrainParts,
    batches: Iterable[Any],
    loss_terms: LossTerms,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Tensor:
    """(summed item losses, correct predictions) of held-out batches (each with ``inputs`` and ``targets``:
    this rank's share), summed over ranks, on the host. No gradients and no copy of the weights: the dense
    weights FSDP gathered for the last forward are released afterwards (the root keeps them gathered after a
    forward, as training's backward follows at once; after evaluation nothing does)."""
    parts.model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=parts.groups.device)
    for batch in batches:
        with autocast():
            out = parts.model(**batch.inputs)
        totals += torch.stack(loss_terms(out.logits, batch.targets)).double()
    reshard_gathered(parts.model)
    parts.model.train()
    return sum_over_ranks(totals.cpu(), parts.groups, "eval all_reduce")  # NOTE: device-to-host sync (once)

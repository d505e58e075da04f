"""Auxiliary losses of MoE layers that sit inside a model whose blocks must return a plain tensor.

A transformers block calls its MLP as ``hidden = mlp(hidden)``: an MoE layer put there cannot return its
auxiliary loss through that call. Instead of leaving the loss on the module for someone to collect later
(state that outlives the forward, and doubles under activation checkpointing's replay), the caller that
wants the losses opens a collection around its forward and returns their sum in its own output:

    with collect_aux_losses() as aux:
        logits = hf_model(input_ids).logits
    return ModelOutput(logits, aux.total(logits))

An MoE block reports into the innermost open collection, and into nothing when none is open (generate(),
evaluation outside the trainer, the backward pass's recomputation under activation checkpointing).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, List, Optional

import torch
from torch import Tensor


class AuxLosses:
    """The auxiliary losses reported during one forward."""

    def __init__(self) -> None:
        self.losses: List[Tensor] = []

    def total(self, like: Tensor) -> Tensor:
        """Their sum as a 0-d float32 tensor on ``like``'s device (zero when none was reported)."""
        total = like.new_zeros((), dtype=torch.float32)
        for loss in self.losses:
            total = total + loss
        return total


_open: ContextVar[Optional[AuxLosses]] = ContextVar("dynmoe_aux_losses", default=None)


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[AuxLosses]:
    """Collect the auxiliary losses MoE blocks report until the block ends (nested collections are separate)."""
    collected = AuxLosses()
    token = _open.set(collected)
    try:
        yield collected
    finally:
        _open.reset(token)


def report_aux_loss(loss: Tensor) -> None:
    """Hand an MoE layer's (weighted) auxiliary loss to the open collection, if any."""
    collected = _open.get()
    if collected is not None:
        collected.losses.append(loss)

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

The blocks of an imported transformers MoE family also report their statistics for the family's JOINT
load-balance loss (one Switch loss over all layers' router logits, moe/losses.py); the collection forms it
once, at ``total``, from all layers of the forward, with padding dropped by the attention mask it is given.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, List, Optional

import torch
from torch import Tensor

from .losses import BalanceTerm, joint_balance_loss


class AuxLosses:
    """The auxiliary losses reported during one forward."""

    def __init__(self) -> None:
        self.losses: List[Tensor] = []
        self.balance: List[BalanceTerm] = []

    def total(self, like: Tensor, token_weight: Optional[Tensor] = None) -> Tensor:
        """Their sum as a 0-d float32 tensor on ``like``'s device (zero when none was reported), plus the joint
        load-balance loss of the reported balance terms; ``token_weight`` (the attention mask, one weight per
        token of the forward) drops padding from it as transformers does."""
        total = like.new_zeros((), dtype=torch.float32)
        for loss in self.losses:
            total = total + loss
        if self.balance:
            total = total + joint_balance_loss(self.balance, token_weight)
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


def report_balance_term(term: BalanceTerm) -> None:
    """Hand an MoE layer's statistics for the joint load-balance loss to the open collection, if any."""
    collected = _open.get()
    if collected is not None:
        collected.balance.append(term)

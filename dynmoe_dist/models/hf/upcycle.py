"""upcycle_hf: swap chosen dense MLPs of a transformers model for DynMoE layers (experts = copies).

Shape legend: B batch, L sequence length, D model dim.

The HF block around the MLP does not change: an ``MoEBlock`` takes the tensor the MLP took and returns a
tensor of the same shape, so attention, norms, residuals and the HF output classes (``generate()``
included) keep working. HF's forward cannot carry the block's auxiliary loss, so the block reports it to
the collection its caller opened (``moe/aux_collector.py``); the training wrappers in
``models/hf/wrappers.py`` open one around each forward and return the sum in the project's ``ModelOutput``.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch.nn as nn
from torch import Tensor

from ...moe.aux_collector import report_aux_loss, report_balance_term
from ...moe.config import MoEConfig
from ...moe.layer import MoELayer, MoEOutput
from ...moe.upcycle import upcycled_layer
from .adapters import find_mlps


class MoEBlock(nn.Module):
    """An MoE layer in the place of an HF MLP: x_BLD -> y_BLD; the aux loss goes to the open collection.

    Imported MoE families (models/hf/families/) subclass it to add their shared experts or to return
    what their own block returned; ``run`` is the part they share."""

    def __init__(self, moe: MoELayer, dropout: Optional[nn.Module] = None):
        super().__init__()
        self.moe = moe
        self.dropout = dropout if dropout is not None else nn.Identity()

    def run(self, x_BLD: Tensor) -> MoEOutput:
        """The MoE layer's output (dropout applied), its aux loss and joint-balance statistics reported."""
        out = self.moe(x_BLD)
        report_aux_loss(out.aux_loss)
        if out.balance is not None:
            report_balance_term(out.balance)
        out.output = self.dropout(out.output)
        return out

    def forward(self, x_BLD: Tensor) -> Tensor:
        return self.run(x_BLD).output


def moe_blocks(model: nn.Module) -> List[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def upcycle_hf(
    model: nn.Module, moe_config: Optional[MoEConfig] = None, *, layers: Optional[Iterable[int]] = None
) -> nn.Module:
    """Replace the dense MLPs of the given block indices (all when None) by MoE blocks; in place.

    At initialisation every expert equals the dense MLP, so wherever a token's combine weights sum to 1
    (top_any: 1/k each for k >= 1; eval mode with eval_k0='top1' gives every token k >= 1) the model
    computes exactly the dense function."""
    sites = find_mlps(model)
    chosen = list(range(len(sites))) if layers is None else sorted(set(layers))
    for index in chosen:
        if not 0 <= index < len(sites):
            raise ValueError(
                f"MoE layer index ({index}) out of range: {type(model).__name__} has "
                f"{len(sites)} MLP blocks (0..{len(sites) - 1})"
            )
    config = moe_config if moe_config is not None else MoEConfig()
    for index in chosen:
        site = sites[index]
        block = MoEBlock(upcycled_layer(site.convert(), config), site.dropout)
        site.install(block.train(model.training))
    return model


def num_mlp_blocks(model: nn.Module) -> int:
    return len(find_mlps(model))

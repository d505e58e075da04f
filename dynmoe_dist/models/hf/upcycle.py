"""upcycle_hf: swap chosen dense MLPs of a transformers model for DynMoE layers (experts = copies).

Shape legend: B batch, L sequence length, D model dim.

The HF block around the MLP does not change: an ``MoEBlock`` takes the tensor the MLP took and returns a
tensor of the same shape, so attention, norms, residuals and the HF output classes (``generate()``
included) keep working. The block cannot return its auxiliary loss through HF's forward, so it keeps
the last one on itself; ``take_aux_loss(model)`` sums and clears them after a forward (the training
wrappers in ``models/hf/wrappers.py`` do that and return the project's ``ModelOutput``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Iterable, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...moe.config import MoEConfig
from ...moe.experts import EXPERT_CLASSES, Expert, ExpertBank
from ...moe.layer import MoELayer
from .adapters import MLPSite, find_mlps


class MoEBlock(nn.Module):
    """An MoE layer in the place of an HF MLP: x_BLD -> y_BLD, the aux loss kept in ``self.aux_loss``."""

    def __init__(self, moe: MoELayer, dropout: Optional[nn.Module] = None):
        super().__init__()
        self.moe = moe
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.aux_loss: Optional[Tensor] = None

    def forward(self, x_BLD: Tensor) -> Tensor:
        out = self.moe(x_BLD)
        # Summed if the block runs more than once before the loss is taken (e.g. re-entrant checkpointing
        # would double it; neither the trainer nor generate() does that).
        self.aux_loss = out.aux_loss if self.aux_loss is None else self.aux_loss + out.aux_loss
        return self.dropout(out.output)


def moe_blocks(model: nn.Module) -> List[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def take_aux_loss(model: nn.Module, like: Tensor) -> Tensor:
    """Sum of the aux losses the MoE blocks kept since the last call (then cleared); 0-d fp32."""
    total = like.new_zeros((), dtype=torch.float32)
    for block in moe_blocks(model):
        if block.aux_loss is not None:
            total = total + block.aux_loss
            block.aux_loss = None
    return total


def expert_kind_of(dense: Expert) -> str:
    return next(kind for kind, cls in EXPERT_CLASSES.items() if isinstance(dense, cls))


def moe_layer_for(site: MLPSite, config: MoEConfig) -> MoELayer:
    """An MoE layer whose experts are all copies of the site's dense MLP (the shape fields from it)."""
    dense = site.convert()
    layer_config = replace(
        config,
        dim=dense.w_in.shape[1],
        ffn_dim=dense.w_in.shape[0],
        expert_kind=expert_kind_of(dense),
        activation=dense.activation,
        expert_bias=dense.b_in is not None,
    )
    experts = ExpertBank(layer_config, [copy.deepcopy(dense) for _ in range(layer_config.num_experts)])
    layer = MoELayer(layer_config, experts)
    # The router matches the MLP's device and dtype (a float64 model gets a float64 router).
    return layer.to(device=dense.w_in.device, dtype=dense.w_in.dtype)


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
        block = MoEBlock(moe_layer_for(site, config), site.dropout)
        site.install(block.train(model.training))
    return model


def num_mlp_blocks(model: nn.Module) -> int:
    return len(find_mlps(model))

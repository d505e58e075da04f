"""Upcycling: dense feed-forward blocks -> MoE layers whose experts start as copies of the block.

This is the DynMoE paper's initialisation ("sparse upcycling"). Every ``FeedForward`` module of the
model (outside an existing MoE layer) is a candidate; ``layers`` picks which ones by their order of
appearance, so ``layers=[4, 5]`` upcycles the FFNs of the last two blocks of a six-block encoder.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Iterable, List, Optional, Tuple

import torch.nn as nn

from .config import MoEConfig
from .experts import EXPERT_CLASSES, Expert, ExpertBank, FeedForward, GatedFeedForward, with_config_adapters
from .layer import MoELayer


def dense_blocks(model: nn.Module) -> List[Tuple[str, Expert]]:
    """(qualified name, module) of every dense FeedForward / GatedFeedForward that is not already an expert."""
    found: List[Tuple[str, Expert]] = []
    for name, module in model.named_modules():
        if isinstance(module, (FeedForward, GatedFeedForward)) and ".experts.experts." not in f".{name}":
            found.append((name, module))
    return found


def upcycle(
    model: nn.Module, config: Optional[MoEConfig] = None, *, layers: Optional[Iterable[int]] = None, **overrides: Any
) -> nn.Module:
    """Replace the chosen dense FFNs of ``model`` in place by MoE layers; returns the model.

    ``config`` (or keyword ``overrides`` of MoEConfig fields) sets the routing; ``dim``, ``ffn_dim``,
    ``activation``, ``expert_kind`` and ``expert_bias`` are always taken from the dense block being copied.
    """
    blocks = dense_blocks(model)
    chosen = list(range(len(blocks))) if layers is None else list(layers)
    for index in chosen:
        if not 0 <= index < len(blocks):
            raise ValueError(f"layers entry ({index}) out of range: the model has {len(blocks)} dense FFN blocks")
    base = (
        config
        if config is not None
        else MoEConfig(**{k: v for k, v in overrides.items() if k not in ("dim", "ffn_dim")})
    )
    if config is not None and overrides:
        base = replace(base, **overrides)
    for index in chosen:
        name, dense = blocks[index]
        _set_submodule(model, name, upcycled_layer(dense, base))
    return model


def upcycled_layer(dense: Expert, config: MoEConfig) -> MoELayer:
    """An MoE layer whose experts are all copies of ``dense``; dim, ffn_dim, activation, expert kind and
    bias come from the dense block, everything else from ``config``."""
    kind = next(k for k, cls in EXPERT_CLASSES.items() if isinstance(dense, cls))
    layer_config = replace(
        config,
        dim=dense.w_in.shape[1],
        ffn_dim=dense.w_in.shape[0],
        expert_kind=kind,
        activation=dense.activation,
        expert_bias=dense.b_in is not None,
    )
    copies = [with_config_adapters(copy.deepcopy(dense), layer_config) for _ in range(layer_config.num_experts)]
    experts = ExpertBank(layer_config, copies)
    # The router matches the dense block's device and dtype (a float64 model gets a float64 router). A
    # fresh module starts in training mode; upcycling a model in eval mode must not leave this one layer
    # training (k = 0 tokens would get output 0 instead of the top-1 fallback).
    layer = MoELayer(layer_config, experts).to(device=dense.w_in.device, dtype=dense.w_in.dtype)
    return layer.train(dense.training)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)

"""Transformer blocks of a model (the unit of FSDP sharding and of activation checkpointing), and
activation checkpointing itself.

A block list is found by structure, not by path: the first ``nn.ModuleList`` outside any MoE layer
whose entries are all of one class (``stack.blocks`` in the project's models; ``model.layers``,
``encoder.layer``, ``transformer.h`` or ``vit.layers`` in Hugging Face ones).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, List, Tuple

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..moe.layer import MoELayer, recomputing


def find_blocks(model: nn.Module) -> List[nn.Module]:
    inside_moe = {id(m) for layer in model.modules() if isinstance(layer, MoELayer) for m in layer.modules()}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside_moe and len(module) > 0:
            if len({type(block) for block in module}) == 1:
                return list(module)
    return []


def _contexts() -> Tuple[Any, Any]:
    """(context of the first forward, context of its replay in the backward pass)."""
    return contextlib.nullcontext(), recomputing()


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> List[nn.Module]:
    """Recompute every block's activations in the backward pass instead of keeping them. Parameter names
    do not change (the block's forward is wrapped in place), so checkpoints move between runs with and
    without it. Returns the blocks."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"train.activation_checkpointing ('block') needs a model with transformer blocks; "
            f"{type(model).__name__} has none"
        )
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return blocks


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` wrapped ``block``'s forward."""
    forward = block.forward
    return isinstance(forward, functools.partial) and forward.func is _checkpointed

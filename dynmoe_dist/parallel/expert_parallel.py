"""parallelize(model, groups): shard every MoE layer's experts over the ep group.

Every rank builds the *full* model from the same seed first, then keeps only its own experts. That
makes a sharded model's weights identical, expert for expert, to the single-process model built from
the same seed, which is what the world-size-invariance guarantees and the tests rely on.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch.nn as nn

from ..moe.layer import LocalDispatcher, MoELayer, find_moe_layers
from ..planning.placement import Placement
from .dispatch import AllReduceReducer, AllToAllDispatcher
from .groups import ParallelGroups


def parallelize(model: nn.Module, groups: ParallelGroups,
                placements: Optional[Sequence[Placement]] = None) -> List[Placement]:
    """Shard the experts of every MoE layer (in place); returns the placement of each layer."""
    layers = find_moe_layers(model)
    if placements is not None and len(placements) != len(layers):
        raise ValueError(f"placements ({len(placements)}) != MoE layers ({len(layers)})")
    result = []
    for index, (name, layer) in enumerate(layers):
        placement = placements[index] if placements else Placement.balanced(layer.num_experts, groups.ep_size)
        shard_layer(layer, placement, groups, name or f"moe{index}")
        result.append(placement)
    return result


def shard_layer(layer: MoELayer, placement: Placement, groups: ParallelGroups, name: str) -> None:
    if placement.num_experts != layer.num_experts:
        raise ValueError(f"placement for {name} has {placement.num_experts} experts, the layer {layer.num_experts}")
    layer.experts.keep(placement.experts_on(groups.ep_rank))
    install_placement(layer, placement, groups, name)
    if groups.distributed:
        layer.reducer = AllReduceReducer(groups)


def install_placement(layer: MoELayer, placement: Placement, groups: ParallelGroups, name: str = "moe") -> None:
    """Point the layer's dispatcher at a placement (the experts must already match it)."""
    layer.placement = placement
    if groups.ep_size == 1:
        layer.dispatcher = LocalDispatcher()
    elif isinstance(layer.dispatcher, AllToAllDispatcher):
        layer.dispatcher.set_placement(placement)
    else:
        layer.dispatcher = AllToAllDispatcher(groups, placement, name)


def local_expert_ids(layer: MoELayer, groups: ParallelGroups) -> List[int]:
    """Logical ids of the experts this rank holds for `layer`, in slot order."""
    if layer.placement is None:
        return list(range(layer.num_experts))
    return layer.placement.experts_on(groups.ep_rank)

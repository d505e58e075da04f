"""parallelize(model, groups): shard every MoE layer's experts over the ep group.

Every rank builds the *full* model from the same seed first, then keeps only its own experts. That
makes a sharded model's weights identical, expert for expert, to the single-process model built from
the same seed, which is what the world-size-invariance guarantees and the tests rely on.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch.nn as nn

from ..moe.layer import LocalDispatcher, find_moe_layers
from ..planning.placement import Placement
from .dispatch import AllReduceReducer, AllToAllDispatcher
from .groups import ParallelGroups
from .shard import LayerShard


def parallelize(
    model: nn.Module, groups: ParallelGroups, placements: Optional[Sequence[Placement]] = None
) -> List[LayerShard]:
    """Shard the experts of every MoE layer (in place); returns each layer's shard record."""
    layers = find_moe_layers(model)
    if placements is not None and len(placements) != len(layers):
        raise ValueError(f"placements ({len(placements)}) != MoE layers ({len(layers)})")
    shards = []
    for index, (name, layer) in enumerate(layers):
        placement = placements[index] if placements else Placement.balanced(layer.num_experts, groups.ep_size)
        if placement.num_experts != layer.num_experts:
            raise ValueError(
                f"placement for {name or index} has {placement.num_experts} experts, the layer {layer.num_experts}"
            )
        shard = LayerShard.build(index, name, layer, placement, groups.ep_rank, groups.device)
        layer.experts.keep(shard.local_experts)
        install_shard(shard, groups)
        if groups.distributed:
            layer.reducer = AllReduceReducer(groups)
        shards.append(shard)
    return shards


def install_shard(shard: LayerShard, groups: ParallelGroups) -> None:
    """Point the layer's dispatcher at the shard's slot tables (the experts must already match it)."""
    layer = shard.layer
    if groups.ep_size == 1:
        layer.dispatcher = LocalDispatcher()
    elif isinstance(layer.dispatcher, AllToAllDispatcher):
        layer.dispatcher.set_tables(shard.tables)
    else:
        layer.dispatcher = AllToAllDispatcher(groups, shard.tables, shard.label)

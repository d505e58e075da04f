"""Experts by logical id: what a rank saves, which saved files it needs, and resharding on resume.

A checkpoint stores every logical expert once, written by its owner (``Placement.owner``) into the
file of that ep rank. A resuming rank first decides the placement it will run with (the saved one when
the ep size is unchanged, so rebalanced layouts and replicas survive; the default one otherwise), then
reads only the files whose owners hold experts it needs, and rebuilds its banks from those tensors.
Routers are resized to the placements' expert counts here (zero rows); their values, like every dense
parameter's, come from the dense DCP load that follows (train/dense_state.py), which writes into the
parameters in place.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import torch.nn as nn
from torch import Tensor

from ..moe.experts import expert_key
from ..moe.layer import rebuild_experts
from ..planning.placement import Placement
from .expert_parallel import install_shard
from .groups import ParallelGroups
from .shard import LayerShard

ExpertTensors = Dict[str, Dict[str, Tensor]]
"""'layer/expert' -> {parameter name: tensor}."""


def dense_named_parameters(model: nn.Module, shards: Sequence[LayerShard]) -> List[Tuple[str, nn.Parameter]]:
    """Every parameter that is not an expert's (routers included), by its name in the model."""
    expert_ids = {id(p) for shard in shards for p in shard.layer.experts.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in expert_ids]


def owned_expert_parameters(shards: Sequence[LayerShard]) -> Dict[str, Dict[str, nn.Parameter]]:
    """'layer/expert' -> {name: parameter} for the experts this rank owns (each written exactly once)."""
    return {
        expert_key(shard.index, expert): dict(module.named_parameters())
        for shard in shards
        for expert, module in shard.owned_modules()
    }


def local_expert_parameters(shards: Sequence[LayerShard]) -> Dict[str, Dict[str, nn.Parameter]]:
    """'layer/expert' -> {name: parameter} for every expert this rank holds (replicas included)."""
    return {
        expert_key(shard.index, expert): dict(module.named_parameters())
        for shard in shards
        for expert, module in shard.local_modules()
    }


def resume_placement(saved: Placement, ep_size: int) -> Placement:
    """The saved layout when it fits this ep size; else the default one for the saved expert count."""
    return saved if saved.ep_size == ep_size else Placement.default(saved.num_experts, ep_size)


def owner_files_needed(saved: Sequence[Placement], placements: Sequence[Placement], ep_rank: int) -> List[int]:
    """The saved ep ranks whose expert files hold an expert this rank will hold."""
    return sorted({old.owner(expert) for old, new in zip(saved, placements) for expert in new.experts_on(ep_rank)})


def reshard(
    shards: Sequence[LayerShard],
    placements: Sequence[Placement],
    experts: Mapping[str, Mapping[str, Tensor]],
    groups: ParallelGroups,
) -> List[LayerShard]:
    """Rebuild every MoE layer for `placements`: the router at the placement's expert count (zeros until
    the dense load fills it), the bank from the logical tensors of the experts this rank holds. Returns
    the layers' new shard records; the optimizer's param groups must be refreshed afterwards."""
    if len(placements) != len(shards):
        raise ValueError(f"saved placements for {len(placements)} MoE layers, the model has {len(shards)}")
    out = []
    for shard, placement in zip(shards, placements):
        held = [experts[expert_key(shard.index, expert)] for expert in placement.experts_on(groups.ep_rank)]
        rebuild_experts(shard.layer, placement.num_experts, held)
        new = shard.moved_to(placement)
        install_shard(new, groups)
        out.append(new)
    return out

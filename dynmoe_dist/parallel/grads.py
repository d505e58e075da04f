"""Gradient synchronisation for dense parameters, expert shards and replica groups, and clipping.

The trainer normalises every loss by the item count of the *global* batch, so the right reduction
is a plain SUM:
  - dense parameters (routers included) are replicated on every rank: sum over the world;
  - a non-replicated expert exists once per ep group: sum over its expert-dp group;
  - a replicated expert exists on several ranks of every ep group: sum over all holders, done as one
    world all-reduce of a buffer laid out identically on every rank (zeros where a rank holds none).
Parameters without a gradient get zeros first, also in a single process: an expert that received no
rows must see the same optimizer update (weight decay, moment decay) whatever the world size.
Which expert is where comes from the layers' ``LayerShard`` records, passed in on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..moe.experts import expert_param_shapes
from .groups import ParallelGroups, named, sum_over_ranks
from .shard import LayerShard


def expert_param_ids(shards: Sequence[LayerShard]) -> set:
    return {id(p) for shard in shards for p in shard.layer.experts.parameters()}


def trainable(params) -> List[Tensor]:
    return [p for p in params if p.requires_grad]


def fill_missing_grads(params: List[Tensor]) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def all_reduce_flat(tensors: List[Tensor], group, groups: ParallelGroups, what: str) -> None:
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    with named(what, groups):
        dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


@dataclass
class ParamSplit:
    dense: List[Tensor]
    sharded: List[Tensor]
    """Parameters of experts with a single holder per ep group."""
    replicated: List[Tuple[LayerShard, int, List[Tensor]]]
    """(shard, logical expert, params) of the replicated experts this rank holds."""

    def all_params(self) -> List[Tensor]:
        return self.dense + self.sharded + [p for _, _, ps in self.replicated for p in ps]


def split_params(model: nn.Module, shards: Sequence[LayerShard]) -> ParamSplit:
    expert_ids = expert_param_ids(shards)
    dense = trainable(p for p in model.parameters() if id(p) not in expert_ids)
    sharded: List[Tensor] = []
    replicated = []
    for shard in shards:
        for expert, module in shard.local_modules():
            params = trainable(module.parameters())
            if shard.is_replicated(expert):
                replicated.append((shard, expert, params))
            else:
                sharded += params
    return ParamSplit(dense, sharded, replicated)


class GradSync:
    def __init__(self, model: nn.Module, groups: ParallelGroups):
        self.model = model
        self.groups = groups

    def sync(self, shards: Sequence[LayerShard]) -> None:
        split = split_params(self.model, shards)
        fill_missing_grads(split.all_params())
        if not self.groups.distributed:
            return
        all_reduce_flat([p.grad for p in split.dense], None, self.groups, "dense gradient all_reduce")
        if self.groups.dp_size > 1:
            all_reduce_flat([p.grad for p in split.sharded], self.groups.expert_dp_group, self.groups,
                            "expert gradient all_reduce (expert-dp group)")
        self._sync_replicas(shards, split.replicated)

    def _sync_replicas(self, shards: Sequence[LayerShard], held: List[Tuple[LayerShard, int, List[Tensor]]]) -> None:
        """One world all-reduce over a buffer with a slot for every replicated expert of every layer."""
        held_grads = {(shard.index, expert): [p.grad for p in params] for shard, expert, params in held}
        buffers: List[Tensor] = []
        mine: Dict[int, List[Tensor]] = {}
        for shard in shards:
            for expert in shard.placement.replicated_experts():
                grads = held_grads.get((shard.index, expert))
                if grads is None:
                    like = shard.layer.router.weight
                    grads = [like.new_zeros(s) for s in expert_param_shapes(shard.layer.config)]
                else:
                    mine[len(buffers)] = grads
                buffers.append(_flatten_dense_tensors(grads))
        if not buffers:
            return
        flat = torch.cat(buffers)
        with named("replicated-expert gradient all_reduce", self.groups):
            dist.all_reduce(flat)
        for index, grads in mine.items():
            offset = sum(b.numel() for b in buffers[:index])
            synced = flat[offset: offset + buffers[index].numel()]
            for g, s in zip(grads, _unflatten_dense_tensors(synced, grads)):
                g.copy_(s)

    def grad_norm(self, shards: Sequence[LayerShard]) -> Tensor:
        """Global L2 norm (a 0-d float64 tensor on the device) with every logical parameter counted
        once: dense once, each expert once. One fused norm pass per group, no host read."""
        split = split_params(self.model, shards)
        dense_sq = _sum_of_squares([p.grad for p in split.dense if p.grad is not None], self.groups.device)
        expert_sq = _sum_of_squares([p.grad for p in split.sharded if p.grad is not None], self.groups.device)
        for shard, expert, params in split.replicated:
            share = 1.0 / shard.placement.num_replicas(expert)
            expert_sq = expert_sq + share * _sum_of_squares([p.grad for p in params], self.groups.device)
        if self.groups.distributed and self.groups.ep_size > 1:
            expert_sq = sum_over_ranks(expert_sq.reshape(1), self.groups, "gradient norm all_reduce (ep group)",
                                       self.groups.ep_group).reshape(())
        return (dense_sq + expert_sq).sqrt()

    def clip(self, shards: Sequence[LayerShard], max_norm: float) -> float:
        """Scale all gradients so the global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm(shards)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0 and grads:
            scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        return float(norm)  # NOTE: device-to-host sync, once per step (the logged norm)


def _sum_of_squares(tensors: List[Tensor], device: torch.device) -> Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors)).double().pow(2).sum()

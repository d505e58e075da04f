"""Gradient synchronisation for dense parameters, expert shards and replica groups, and clipping.

The trainer normalises every loss by the item count of the *global* batch, so the right reduction
is a plain SUM:
  - dense parameters (routers included) are replicated on every rank: sum over the world;
  - a non-replicated expert exists once per ep group: sum over its expert-dp group;
  - a replicated expert exists on several ranks of every ep group: sum over all holders, done as one
    world all-reduce of a buffer laid out identically on every rank (zeros where a rank holds none).
Parameters without a gradient get zeros first, also in a single process: an expert that received no
rows must see the same optimizer update (weight decay, moment decay) whatever the world size.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..moe.experts import expert_param_shapes
from ..moe.layer import MoELayer, find_moe_layers
from .expert_parallel import local_expert_ids
from .groups import ParallelGroups, named, sum_over_ranks


def expert_param_ids(model: nn.Module) -> set:
    return {id(p) for _, layer in find_moe_layers(model) for p in layer.experts.parameters()}


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


class GradSync:
    def __init__(self, model: nn.Module, groups: ParallelGroups):
        self.model = model
        self.groups = groups

    def _split(self) -> Tuple[List[Tensor], List[Tensor], List[Tuple[MoELayer, int, List[Tensor]]]]:
        """(dense params, non-replicated expert params, [(layer, expert id, params)] of replicas)."""
        expert_ids = expert_param_ids(self.model)
        dense = trainable(p for p in self.model.parameters() if id(p) not in expert_ids)
        sharded, replicated = [], []
        for _, layer in find_moe_layers(self.model):
            for expert, module in zip(local_expert_ids(layer, self.groups), layer.experts.experts):
                params = trainable(module.parameters())
                if layer.placement is not None and layer.placement.num_replicas(expert) > 1:
                    replicated.append((layer, expert, params))
                else:
                    sharded += params
        return dense, sharded, replicated

    def sync(self) -> None:
        dense, sharded, replicated = self._split()
        fill_missing_grads(dense + sharded + [p for _, _, ps in replicated for p in ps])
        if not self.groups.distributed:
            return
        all_reduce_flat([p.grad for p in dense], None, self.groups, "dense gradient all_reduce")
        if self.groups.dp_size > 1:
            all_reduce_flat([p.grad for p in sharded], self.groups.dp_group, self.groups,
                            "expert gradient all_reduce (expert-dp group)")
        self._sync_replicas(replicated)

    def _sync_replicas(self, held: List[Tuple[MoELayer, int, List[Tensor]]]) -> None:
        """One world all-reduce over a buffer with a slot for every replicated expert of every layer."""
        held_grads = {(id(layer), expert): [p.grad for p in params] for layer, expert, params in held}
        buffers: List[Tensor] = []
        mine: Dict[int, List[Tensor]] = {}
        for _, layer in find_moe_layers(self.model):
            if layer.placement is None:
                continue
            for expert in layer.placement.replicated_experts():
                grads = held_grads.get((id(layer), expert))
                if grads is None:
                    grads = [layer.router.weight.new_zeros(s) for s in expert_param_shapes(layer.config)]
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

    def grad_norm(self) -> float:
        """Global L2 norm with every logical parameter counted once (dense once, each expert once)."""
        dense, sharded, replicated = self._split()
        dense_sq = sum(float(p.grad.double().pow(2).sum()) for p in dense if p.grad is not None)
        expert_sq = sum(float(p.grad.double().pow(2).sum()) for p in sharded if p.grad is not None)
        for layer, expert, params in replicated:
            share = 1.0 / layer.placement.num_replicas(expert)
            expert_sq += share * sum(float(p.grad.double().pow(2).sum()) for p in params)
        if self.groups.distributed and self.groups.ep_size > 1:
            total = torch.tensor([expert_sq], dtype=torch.float64)
            expert_sq = float(sum_over_ranks(total, self.groups, "gradient norm all_reduce (ep group)",
                                             self.groups.ep_group))
        return math.sqrt(dense_sq + expert_sq)

    def clip(self, max_norm: float) -> float:
        """Scale all gradients so the global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

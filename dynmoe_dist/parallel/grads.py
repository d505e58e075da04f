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
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..moe.experts import expert_gradient_slots, expert_param_shapes
from .fsdp import is_sharded, local
from .groups import ParallelGroups, named, sum_over_ranks
from .shard import LayerShard


def expert_param_ids(shards: Sequence[LayerShard]) -> Set[int]:
    return {id(p) for shard in shards for p in shard.layer.experts.parameters()}


def trainable(params: Iterable[Tensor]) -> List[Tensor]:
    return [p for p in params if p.requires_grad]


def fill_missing_grads(params: List[Tensor]) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One contiguous buffer (one collective instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    return [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in like]), like)]


def all_reduce_flat(tensors: List[Tensor], group: Any, groups: ParallelGroups, what: str) -> None:
    if not tensors:
        return
    flat = flatten(tensors)
    with named(what, groups):
        dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, unflatten(flat, tensors)):
        t.copy_(synced)


@dataclass
class ParamSplit:
    dense: List[Tensor]
    """Replicated dense parameters (routers always; everything dense without FSDP)."""
    dense_fsdp: List[Tensor]
    """Dense parameters sharded by FSDP over the world (their gradients arrive reduce-scattered)."""
    experts: List[Tensor]
    """Parameters of experts with a single holder per ep group."""
    replicated: List[Tuple[LayerShard, int, List[Tensor]]]
    """(shard, logical expert, every parameter, frozen ones too) of the replicated experts this rank holds."""

    def all_params(self) -> List[Tensor]:
        """Every parameter that trains."""
        replicated = [p for _, _, ps in self.replicated for p in ps if p.requires_grad]
        return self.dense + self.dense_fsdp + self.experts + replicated


def split_params(model: nn.Module, shards: Sequence[LayerShard]) -> ParamSplit:
    expert_ids = expert_param_ids(shards)
    dense = trainable(p for p in model.parameters() if id(p) not in expert_ids)
    experts: List[Tensor] = []
    replicated: List[Tuple[LayerShard, int, List[Tensor]]] = []
    for shard in shards:
        for expert, module in shard.local_modules():
            if shard.is_replicated(expert):  # every parameter: its gradient slots are the layer's (_slot_grads)
                replicated.append((shard, expert, list(module.parameters())))
            else:
                experts += trainable(module.parameters())
    return ParamSplit([p for p in dense if not is_sharded(p)], [p for p in dense if is_sharded(p)], experts, replicated)


def _grads(params: Sequence[Tensor]) -> List[Tensor]:
    """This rank's part of each gradient (the local shard of a sharded one)."""
    return [local(p.grad) for p in params if p.grad is not None]


def _slot_grads(params: Sequence[Tensor], slots: Sequence[bool]) -> List[Tensor]:
    """A replicated expert's part of the gradient sum (all its parameters, in order): its gradient in each of the
    layer's slots, zeros where it does not train (a frozen base expert beside trainable added ones)."""
    return [
        local(p.grad) if p.grad is not None else torch.zeros_like(local(p.detach()))
        for p, slot in zip(params, slots, strict=True)
        if slot
    ]


class GradSync:
    """Sums gradients where FSDP does not. With ``experts_sharded`` (expert_sharding = fsdp) FSDP has
    already summed each expert's gradient over its expert-dp group, and this rank holds one shard of it."""

    def __init__(self, model: nn.Module, groups: ParallelGroups, experts_sharded: bool = False):
        self.model = model
        self.groups = groups
        self.experts_sharded = experts_sharded

    def sync(self, shards: Sequence[LayerShard]) -> None:
        split = split_params(self.model, shards)
        fill_missing_grads(split.all_params())
        if not self.groups.distributed:
            return
        all_reduce_flat(_grads(split.dense), None, self.groups, "dense gradient all_reduce")
        if self.groups.dp_size > 1 and not self.experts_sharded:
            all_reduce_flat(
                _grads(split.experts),
                self.groups.expert_dp_group,
                self.groups,
                "expert gradient all_reduce (expert-dp group)",
            )
        self._sync_replicas(shards, split.replicated)

    def _sync_replicas(self, shards: Sequence[LayerShard], held: List[Tuple[LayerShard, int, List[Tensor]]]) -> None:
        """One all-reduce over a buffer with a slot for every replicated expert of every layer (zeros
        where this rank holds none): over the world for plain experts (replicas and expert-dp copies at
        once); over the ep group for sharded ones, whose expert-dp sum FSDP has done."""
        held_grads = {
            (shard.index, expert): _slot_grads(params, expert_gradient_slots(shard.layer.config))
            for shard, expert, params in held
        }
        buffers: List[Tensor] = []
        mine: Dict[int, List[Tensor]] = {}
        for shard in shards:
            for expert in shard.placement.replicated_experts():
                grads = held_grads.get((shard.index, expert))
                if grads is None:
                    like = shard.layer.router.weight
                    grads = [like.new_zeros(s) for s in self._local_shapes(shard)]
                else:
                    mine[len(buffers)] = grads
                buffers.append(flatten(grads))
        if not buffers:
            return
        flat = torch.cat(buffers)
        group = self.groups.ep_group if self.experts_sharded else None
        with named("replicated-expert gradient all_reduce", self.groups):
            dist.all_reduce(flat, group=group)
        for index, grads in mine.items():
            offset = sum(b.numel() for b in buffers[:index])
            synced = flat[offset : offset + buffers[index].numel()]
            for g, s in zip(grads, unflatten(synced, grads)):
                g.copy_(s)

    def _local_shapes(self, shard: LayerShard) -> List[torch.Size]:
        """Shapes of this rank's part of one expert's gradients (FSDP cuts dim 0 in expert-dp chunks)."""
        slots = expert_gradient_slots(shard.layer.config)  # frozen weights (LoRA's base) have no gradient
        shapes = [shape for shape, slot in zip(expert_param_shapes(shard.layer.config), slots) if slot]
        if not self.experts_sharded:
            return shapes
        size, index = self.groups.dp_size, self.groups.dp_rank
        return [local_chunk_shape(shape, size, index) for shape in shapes]

    def grad_norm(self, shards: Sequence[LayerShard]) -> Tensor:
        """Global L2 norm (a 0-d float64 tensor on the device) with every logical parameter counted
        once: dense once, each expert once. One fused norm pass per group, no host read.

        Replicated dense parts count as they are; shards of sharded ones are summed over the world (each
        element lives on one rank, per replica); plain experts are summed over the ep group."""
        split = split_params(self.model, shards)
        device = self.groups.device
        dense_sq = _sum_of_squares(_grads(split.dense), device)
        world_sq = _sum_of_squares(_grads(split.dense_fsdp), device)
        expert_sq = _sum_of_squares(_grads(split.experts), device)
        for shard, expert, params in split.replicated:
            share = 1.0 / shard.placement.num_replicas(expert)
            expert_sq = expert_sq + share * _sum_of_squares(_grads(params), device)
        if self.experts_sharded:
            world_sq, expert_sq = world_sq + expert_sq, torch.zeros_like(expert_sq)
        if self.groups.distributed:
            world_sq = sum_over_ranks(world_sq.reshape(1), self.groups, "gradient norm all_reduce (world)").reshape(())
            if self.groups.ep_size > 1 and not self.experts_sharded:
                expert_sq = sum_over_ranks(
                    expert_sq.reshape(1), self.groups, "gradient norm all_reduce (ep group)", self.groups.ep_group
                ).reshape(())
        return (dense_sq + world_sq + expert_sq).sqrt()

    def clip(self, shards: Sequence[LayerShard], max_norm: float) -> float:
        """Scale all gradients so the global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm(shards)
        grads = _grads(list(self.model.parameters()))
        if max_norm > 0 and grads:
            scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        return float(norm)  # NOTE: device-to-host sync, once per step (the logged norm)


def local_chunk_shape(shape: torch.Size, num_chunks: int, index: int) -> torch.Size:
    """Shape of chunk `index` when dim 0 is cut like torch.chunk (FSDP2's default Shard(0))."""
    chunks = torch.empty(shape, device="meta").chunk(num_chunks, dim=0)
    return chunks[index].shape if index < len(chunks) else torch.Size((0,) + tuple(shape[1:]))


def _sum_of_squares(tensors: List[Tensor], device: torch.device) -> Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors)).double().pow(2).sum()

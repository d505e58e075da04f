"""Apply a Plan at a step boundary, identically on every rank.

Per MoE layer, in this order (the same on every rank, so collectives line up):
  1. new expert weights that are combinations of existing experts (and the copy of the expert being
     discarded, kept for a later 'reuse_discarded') are formed with ONE all-reduce over the ep group:
     each expert contributes once, from its first holder;
  2. experts that must appear on a rank that does not hold them are sent point-to-point, with their
     optimizer state (Adam's exp_avg, exp_avg_sq and step travel bit for bit);
  3. the bank is rebuilt in the new slot order: experts that stay keep their parameter objects (and so
     their optimizer state); added experts start with fresh state; the router drops and appends rows,
     its optimizer moments sliced and padded with zeros to match.
Every ep group of a dp x ep world does this in parallel on its own ranks.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from ..moe.balance import start_added_experts
from ..moe.config import MoEConfig
from ..moe.experts import (
    Expert,
    as_added,
    copy_expert,
    expert_param_shapes,
    keep_trainability,
    new_expert,
    stored_discarded,
    stored_expert_with,
    stored_new_expert,
)
from ..moe.frozen_base import storage_tensors, store_expert
from ..moe.layer import MoELayer
from ..planning.placement import Placement
from ..planning.planner import AddSpec, LayerPlan
from .expert_parallel import install_shard
from .groups import ParallelGroups, named
from .shard import LayerShard

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


# -- 1. linear combinations of experts -------------------------------------------------------------
def combine_experts(
    combos: Sequence[Sequence[Tuple[int, float]]], shard: LayerShard, groups: ParallelGroups
) -> List[List[Tensor]]:
    """For each combo [(old id, coefficient)], the parameter list sum_e c_e * params(e), on every ep rank."""
    if not combos:
        return []
    layer = shard.layer
    owned = dict(shard.owned_modules())
    shapes = expert_param_shapes(layer.config)
    template = layer.router.weight  # experts share the router's device and dtype (model.to applies to all)
    dtype = template.dtype
    sizes = [s.numel() for s in shapes]
    flat = torch.zeros(len(combos), sum(sizes), dtype=dtype, device=template.device)
    for row, combo in enumerate(combos):
        for expert, coeff in combo:
            if expert in owned:  # each expert contributes once, from its owner
                flat[row] += coeff * torch.cat([p.detach().to(dtype).reshape(-1) for p in owned[expert].parameters()])
    if groups.ep_size > 1:
        with named("expert combination all_reduce (ep group)", groups):
            dist.all_reduce(flat, group=groups.ep_group)
    return [[part.reshape(shape).clone() for part, shape in zip(row.split(sizes), shapes)] for row in flat]


def random_expert(config: MoEConfig, seed: int, like: Tensor) -> Expert:
    """A freshly initialised expert, identical on every rank (seeded by the plan); its frozen base stored."""
    return cast(Expert, store_expert(drawn_expert(config, seed, like), config.base_dtype))


def drawn_expert(config: MoEConfig, seed: int, like: Tensor) -> nn.Module:
    """``random_expert`` before its frozen base is stored: on ``like``'s device and dtype, drawn on the host from
    ``seed`` (the run's generator left where it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = new_expert(config)
    return module.to(device=like.device, dtype=like.dtype)


# -- 2. point-to-point moves with optimizer state ----------------------------------------------------
# One expert travels as two messages: a small header saying which optimizer-state entries exist for each
# parameter, then every tensor's raw bytes in one buffer (bit-exact for any dtype). A message per tensor
# (about 24 for an Adam-trained expert) made each move cost two dozen round trips, which on gloo is
# milliseconds each: an event moving a few small experts took several training steps.
HEADER = 3  # entries per parameter


def _state_header(module: nn.Module, optimizer: Optimizer) -> List[int]:
    """Per parameter: [has state, bit mask over STATE_KEYS of the moments present, trains]. Whether it trains
    travels: a frozen expert (LoRA without expert adapters, model.freeze) stays frozen where it lands, an
    added expert that trains whole (lora.added_experts = 'trainable') keeps training."""
    header = []
    for p in module.parameters():
        state = optimizer.state.get(p, {})
        header += [1 if state else 0, sum(1 << i for i, k in enumerate(STATE_KEYS) if k in state), int(p.requires_grad)]
    return header


def _as_bytes(t: Tensor) -> Tensor:
    """``t``'s elements as bytes, in a fresh flat tensor: a tensor torch counts as contiguous may still have a
    stride other than 1 in a size-1 dimension (an NF4 weight of one scaler block holds its factor as (1,) with
    stride (8,)), which a byte view refuses."""
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def send_expert(module: nn.Module, optimizer: Optimizer, dst: int, groups: ParallelGroups) -> None:
    like = next(module.parameters())
    header = _state_header(module, optimizer)
    pieces = []
    for p, has_state, mask in zip(module.parameters(), header[0::HEADER], header[1::HEADER]):
        pieces += [_as_bytes(t) for t in storage_tensors(p)]  # a stored base travels as it is held
        if has_state:
            state = optimizer.state[p]
            step = torch.tensor([float(state["step"])], dtype=torch.float64, device=like.device)
            pieces += [_as_bytes(step)] + [_as_bytes(state[k]) for i, k in enumerate(STATE_KEYS) if mask >> i & 1]
    with named(f"expert send to rank {dst}", groups):
        dist.send(torch.tensor(header, dtype=torch.long, device=like.device), dst)
        dist.send(torch.cat(pieces), dst)


def recv_expert(config: MoEConfig, like: Tensor, optimizer: Optimizer, src: int, groups: ParallelGroups) -> Expert:
    module = stored_new_expert(config, like)  # its stored weights' tensors are overwritten with the sender's
    params = list(module.parameters())
    header = torch.zeros(HEADER * len(params), dtype=torch.long, device=like.device)
    with named(f"expert receive from rank {src}", groups):
        dist.recv(header, src)
        flags = header.tolist()  # NOTE: device-to-host sync (the payload size), per moved expert at an event
        payload = torch.empty(_payload_bytes(params, flags), dtype=torch.uint8, device=like.device)
        dist.recv(payload, src)
    _unpack(payload, params, flags, optimizer)
    keep_trainability(module, [bool(trains) for trains in flags[2::HEADER]])
    return module


def _payload_bytes(params: Sequence[Tensor], flags: List[int]) -> int:
    total = 0
    for p, has_state, mask in zip(params, flags[0::HEADER], flags[1::HEADER]):
        moments = bin(mask).count("1") if has_state else 0
        total += sum(t.numel() * t.element_size() for t in storage_tensors(p))
        total += moments * p.numel() * p.element_size() + (8 if has_state else 0)
    return total


class _Reader:
    """Reads consecutive tensors back out of a received byte buffer."""

    def __init__(self, payload: Tensor):
        self.payload, self.offset = payload, 0

    def take(self, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        chunk = self.payload[self.offset : self.offset + size]
        self.offset += size
        return chunk.clone().view(dtype).reshape(shape)  # cloned first: an NF4 base's bytes leave odd offsets


def _unpack(payload: Tensor, params: Sequence[Tensor], flags: List[int], optimizer: Optimizer) -> None:
    reader = _Reader(payload)
    with torch.no_grad():
        for p, has_state, mask in zip(params, flags[0::HEADER], flags[1::HEADER]):
            for t in storage_tensors(p):
                t.copy_(reader.take(t.dtype, t.shape))
            if not has_state:
                continue
            step = float(reader.take(torch.float64, ()))  # NOTE: device-to-host sync (per moved expert)
            state = {"step": torch.tensor(step, dtype=_scalar_dtype())}
            for i, key in enumerate(STATE_KEYS):
                if mask >> i & 1:
                    state[key] = reader.take(p.dtype, p.shape)
            optimizer.state[p] = state
    assert reader.offset == payload.numel(), "expert payload size disagrees with its header"


def transfers(lp: LayerPlan, old_placement: Placement) -> List[Tuple[int, int, int]]:
    """(new id, source ep rank, destination ep rank) for every kept expert landing on a new rank; the
    expert's owner sends it."""
    moves = []
    for new_id, old_id in enumerate(lp.kept):
        holders = old_placement.holders(old_id)
        for dst in lp.placement.holders(new_id):
            if dst not in holders:
                moves.append((new_id, old_placement.owner(old_id), dst))
    return moves


# -- 3. the layer as a whole -------------------------------------------------------------------------
def apply_layer_plan(
    lp: LayerPlan, shard: LayerShard, optimizer: Optimizer, groups: ParallelGroups, discarded: Optional[List[Tensor]]
) -> Tuple[LayerShard, Optional[List[Tensor]]]:
    """Rebuild the shard's layer as the plan says. Returns the layer's new shard record and the (possibly
    updated) remembered discarded expert."""
    layer = shard.layer
    local = dict(shard.local_modules())
    combos = [spec.coeffs for spec in lp.added if spec.source == "experts"]
    if lp.remember_discarded is not None:
        combos.append(((lp.remember_discarded, 1.0),))
    combined = combine_experts(combos, shard, groups)
    if lp.remember_discarded is not None:
        discarded = stored_discarded(combined.pop(), layer.config)
    received = _move_experts(lp, shard, local, optimizer, groups)
    added = _added_experts(lp.added, combined, discarded, layer.config, layer.router.weight)
    experts = []
    for new_id in lp.placement.experts_on(groups.ep_rank):
        if new_id < len(lp.kept):
            old_id = lp.kept[new_id]
            experts.append(local[old_id] if old_id in local else received[new_id])
        else:
            experts.append(copy_expert(added[new_id - len(lp.kept)], layer.config))
    layer.experts.set_experts(experts)
    resize_router(layer, lp, optimizer)
    new_shard = shard.moved_to(lp.placement)
    install_shard(new_shard, groups)
    return new_shard, discarded


def _move_experts(
    lp: LayerPlan, shard: LayerShard, local: Dict[int, nn.Module], optimizer: Optimizer, groups: ParallelGroups
) -> Dict[int, Expert]:
    received = {}
    like = shard.layer.router.weight  # device and dtype of every expert
    for new_id, src, dst in transfers(lp, shard.placement):
        if groups.ep_rank == src:
            send_expert(local[lp.kept[new_id]], optimizer, groups.global_rank(dst), groups)
        elif groups.ep_rank == dst:
            received[new_id] = recv_expert(shard.layer.config, like, optimizer, groups.global_rank(src), groups)
    return received


def _added_experts(
    specs: Sequence[AddSpec],
    combined: List[List[Tensor]],
    discarded: Optional[List[Tensor]],
    config: MoEConfig,
    like: Tensor,
) -> List[Expert]:
    combined = list(combined)
    experts = []
    for spec in specs:
        if spec.source == "experts":
            expert, copied = stored_expert_with(combined.pop(0), config), True
        elif spec.source == "discarded" and discarded is not None:
            expert, copied = stored_expert_with(discarded, config), True
        else:
            expert, copied = random_expert(config, spec.seed, like), False
        experts.append(as_added(expert, config, spec.seed, copied))  # as lora.added_experts says
    return experts


def resize_router(layer: MoELayer, lp: LayerPlan, optimizer: Optimizer) -> None:
    """Drop removed gate rows, append new ones; slice the router's Adam moments the same way."""
    old = dict(layer.router.named_parameters())
    states = {name: optimizer.state.pop(p, None) for name, p in old.items()}
    gates = torch.tensor([spec.gate for spec in lp.added], dtype=torch.float64).reshape(len(lp.added), layer.config.dim)
    layer.router.resize(list(lp.kept), gates)
    start_added_experts(layer, len(lp.kept))  # with a budget, the budget places the added experts
    kept = torch.tensor(lp.kept, dtype=torch.long)
    for name, p in layer.router.named_parameters():
        state = states.get(name)
        if not state:
            continue
        new_state = {"step": state["step"].clone()}
        for key in STATE_KEYS:
            if key in state:
                moment = state[key].index_select(0, kept.to(state[key].device))
                pad = moment.new_zeros((len(lp.added),) + tuple(moment.shape[1:]))
                new_state[key] = torch.cat([moment, pad])
        optimizer.state[p] = new_state

"""build_parts(config, source): the one assembly of a model into what trains it.

The order is torchtitan's and it matters:
  1. checks that need no communication (activation checkpointing finds blocks; every MoE layer has an
     expert per ep rank), so a bad setting fails on every rank before the first collective;
  2. the process groups, and a digest of the config compared across ranks;
  3. the model on its device and dtype (``source.place``: an imported transformers MoE stays on the meta
     device);
  4. expert parallelism (each rank keeps its own experts), then FSDP: experts first, as they sit inside
     the blocks, then the dense blocks and the root; then ``source.fill``: a source whose weights are read
     later (an imported transformers MoE) is given storage and reads only this rank's experts and dense rows;
     under ``[lora]`` the adapters were added before step 2 (the base frozen) and are drawn now; a
     low-precision base (lora.base_dtype) is stored bf16 before FSDP shards it, NF4 once filled;
  5. the optimizer over the sharded parameters, the one owner of the expert set, the gradient sync.
The Trainer and every benchmark call this; nothing else strings these steps together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..config import RunConfig
from ..models.lora import apply_lora, init_adapters, lower_base, quantize_base, replicated_base
from ..models.source import ModelSource
from ..moe.layer import find_moe_layers
from ..parallel.blocks import apply_activation_checkpointing
from ..parallel.expert_parallel import parallelize
from ..parallel.fsdp import Sharding, fill_local, plan_sharding, shard_dense, shard_experts
from ..parallel.grads import GradSync
from ..parallel.groups import ParallelGroups, check_same_everywhere, current_world_size, init_groups, resolve_ep_size
from .experts import ExpertSet
from .optim import build_optimizer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bf16": torch.float32}


@dataclass(frozen=True)
class TrainParts:
    """What trains a model on this rank. Frozen: a part is replaced only by building the parts again."""

    groups: ParallelGroups
    model: nn.Module
    experts: ExpertSet
    sharding: Sharding
    optimizer: Optimizer
    grad_sync: GradSync


def build_parts(config: RunConfig, source: ModelSource) -> TrainParts:
    """Parallelize ``source.model`` (built on every rank from the same seed) for ``config`` and build its
    optimizer; collective from step 2 on (every rank calls it, in the same order)."""
    model = source.model
    if config.train.activation_checkpointing == "block":
        apply_activation_checkpointing(model)  # fails here, before any collective, without blocks
    check_experts_fit(model, resolve_ep_size(config.parallel.ep_size, current_world_size()))
    if config.lora.enabled:
        apply_lora(model, config.lora)  # adapters, the base frozen; a bad target fails here, before any collective
    groups = init_groups(config.parallel)
    check_same_everywhere(config.digest(), groups, "config hash")
    source.place(groups.device, DTYPES[config.train.precision])
    lower_base(model, config.lora, DTYPES[config.train.precision])  # a bf16 base, before FSDP shards it
    shards = parallelize(model, groups)
    sharding = plan_sharding(config.parallel, groups, bf16=config.train.precision == "bf16")
    shard_experts(shards, sharding)
    shard_dense(model, shards, sharding, replicated=replicated_base(model, config.lora))
    held = [(shard.index, shard.local_experts, shard.layer.experts.experts) for shard in shards]
    source.fill(held, groups.device, fill_local)  # weights read once this rank's share is known
    if config.lora.enabled:
        init_adapters(model, config.train.seed, held, fill_local)
        if config.lora.base_dtype == "nf4":
            quantize_base(model)  # the filled weights, whole on this rank (replicated_base), stored 4-bit
    optimizer = build_optimizer(model, config.train)
    experts = ExpertSet(model, shards, sharding, optimizer, groups)
    grad_sync = GradSync(model, groups, experts_sharded=sharding.experts)
    return TrainParts(groups, model, experts, sharding, optimizer, grad_sync)


def check_experts_fit(model: nn.Module, ep_size: int) -> None:
    for index, (_, layer) in enumerate(find_moe_layers(model)):
        if layer.num_experts < ep_size:
            raise ValueError(f"MoE layer {index}: num_experts ({layer.num_experts}) < ep_size ({ep_size})")

"""FSDP2 (``fully_shard``) beside expert parallelism, applied after it (torchtitan's order: EP, AC, FSDP).

- ``dense_sharding = "fsdp"``: every transformer block and the root are sharded over the whole world.
  Experts are ``ignored_params`` (they keep their EP sharding), and so are the **routers**: the planner
  resizes a router at every event (rows dropped and appended), which an FSDP-managed parameter cannot do
  without rebuilding its group, and a router is tiny (E x D). They stay replicated and are summed by
  ``GradSync`` like before; the dense FSDP groups are never rebuilt.
- ``expert_sharding = "fsdp"``: each local expert is sharded over its expert-dp group (the ranks that
  hold the same expert shard) instead of copied there. Every rank then runs every local expert each step,
  also on zero rows (``ExpertBank.run_every_expert``), so the all-gathers and reduce-scatters always line
  up; an expert with no rows on one rank would otherwise hang its group.
- Gradients are *summed* (divide factor 1), as everywhere else: losses are normalised by the global batch.
- Adaptive events and expert checkpoints work on full logical experts: ``unshard_experts`` turns the
  sharded experts back into plain modules (weights and Adam state gathered), the plan or the resume works
  on those exactly as without FSDP, and ``shard_experts`` shards the new set again, optimizer state
  included. The dense state is never gathered: checkpoints write and read its DTensor shards as they are
  (train/dense_state.py, torch.distributed.checkpoint reshards on load).

Shape legend: W world size, P expert-dp group size.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim import Optimizer

from ..moe.experts import keep_trainability, stored_expert_with
from .blocks import find_blocks
from .groups import ParallelGroups, named
from .shard import LayerShard


@dataclass
class Sharding:
    """What FSDP does in this run (both off: plain replication, and every helper here is a no-op)."""

    dense: bool
    experts: bool
    world_mesh: Optional[DeviceMesh] = None
    expert_mesh: Optional[DeviceMesh] = None
    """The expert-dp dimension of the (dp, ep) mesh: ranks with this rank's ep_rank."""
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    reshard_after_forward: bool = True


def plan_sharding(parallel_config: Any, groups: ParallelGroups, bf16: bool) -> Sharding:
    """The sharding a run will use; FSDP on a world of one rank warns and trains plainly. Builds the
    device meshes (collective: every rank calls this, in the same order)."""
    dense = parallel_config.dense_sharding == "fsdp"
    experts = parallel_config.expert_sharding == "fsdp"
    if (dense or experts) and not groups.distributed:
        warnings.warn(
            "parallel.dense_sharding/expert_sharding ('fsdp') on a world of 1 rank: nothing to shard, "
            "training without FSDP",
            stacklevel=2,
        )
        return Sharding(False, False)
    if not (dense or experts):
        return Sharding(False, False)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    device_type = groups.device.type
    with named("device mesh creation", groups):
        world_mesh = init_device_mesh(device_type, (groups.world_size,)) if dense else None
        expert_mesh = (
            init_device_mesh(device_type, (groups.dp_size, groups.ep_size), mesh_dim_names=("expert_dp", "ep"))[
                "expert_dp"
            ]
            if experts
            else None
        )
    reshard = bool(getattr(parallel_config, "fsdp_reshard_after_forward", True))
    return Sharding(dense, experts, world_mesh, expert_mesh, policy, reshard)


def _no_divide(module: nn.Module) -> None:
    """Gradients are summed (the loss is already normalised by the global batch), with a plain SUM:
    gloo has no PREMUL_SUM, which FSDP picks for some mixed-precision settings."""
    if isinstance(module, FSDPModule):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def shard_dense(
    model: nn.Module, shards: Sequence[LayerShard], sharding: Sharding, replicated: Sequence[nn.Parameter] = ()
) -> None:
    """fully_shard every block, then the root, over the world; experts, routers and ``replicated`` (frozen
    weights each rank holds whole: an NF4 base, models.lora.replicated_base) are left out."""
    if not sharding.dense:
        return
    ignored = {
        p for shard in shards for module in (shard.layer.experts, shard.layer.router) for p in module.parameters()
    } | set(replicated)
    for block in find_blocks(model):
        fully_shard(
            block,
            mesh=sharding.world_mesh,
            ignored_params=ignored,
            mp_policy=sharding.mp_policy,
            reshard_after_forward=sharding.reshard_after_forward,
        )
        _no_divide(block)
    # The root keeps its weights gathered from forward to backward (FSDP's own default for the root): its
    # head and embedding are the first and last thing the backward needs, so freeing them saves nothing.
    fully_shard(
        model,
        mesh=sharding.world_mesh,
        ignored_params=ignored,
        mp_policy=sharding.mp_policy,
        reshard_after_forward=False,
    )
    _no_divide(model)


def shard_experts(shards: Sequence[LayerShard], sharding: Sharding, optimizer: Optional[Optimizer] = None) -> None:
    """fully_shard each local expert over the expert-dp group. Optimizer state held for the plain
    parameters (after an event or a resume) is sharded the same way onto the new parameters."""
    if not sharding.experts:
        return
    for shard in shards:
        shard.layer.experts.run_every_expert = True
        for module in shard.layer.experts.experts:
            if isinstance(module, FSDPModule):
                continue
            plain = list(module.parameters())
            fully_shard(
                module,
                mesh=sharding.expert_mesh,
                mp_policy=sharding.mp_policy,
                reshard_after_forward=sharding.reshard_after_forward,
            )
            _no_divide(module)
            if optimizer is not None:
                for old, new in zip(plain, module.parameters()):
                    state = optimizer.state.pop(old, None)
                    if state:
                        optimizer.state[new] = {k: shard_like(v, new) if k != "step" else v for k, v in state.items()}


def unshard_experts(shards: Sequence[LayerShard], sharding: Sharding, optimizer: Optimizer) -> None:
    """Replace every sharded expert by a plain module with its full weights and full Adam state
    (collective over each expert-dp group, in slot order on every rank)."""
    if not sharding.experts:
        return
    for shard in shards:
        plain_modules = []
        for module in shard.layer.experts.experts:
            params = list(module.parameters())
            plain = stored_expert_with([full(p.detach()) for p in params], shard.layer.config)
            keep_trainability(plain, [p.requires_grad for p in params])
            for old, new in zip(params, plain.parameters()):
                state = optimizer.state.pop(old, None)
                if state:
                    optimizer.state[new] = {k: full(v) for k, v in state.items()}
            plain_modules.append(plain)
        shard.layer.experts.set_experts(plain_modules)


def reshard_gathered(model: nn.Module) -> None:
    """Free the whole dense weights FSDP holds gathered after a forward that no backward follows (an
    evaluation): the root is sharded with reshard_after_forward=False, so its weights stay whole until the
    next backward; blocks with reshard_after_forward=False too."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full(t: Any) -> Any:
    """The whole tensor behind a DTensor shard (an all-gather); anything else as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(value: Tensor, param: Tensor) -> Tensor:
    """A full tensor cut like `param` (a DTensor: this rank's shard, no communication); else unchanged."""
    if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(p: Tensor) -> bool:
    return isinstance(p, DTensor)


def local_rows(p: DTensor) -> tuple[int, int]:
    """[start, stop) of the rows of the full tensor that this rank's FSDP shard of ``p`` holds: FSDP2 cuts
    dim 0 over a 1-D mesh as torch.chunk does (rank r: rows from r * ceil(N / W))."""
    assert p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),), f"unexpected sharding {p.placements}"
    size, index, rows = p.device_mesh.size(), p.device_mesh.get_local_rank(), p.shape[0]
    chunk = -(-rows // size)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def fill_local(p: Tensor, read: Callable[[int, int], Tensor]) -> None:
    """Fill ``p`` with ``read(start, stop)``, the rows [start, stop) of the full tensor it stands for: all of
    them for a plain tensor, only this rank's for an FSDP shard (what a loader reads from a file)."""
    if isinstance(p, DTensor):
        start, stop = local_rows(p)
        p.to_local().copy_(read(start, stop))
    else:
        p.copy_(read(0, p.shape[0]))

"""Process groups: world = dp x ep.

Rank layout: ``rank = dp_rank * ep_size + ep_rank``. The ep group of a rank is the ``ep_size``
consecutive ranks that share its dp_rank (experts are sharded over it); its expert-dp group is the
ranks with the same ep_rank (they hold the same expert shard, so expert gradients are summed over it).
Dense parameters are data-parallel over the whole world.

Every collective this package issues runs under ``named(...)``: a timeout or a dead peer becomes a
``CollectiveError`` that says which collective failed, on which rank, after how long.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it."""


@dataclass(frozen=True)
class ParallelGroups:
    world_size: int
    rank: int
    ep_size: int
    ep_group: Any
    expert_dp_group: Any
    """Ranks holding the same expert shard (same ep_rank): expert gradients are summed over it."""
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ep_size

    def global_rank(self, ep_rank: int) -> int:
        """World rank of `ep_rank` in this rank's ep group."""
        return self.dp_rank * self.ep_size + ep_rank


def single_process(device: Optional[torch.device] = None) -> ParallelGroups:
    return ParallelGroups(1, 0, 1, None, None, "none", device or torch.device("cpu"), 0.0)


def resolve_ep_size(ep_size: int, world_size: int) -> int:
    """0 means the whole world; anything else must divide the world size."""
    ep = world_size if ep_size == 0 else ep_size
    if ep < 1 or world_size % ep:
        raise ValueError(f"parallel.ep_size ({ep_size}) does not divide the world size ({world_size})")
    return ep


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("parallel.device ('cuda') but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("parallel.backend ('nccl') needs CUDA devices; use 'gloo' on CPU")
    return backend


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def current_world_size() -> int:
    """The world this process belongs to: the initialised group's, else what the launcher announced
    (known before any group exists, so start-up checks can use it)."""
    return dist.get_world_size() if dist.is_initialized() else world_from_env()


def current_rank() -> int:
    """This process's rank in the initialised group (0 before any group exists)."""
    return dist.get_rank() if dist.is_initialized() else 0


def init_groups(parallel_config: Any) -> ParallelGroups:
    """Join (or start) the default process group and build the ep and expert-dp groups.

    Everything that can be checked without communication is checked first, so a bad setting fails on
    every rank with the same message before any collective could hang.
    """
    world_size = current_world_size()
    ep_size = resolve_ep_size(parallel_config.ep_size, world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(parallel_config.device, local_rank)
    if world_size == 1 and not dist.is_initialized():
        return single_process(device)
    backend = pick_backend(parallel_config.backend, device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        timeout = timedelta(seconds=parallel_config.timeout_s)
        device_id = device if device.type == "cuda" else None
        store = elastic_attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=world_size,
                timeout=timeout,
                device_id=device_id,
            )
    return build_groups(ep_size, device, float(parallel_config.timeout_s))


def elastic_attempt_store(timeout: timedelta) -> Optional[Any]:
    """Under torchrun with restarts, the agent's store outlives a failed attempt, and the keys that
    process groups (the subgroups especially) rendezvous through keep their old names: a restarted
    rank can read a dead peer's address and fail to connect. Prefixing the store with the attempt
    number gives every attempt fresh keys."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dynmoe/attempt_{attempt}", client)


def build_groups(ep_size: int, device: Optional[torch.device] = None, timeout_s: float = 120.0) -> ParallelGroups:
    """ParallelGroups for an initialised default group (collective: call on every rank); CPU by default."""
    device = device if device is not None else torch.device("cpu")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    ep_size = resolve_ep_size(ep_size, world_size)
    ep_group, expert_dp_group = _subgroups(world_size, ep_size, rank, timeout_s)
    return ParallelGroups(world_size, rank, ep_size, ep_group, expert_dp_group, dist.get_backend(), device, timeout_s)


def _subgroups(world_size: int, ep_size: int, rank: int, timeout_s: float) -> Tuple[Any, Any]:
    """new_group is collective over the world: every rank creates every group, in the same order."""
    dp_size = world_size // ep_size
    timeout = timedelta(seconds=timeout_s)
    ep_group = expert_dp_group = None
    for dp_rank in range(dp_size):
        group = dist.new_group(list(range(dp_rank * ep_size, (dp_rank + 1) * ep_size)), timeout=timeout)
        if rank // ep_size == dp_rank:
            ep_group = group
    for ep_rank in range(ep_size):
        group = dist.new_group(list(range(ep_rank, world_size, ep_size)), timeout=timeout)
        if rank % ep_size == ep_rank:
            expert_dp_group = group
    return ep_group, expert_dp_group


@contextlib.contextmanager
def named(what: str, groups: Optional[ParallelGroups] = None) -> Iterator[None]:
    """Re-raise any failure inside a collective as CollectiveError naming the collective."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as err:  # gloo raises RuntimeError, NCCL DistBackendError (a RuntimeError)
        where = f" on rank {groups.rank} (timeout {groups.timeout_s:g}s)" if groups else ""
        raise CollectiveError(f"collective '{what}' failed{where}: {err}") from err


def sum_over_ranks(t: torch.Tensor, groups: ParallelGroups, what: str, group: Any = None) -> torch.Tensor:
    """Sum a tensor over `group` (default: the world), in place, and return it. Host-side tensors
    (metrics, statistics) make a round trip through the device: NCCL reduces device tensors only."""
    if not groups.distributed:
        return t
    work = t if t.device == groups.device else t.to(groups.device)
    with named(what, groups):
        dist.all_reduce(work, group=group)
    if work is not t:
        t.copy_(work)
    return t


def all_gather_object(obj: Any, groups: ParallelGroups, what: str) -> List[Any]:
    if not groups.distributed:
        return [obj]
    out: List[Any] = [None] * groups.world_size
    with named(what, groups):
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, groups: ParallelGroups, what: str, src: int = 0) -> Any:
    """Rank `src`'s object on every rank (small plain data: plans, digests)."""
    if not groups.distributed:
        return obj
    payload = [obj]
    with named(what, groups):
        dist.broadcast_object_list(payload, src=src)
    return payload[0]


def check_same_everywhere(value: str, groups: ParallelGroups, what: str) -> None:
    """Raise on every rank, with the differing ranks listed, unless all ranks passed the same value."""
    values = all_gather_object(value, groups, f"compare {what}")
    if len(set(values)) > 1:
        by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"{what} differs across ranks ({by_rank})")


def barrier(groups: ParallelGroups, what: str, group: Any = None) -> None:
    if groups.distributed:
        with named(what, groups):
            dist.barrier(group=group)

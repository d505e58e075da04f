"""Coordinators: ranks submit window statistics and receive the same versioned Plan.

Both implementations call the one pure planner (``planning.planner.plan``):
  - ``CollectiveCoordinator`` (torchrun, simulated clusters): every rank's request digest is compared,
    statistics are summed over every rank with one all-reduce, rank 0 plans, the plan is broadcast, and
    every rank checks its digest;
  - ``RayCoordinator`` (``dynmoe_dist.cluster``): a named Ray actor merges what the workers push, and
    refuses a request that differs from one another rank sent for the same version.
Either way, ranks whose requests disagree (diverged placements, configs or versions) fail on every rank
before anything is planned, instead of applying a plan made for someone else's state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from .parallel.groups import ParallelGroups, all_gather_object, broadcast_object, sum_over_ranks
from .planning.placement import Placement
from .planning.planner import Plan, PlannerConfig, plan
from .planning.stats import WindowStats


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner needs besides the statistics; identical on every rank."""

    version: int
    step: int
    placements: Tuple[Placement, ...]
    configs: Tuple[PlannerConfig, ...]
    has_discarded: Tuple[bool, ...]
    dims: Tuple[int, ...]
    load_history: Optional[Tuple[Tuple[float, ...], ...]] = None

    def digest(self) -> str:
        """Hash of everything in the request (the same inputs give the same repr on every rank)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def make_plan(self, stats: Sequence[WindowStats], planned_by: str) -> Plan:
        return plan(
            stats,
            self.placements,
            self.configs,
            version=self.version,
            step=self.step,
            has_discarded=self.has_discarded,
            load_history=self.load_history,
            planned_by=planned_by,
        )


class Coordinator(Protocol):
    name: str

    def submit(self, request: PlanRequest, local_stats: List[WindowStats]) -> Plan: ...


class PlanMismatch(RuntimeError):
    pass


def verify_plan(plan_: Plan, digest: str, request: PlanRequest, rank: int) -> Plan:
    """Every rank checks the plan before applying it: right version, intact contents."""
    if plan_.version != request.version:
        raise PlanMismatch(f"rank {rank}: plan version {plan_.version} != requested {request.version}")
    if plan_.digest() != digest:
        raise PlanMismatch(f"rank {rank}: plan digest {plan_.digest()} != announced {digest}")
    return plan_


def flatten_stats(stats: Sequence[WindowStats]) -> torch.Tensor:
    return torch.cat([s.to_flat() for s in stats]) if stats else torch.zeros(0, dtype=torch.float64)


def unflatten_stats(flat: torch.Tensor, request: PlanRequest, like: Sequence[WindowStats]) -> List[WindowStats]:
    out, offset = [], 0
    for s, placement, dim in zip(like, request.placements, request.dims):
        size = s.to_flat().numel()
        out.append(WindowStats.from_flat(flat[offset : offset + size], placement.num_experts, dim))
        offset += size
    return out


class CollectiveCoordinator:
    name = "collective"

    def __init__(self, groups: ParallelGroups):
        self.groups = groups

    def submit(self, request: PlanRequest, local_stats: List[WindowStats]) -> Plan:
        self.check_request(request)
        flat = self.reduce_stats(local_stats)
        return self.share(self.plan_on_rank0(request, flat, local_stats), request)

    # The phases of submit, in order (a benchmark times them one by one).
    def check_request(self, request: PlanRequest) -> None:
        """Raises on every rank, naming the ranks, unless all ranks asked for the same plan."""
        digests = all_gather_object(request.digest(), self.groups, "plan request digests")
        if len(set(digests)) > 1:
            by_rank = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
            raise PlanMismatch(
                f"rank {self.groups.rank}: the ranks asked for different plans for version "
                f"{request.version} (request digests {by_rank}): their expert state diverged"
            )

    def reduce_stats(self, local_stats: List[WindowStats]) -> torch.Tensor:
        return sum_over_ranks(flatten_stats(local_stats), self.groups, "window statistics all_reduce")

    def plan_on_rank0(self, request: PlanRequest, flat: torch.Tensor, local_stats: List[WindowStats]) -> List:
        if self.groups.rank != 0:
            return [None, None]
        plan_ = request.make_plan(unflatten_stats(flat, request, local_stats), self.name)
        return [plan_, plan_.digest()]

    def share(self, payload: List, request: PlanRequest) -> Plan:
        plan_, digest = broadcast_object(payload, self.groups, "plan broadcast")
        return verify_plan(plan_, digest, request, self.groups.rank)

"""The Ray coordinator: one named actor per job merges window statistics and hands out versioned Plans.

Protocol (one round per adaptive event, version v = the plan the workers ask for):
  worker r:  plan, digest = actor.submit(v, r, request, [per-layer float64 arrays])   # blocks until planned
  actor:     keeps stats[v][r] (a re-send overwrites), and once all world_size ranks are in, sums them in
             rank order, calls the one pure planner (``PlanRequest.make_plan``) and caches the plan by v.
A submission for a version already planned (a late or repeated one, e.g. after a worker-group restart
resumed from an older checkpoint) gets the cached plan. When the actor dies, Ray restarts it
(``max_restarts``) with empty state; every worker whose call failed simply re-sends what it submitted
for v, so the restarted actor rebuilds the window from the workers and no window is lost. The plan is a
pure function of the summed statistics, so it comes out the same.

Only small plain data crosses Ray (numpy arrays of statistics, the frozen request and Plan): never a
tensor of the training hot path.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from dynmoe_dist.cluster import import_ray

from dynmoe_dist.coordination import PlanMismatch, PlanRequest, verify_plan
from dynmoe_dist.planning.planner import Plan
from dynmoe_dist.planning.stats import WindowStats

NAMESPACE = "dynmoe"
PLANNED_BY = "ray"
RETRY_PAUSE_S = 0.5


def actor_name(run_name: str) -> str:
    return f"dynmoe-coordinator-{run_name}"


def merge_rank_stats(by_rank: Dict[int, List[np.ndarray]], world_size: int) -> List[np.ndarray]:
    """Per-layer sums over ranks, always added in rank order so the result never depends on arrival order."""
    missing = [r for r in range(world_size) if r not in by_rank]
    assert not missing, f"merging before ranks {missing} submitted"
    total = [layer.copy() for layer in by_rank[0]]
    for rank in range(1, world_size):
        for layer, part in zip(total, by_rank[rank]):
            layer += part
    return total


def stats_from_arrays(arrays: Sequence[np.ndarray], request: PlanRequest) -> List[WindowStats]:
    return [
        WindowStats.from_flat(torch.from_numpy(flat), placement.num_experts, dim)
        for flat, placement, dim in zip(arrays, request.placements, request.dims)
    ]


class PlanServer:
    """The actor's logic, free of Ray so it can be tested directly (async: submit waits for all ranks)."""

    def __init__(self, world_size: int, fault_exit_version: int = 0):
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be >= 1")
        self.world_size = world_size
        self.fault_exit_version = fault_exit_version
        self.pending: Dict[int, Dict[int, List[np.ndarray]]] = {}
        self.requests: Dict[int, PlanRequest] = {}
        self.plans: Dict[int, Tuple[Plan, str]] = {}
        self.ready: Dict[int, asyncio.Event] = {}

    async def submit(self, version: int, rank: int, request: PlanRequest, stats: List[np.ndarray]) -> Tuple[Plan, str]:
        self._check_submission(version, rank, request, stats)
        if version not in self.plans:
            self.pending.setdefault(version, {})[rank] = [np.asarray(s, dtype=np.float64) for s in stats]
            self._maybe_fault(version)
            if len(self.pending[version]) == self.world_size:
                self._plan(version)
            await self._event(version).wait()
        return self.plans[version]

    def _check_submission(self, version: int, rank: int, request: PlanRequest, stats) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) outside the job's world of {self.world_size}")
        if request.version != version or len(stats) != len(request.placements):
            raise ValueError(
                f"rank {rank}: submission for version {version} carries request version "
                f"{request.version} and {len(stats)} layers of statistics "
                f"(request has {len(request.placements)})"
            )
        known = self.requests.setdefault(version, request)
        if known != request:  # same version, other inputs: two runs share this actor, or ranks diverged
            raise PlanMismatch(
                f"rank {rank}: request for plan version {version} differs from the one "
                f"already received for it (step {request.step} vs {known.step})"
            )

    def _plan(self, version: int) -> None:
        request = self.requests[version]
        total = merge_rank_stats(self.pending.pop(version), self.world_size)
        plan = request.make_plan(stats_from_arrays(total, request), PLANNED_BY)
        self.plans[version] = (plan, plan.digest())
        self._event(version).set()

    def _event(self, version: int) -> asyncio.Event:
        return self.ready.setdefault(version, asyncio.Event())

    def _maybe_fault(self, version: int) -> None:
        """Fault injection (fault.coordinator_crash_version): die holding a partial window, like a lost node."""
        if self.fault_exit_version and version == self.fault_exit_version:
            print(f"coordinator: injected crash with version {version} half received", file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> Dict:
        return {
            "world_size": self.world_size,
            "planned_versions": sorted(self.plans),
            "pending_versions": {v: sorted(ranks) for v, ranks in self.pending.items()},
        }


class PlanActor(PlanServer):
    """The Ray actor around PlanServer. A restarted actor starts empty and must not inject the same fault
    again (the fault fires in the first life only)."""

    def __init__(self, world_size: int, fault_exit_version: int):
        ray = import_ray()
        with warnings.catch_warnings():  # Ray deprecates an attribute this query uses internally
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__(world_size, 0 if restarted else fault_exit_version)


def start_plan_actor(run_name: str, world_size: int, max_restarts: int, fault_exit_version: int = 0):
    """Create (or get, when it exists) the job's named plan actor; returns its handle."""
    ray = import_ray()
    # num_cpus=0: the actor is idle between windows and must not take a training worker's CPU slot.
    # max_task_retries=0: a failed call comes back to the worker, which re-sends explicitly.
    remote = ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=0)(PlanActor)
    return remote.options(
        name=actor_name(run_name), namespace=NAMESPACE, get_if_exists=True, max_concurrency=max(64, 4 * world_size)
    ).remote(world_size, fault_exit_version)


class CoordinatorTimeout(RuntimeError):
    pass


class RayCoordinator:
    """Worker side: push this rank's statistics to the actor, get the plan; re-send if the actor failed."""

    name = PLANNED_BY

    def __init__(self, groups, run_name: str, timeout_s: float):
        self.ray = import_ray()
        self.groups = groups
        self.timeout_s = timeout_s
        self.actor = self.ray.get_actor(actor_name(run_name), namespace=NAMESPACE)
        self.num_resends = 0

    def submit(self, request: PlanRequest, local_stats: List[WindowStats]) -> Plan:
        arrays = [s.to_flat().numpy() for s in local_stats]
        deadline = time.monotonic() + self.timeout_s
        while True:
            call = self.actor.submit.remote(request.version, self.groups.rank, request, arrays)
            try:
                plan, digest = self.ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
                return verify_plan(plan, digest, request, self.groups.rank)
            except self.ray.exceptions.GetTimeoutError as err:
                raise CoordinatorTimeout(
                    f"rank {self.groups.rank}: no plan version {request.version} from the coordinator actor "
                    f"within parallel.timeout_s ({self.timeout_s:g}s); a peer rank may be dead"
                ) from err
            except self.ray.exceptions.RayActorError as err:
                self._before_resend(request.version, err, deadline)

    def _before_resend(self, version: int, err: Exception, deadline: float) -> None:
        """The actor died or is restarting and may have lost what we sent: wait a little, send it again."""
        if time.monotonic() >= deadline:
            raise CoordinatorTimeout(
                f"rank {self.groups.rank}: coordinator actor still unavailable after "
                f"parallel.timeout_s ({self.timeout_s:g}s): {err}"
            ) from err
        self.num_resends += 1
        print(
            f"rank {self.groups.rank}: coordinator actor unavailable ({type(err).__name__}); "
            f"re-sending statistics for plan version {version}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(RETRY_PAUSE_S)


def coordinator_factory(run_name: str, timeout_s: float):
    """What ``train.run.run(config, coordinator_factory=...)`` calls with the rank's ParallelGroups."""

    def make(groups) -> RayCoordinator:
        return RayCoordinator(groups, run_name, timeout_s)

    return make

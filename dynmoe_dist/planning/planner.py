"""plan(): the one pure, deterministic function that decides every adaptive change.

Given the window statistics summed over *all* ranks, the current placements and the config, it
returns a ``Plan``: per MoE layer, which experts to remove (zero activations in the window), which to
add (tokens found no expert) and how to initialise them, and where every expert and replica lives
next. Every rank applies the same Plan (its digest is checked first), so expert sets never diverge.

Expert ids are positions: after an event the kept experts are renumbered 0..n-1 in their old order
and added experts follow. ``LayerPlan.kept[new_id]`` is the old id of a kept expert.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

from ..moe.config import MoEConfig
from .packing import pack_experts, place_unmoved, rank_loads
from .placement import Placement
from .stats import WindowStats


class PlanningOptions(Protocol):
    """The options of the run's [adaptive] section the planner reads (``config.AdaptiveConfig``)."""

    max_adds_per_event: int
    expert_init: str
    rebalance: bool
    replicate_factor: float
    max_replicas: int
    min_unrouted_share: float
    min_rebalance_gain: float


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner reads for one layer: the run config's own objects, not copies of their fields."""

    moe: MoEConfig
    """The layer's config: min_experts, max_experts and the router."""
    adaptive: PlanningOptions
    """The run's [adaptive] section."""

    @property
    def adapt_experts(self) -> bool:
        """Only top-any layers add and remove experts; top-k/top-p layers are only re-placed and replicated."""
        return self.moe.router == "top_any"


@dataclass(frozen=True)
class AddSpec:
    init: str
    """Strategy used (a fallback is spelled 'reuse_discarded->average')."""
    gate: Tuple[float, ...]
    """New gate vector: the normalised sum of the unrouted hidden states; threshold 0."""
    source: str
    """'experts' (linear combination of old experts), 'discarded' (the remembered expert) or 'random'."""
    coeffs: Tuple[Tuple[int, float], ...] = ()
    """(old expert id, coefficient) pairs when source == 'experts'."""
    seed: int = 0
    """Generator seed when source == 'random'."""


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    removed: Tuple[int, ...]
    kept: Tuple[int, ...]
    added: Tuple[AddSpec, ...]
    placement: Placement
    remember_discarded: Optional[int]
    """Old id of the expert to remember for later 'reuse_discarded' adds (the last one removed)."""
    moves: int
    imbalance_before: float
    """Measured: max / mean rank load of the window's counts on the old placement."""
    imbalance_after: float
    """Planned: max / mean rank load of the estimated loads on the new placement."""
    imbalance_unmoved: Optional[float] = None
    """Planned: the same with no expert moved (kept experts where they were, new ones on the least loaded
    ranks): the plan moves experts only if that beats this by adaptive.min_rebalance_gain."""
    dead: Tuple[int, ...] = ()
    """Old ids of the experts no token chose in the window (top-any removes them, down to min_experts)."""

    @property
    def num_experts(self) -> int:
        return len(self.kept) + len(self.added)

    def changes_experts(self) -> bool:
        return bool(self.removed or self.added)


@dataclass(frozen=True)
class Plan:
    version: int
    step: int
    layers: Tuple[LayerPlan, ...]
    planned_by: str = "collective"

    def digest(self) -> str:
        return hashlib.sha256(repr((self.version, self.step, self.layers)).encode()).hexdigest()[:16]


def plan(
    stats: Sequence[WindowStats],
    placements: Sequence[Placement],
    configs: Sequence[PlannerConfig],
    *,
    version: int,
    step: int,
    has_discarded: Sequence[bool],
    load_history: Optional[Sequence[Sequence[float]]] = None,
    planned_by: str = "collective",
) -> Plan:
    if not len(stats) == len(placements) == len(configs) == len(has_discarded):
        raise ValueError(
            f"plan inputs disagree on the number of layers: stats {len(stats)}, placements "
            f"{len(placements)}, configs {len(configs)}, has_discarded {len(has_discarded)}"
        )
    layers = []
    for i, (s, p, c, d) in enumerate(zip(stats, placements, configs, has_discarded)):
        history = None if load_history is None else load_history[i]
        layers.append(plan_layer(i, s, p, c, d, history, seed=version * 1000 + i))
    return Plan(version, step, tuple(layers), planned_by)


def plan_layer(
    index: int,
    stats: WindowStats,
    placement: Placement,
    cfg: PlannerConfig,
    has_discarded: bool,
    history: Optional[Sequence[float]] = None,
    seed: int = 0,
) -> LayerPlan:
    counts = [float(c) for c in stats.counts_E]  # NOTE: device-to-host sync (planning time, once per event)
    if len(counts) != placement.num_experts:
        raise ValueError(f"layer {index}: statistics for {len(counts)} experts, placement has {placement.num_experts}")
    removed = choose_removals(counts, cfg) if cfg.adapt_experts else []
    kept = [e for e in range(len(counts)) if e not in set(removed)]
    added = choose_additions(stats, counts, kept, removed, cfg, has_discarded, seed) if cfg.adapt_experts else []
    loads = estimated_loads(counts, kept, added, stats, history)
    homes = [placement.holders(old) for old in kept] + [[] for _ in added]
    policy = cfg.adaptive
    new_placement, moves = pack_experts(
        loads,
        homes,
        placement.ep_size,
        rebalance=policy.rebalance,
        replicate_factor=policy.replicate_factor,
        max_replicas=policy.max_replicas,
    )
    after = imbalance(rank_loads(new_placement, loads))
    unmoved = place_unmoved(loads, homes, placement.ep_size)
    unmoved_imbalance = imbalance(rank_loads(unmoved, loads))
    if not worth_it(unmoved_imbalance, after, moves, policy.min_rebalance_gain):
        new_placement, moves, after = unmoved, 0, unmoved_imbalance
    return LayerPlan(
        index,
        tuple(removed),
        tuple(kept),
        tuple(added),
        new_placement,
        max(removed) if removed else None,
        moves,
        imbalance(rank_loads(placement, counts)),
        after,
        unmoved_imbalance,
        tuple(e for e, c in enumerate(counts) if c == 0),
    )


def worth_it(unmoved: float, planned: float, moves: int, min_gain: float) -> bool:
    """Whether the packed placement (planned imbalance, moves) beats leaving every expert where it is.

    Every move sends an expert's weights and Adam state over the all-to-all: a placement that moves
    experts must lower the planned imbalance (max / mean rank load) by at least min_gain of the unmoved
    one's (0.02: 1.10 -> 1.078 or lower), and by something at all when min_gain is 0. One that moves
    nothing (it may drop replicas, which costs no transfer) must not be planned worse than standing still."""
    gain = (unmoved - planned) / unmoved
    if moves == 0:
        return gain >= -1e-9
    return gain > 1e-9 and gain >= min_gain - 1e-12


def choose_removals(counts: List[float], cfg: PlannerConfig) -> List[int]:
    """Every expert with zero activations, lowest ids first, never going below min_experts."""
    unused = [e for e, c in enumerate(counts) if c == 0]
    return unused[: max(0, len(counts) - cfg.moe.min_experts)]


def choose_additions(
    stats: WindowStats,
    counts: List[float],
    kept: List[int],
    removed: List[int],
    cfg: PlannerConfig,
    has_discarded: bool,
    seed: int,
) -> List[AddSpec]:
    assert cfg.moe.max_experts is not None, "MoEConfig fills max_experts in __post_init__"
    room = cfg.moe.max_experts - len(kept)
    num_adds = min(cfg.adaptive.max_adds_per_event, room) if wants_new_expert(stats, cfg.adaptive) else 0
    gates = new_gates(stats, num_adds)
    return [
        _add_spec(cfg.adaptive.expert_init, counts, kept, removed, has_discarded, gate, seed * 16 + i)
        for i, gate in enumerate(gates)
    ]


def wants_new_expert(stats: WindowStats, adaptive: PlanningOptions) -> bool:
    """The reference adds an expert when any token of the window selected none; with min_unrouted_share
    > 0, only when the share of such tokens exceeds it (a few stray k = 0 tokens then grow nothing)."""
    if stats.num_unrouted <= 0:
        return False
    return stats.num_unrouted / max(stats.num_tokens, 1.0) > adaptive.min_unrouted_share


def _add_spec(
    strategy: str,
    counts: List[float],
    kept: List[int],
    removed: List[int],
    has_discarded: bool,
    gate: Tuple[float, ...],
    seed: int,
) -> AddSpec:
    name, source, coeffs = init_strategy(strategy, counts, kept, removed, has_discarded)
    return AddSpec(name, gate, source, coeffs, seed)


def new_gates(stats: WindowStats, num_adds: int) -> List[Tuple[float, ...]]:
    """One add: the normalised sum of all unrouted states (the reference). Several: one per nearest-expert
    neighbourhood, the most crowded first, so the new experts point in different directions."""
    if num_adds <= 0:
        return []
    if num_adds == 1:
        sums = [stats.unrouted_sum_D]
    else:
        # NOTE: device-to-host sync (planning time): per-expert reads of the unrouted counts
        order = sorted(range(len(stats.num_unrouted_E)), key=lambda e: (-float(stats.num_unrouted_E[e]), e))
        sums = [stats.unrouted_sum_ED[e] for e in order if stats.num_unrouted_E[e] > 0][:num_adds]
    return [tuple((s / s.norm().clamp(min=1e-12)).tolist()) for s in sums]  # NOTE: device-to-host sync (planning time)


def init_strategy(
    strategy: str, counts: List[float], kept: List[int], removed: List[int], has_discarded: bool
) -> Tuple[str, str, Tuple[Tuple[int, float], ...]]:
    """(name as logged, source, coefficients over old expert ids) for the FFN weights of a new expert."""
    if strategy == "reuse_discarded":
        if removed:
            return strategy, "experts", ((max(removed), 1.0),)
        if has_discarded:
            return strategy, "discarded", ()
        name, source, coeffs = init_strategy("average", counts, kept, removed, has_discarded)
        return f"{strategy}->{name}", source, coeffs
    if strategy == "random" or not kept:
        return "random", "random", ()
    if strategy == "average":
        return strategy, "experts", tuple((e, 1.0 / len(kept)) for e in kept)
    if strategy == "weighted_average":
        total = sum(counts[e] for e in kept)
        if total == 0:
            return init_strategy("average", counts, kept, removed, has_discarded)
        return strategy, "experts", tuple((e, counts[e] / total) for e in kept if counts[e] > 0)
    if strategy == "most_activated":
        best = min(kept, key=lambda e: (-counts[e], e))
        return strategy, "experts", ((best, 1.0),)
    raise ValueError(f"adaptive.expert_init ({strategy!r}) is not a known strategy")


def estimated_loads(
    counts: List[float],
    kept: List[int],
    added: Sequence[AddSpec],
    stats: WindowStats,
    history: Optional[Sequence[float]] = None,
) -> List[float]:
    """Rows each expert of the new set will take: its window count (averaged with the history when given).
    A new expert takes the unrouted tokens (shared among the new experts) and, its threshold starting
    at 0, about as many as the busiest kept expert: measured (bench adapt), a new expert attracts far
    more than the unrouted tokens, and estimating it at the mean load left ranks 1.5x imbalanced."""
    loads = [counts[e] for e in kept]
    if history is not None:
        # NOTE: device-to-host sync (planning time, if the history lives on a device)
        loads = [0.5 * (c + float(history[e])) for c, e in zip(loads, kept)]
    if not added:
        return loads
    share = max([stats.num_unrouted / len(added)] + loads)
    return loads + [share] * len(added)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0 is perfect balance)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0

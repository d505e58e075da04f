# The packer as it was before the scale optimisation (commit 7a54cfc), kept verbatim as the oracle of
# tests/unit/test_packing_equivalence.py: the optimised packer must return the same placements.
"""Placing experts (and replicas of hot experts) on ep ranks: minimise the largest per-rank load, then
move as few experts as possible for that maximum. Pure and deterministic (ties broken by ids).

An *item* is one replica share of an expert: an expert with n replicas is n items of load L/n, and
no rank may hold two items of the same expert.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from dynmoe_dist.planning.placement import Placement

Item = Tuple[int, int, float]  # (expert, share index, load)
EPS = 1e-9


def replica_counts(loads: Sequence[float], ep_size: int, factor: float, max_replicas: int) -> List[int]:
    """An expert whose load exceeds `factor` x the mean per-rank load is split into enough replicas to
    bring each share down to about the mean (capped by max_replicas and the ep size)."""
    mean = sum(loads) / ep_size
    cap = ep_size if max_replicas == 0 else min(max_replicas, ep_size)
    counts = []
    for load in loads:
        hot = mean > 0 and load > factor * mean
        counts.append(min(cap, math.ceil(load / mean - EPS)) if hot else 1)
    return counts


def make_items(loads: Sequence[float], replicas: Sequence[int]) -> List[Item]:
    return [(e, i, loads[e] / n) for e, n in enumerate(replicas) for i in range(n)]


class Bins:
    """Per-rank load, item count and held experts while packing."""

    def __init__(self, ep_size: int):
        self.load = [0.0] * ep_size
        self.count = [0] * ep_size
        self.experts = [set() for _ in range(ep_size)]

    def allowed(self, expert: int) -> List[int]:
        return [r for r in range(len(self.load)) if expert not in self.experts[r]]

    def least_loaded(self, expert: int) -> int:
        return min(self.allowed(expert), key=lambda r: (self.load[r], self.count[r], r))

    def put(self, rank: int, item: Item) -> None:
        self.load[rank] += item[2]
        self.count[rank] += 1
        self.experts[rank].add(item[0])


def _by_load(items: List[Item]) -> List[Item]:
    return sorted(items, key=lambda it: (-it[2], it[0], it[1]))


def _preferred(item: Item, homes: Sequence[Sequence[int]]) -> Optional[int]:
    expert, share, _ = item
    return homes[expert][share] if share < len(homes[expert]) else None


def place_sticky(items: List[Item], homes, ep_size: int, cap: Optional[float]) -> List[Tuple[Item, int]]:
    """Largest first; an item stays on its current rank unless that would exceed `cap` (None: always)."""
    bins, out = Bins(ep_size), []
    for item in _by_load(items):
        pref = _preferred(item, homes)
        fits = (
            pref is not None
            and item[0] not in bins.experts[pref]
            and (cap is None or bins.load[pref] + item[2] <= cap + EPS)
        )
        rank = pref if fits else bins.least_loaded(item[0])
        bins.put(rank, item)
        out.append((item, rank))
    return out


def place_lpt(items: List[Item], homes, ep_size: int) -> List[Tuple[Item, int]]:
    """Greedy largest-load-first onto the least loaded rank, then rename the ranks (bins are
    interchangeable) to keep as many items where they already are."""
    bins, out = Bins(ep_size), []
    for item in _by_load(items):
        rank = bins.least_loaded(item[0])
        bins.put(rank, item)
        out.append((item, rank))
    rename = _best_renaming(out, homes, ep_size)
    return [(item, rename[b]) for item, b in out]


def _best_renaming(assigned, homes, ep_size: int) -> List[int]:
    overlap = [[0] * ep_size for _ in range(ep_size)]
    for item, b in assigned:
        pref = _preferred(item, homes)
        if pref is not None:
            overlap[b][pref] += 1
    pairs = sorted(
        ((overlap[b][r], b, r) for b in range(ep_size) for r in range(ep_size)), key=lambda t: (-t[0], t[1], t[2])
    )
    rename, used = [None] * ep_size, set()
    for _, b, r in pairs:
        if rename[b] is None and r not in used:
            rename[b] = r
            used.add(r)
    return rename


def count_moves(assigned, homes) -> int:
    """New (expert, rank) holdings of experts that already existed somewhere."""
    return sum(1 for (expert, _, _), rank in assigned if homes[expert] and rank not in homes[expert])


def max_load(assigned, ep_size: int) -> float:
    load = [0.0] * ep_size
    for item, rank in assigned:
        load[rank] += item[2]
    return max(load)


def replica_options(loads: Sequence[float], ep_size: int, factor: float, max_replicas: int) -> List[List[int]]:
    """The base replica counts, then the hot experts with 1, 2, ... more replicas (up to the cap):
    ceil(load / mean) shares do not always pack evenly (four halves on three ranks), more may."""
    base = replica_counts(loads, ep_size, factor, max_replicas)
    cap = ep_size if max_replicas == 0 else min(max_replicas, ep_size)
    options = [base]
    for extra in range(1, cap):
        option = [min(cap, n + extra) if n > 1 else n for n in base]
        if option != options[-1]:
            options.append(option)
    return options


def _assignments(items: List[Item], homes, ep_size: int, rebalance: bool):
    if not rebalance:
        return [place_sticky(items, homes, ep_size, cap=None)]
    lpt = place_lpt(items, homes, ep_size)
    return [
        place_sticky(items, homes, ep_size, cap=None),
        place_sticky(items, homes, ep_size, cap=max_load(lpt, ep_size)),
        lpt,
    ]


def pack_experts(
    loads: Sequence[float],
    homes: Sequence[Sequence[int]],
    ep_size: int,
    *,
    rebalance: bool = True,
    replicate_factor: float = 1.5,
    max_replicas: int = 0,
) -> Tuple[Placement, int]:
    """New placement for experts with these loads; homes[e] = ranks holding e now ([] for new experts).

    Among the candidates, the lowest maximum rank load wins, then the fewest replicas, then the fewest
    moves (without rebalance, experts stay where they are and only new items are placed)."""
    best, best_key = None, None
    for replicas in replica_options(loads, ep_size, replicate_factor, max_replicas):
        for assigned in _assignments(make_items(loads, replicas), homes, ep_size, rebalance):
            key = (round(max_load(assigned, ep_size), 6), sum(replicas), count_moves(assigned, homes))
            if best_key is None or key < best_key:
                best, best_key = assigned, key
    per_rank: List[List[int]] = [[] for _ in range(ep_size)]
    for (expert, _, _), rank in best:
        per_rank[rank].append(expert)
    placement = Placement.from_rank_lists(ep_size, len(loads), [sorted(r) for r in per_rank])
    return placement, count_moves(best, homes)


def rank_loads(placement: Placement, loads: Sequence[float]) -> List[float]:
    """Rows per rank when each expert's rows are shared evenly among its replicas."""
    per_rank = [0.0] * placement.ep_size
    for expert, slots in enumerate(placement.replicas):
        for rank, _ in slots:
            per_rank[rank] += loads[expert] / len(slots)
    return per_rank

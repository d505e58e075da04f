"""Placing experts (and replicas of hot experts) on ep ranks: minimise the largest per-rank load, then
move as few experts as possible for that maximum. Pure and deterministic (ties broken by ids).

An *item* is one replica share of an expert: an expert with n replicas is n items of load L/n, and
no rank may hold two items of the same expert.

Scale (bench scale: 256 ranks, 256 experts, a shared expert with half the rows): the least loaded
rank comes from a heap instead of a scan, candidates whose lower bound on the maximum load cannot
beat the best so far are not packed, and the rank renaming only sorts rank pairs that share items.
Results are identical to the plain version (tests/unit/test_packing_equivalence.py holds it as oracle).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from .placement import Placement

Item = Tuple[int, int, float]  # (expert, share index, load)
Assigned = List[Tuple[Item, int]]  # (item, rank) of a packing
Homes = Sequence[Sequence[int]]  # homes[e]: ranks holding expert e now
Key = Tuple[float, int, int]  # (rounded max load, replicas, moves): lower wins
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
    """Per-rank load, item count and held experts while packing.

    ``least_loaded`` is the minimum of (load, count, rank) over the ranks that do not hold the expert,
    read from a heap with lazy deletion: every put pushes the rank's new key, and a popped key that
    no longer matches its rank's (load, count) is stale (counts only grow, so keys never repeat)."""

    def __init__(self, ep_size: int):
        self.load = [0.0] * ep_size
        self.count = [0] * ep_size
        self.experts: List[Set[int]] = [set() for _ in range(ep_size)]
        self._heap = [(0.0, 0, r) for r in range(ep_size)]  # sorted, hence a heap

    def allowed(self, expert: int) -> List[int]:
        return [r for r in range(len(self.load)) if expert not in self.experts[r]]

    def least_loaded(self, expert: int) -> int:
        heap, held, found = self._heap, [], None
        while heap:
            load, count, rank = heap[0]
            if load != self.load[rank] or count != self.count[rank]:
                heapq.heappop(heap)
            elif expert in self.experts[rank]:
                held.append(heapq.heappop(heap))
            else:
                found = rank
                break
        for key in held:  # still valid for other experts
            heapq.heappush(heap, key)
        if found is None:
            raise ValueError(f"every rank already holds expert {expert}")
        return found

    def put(self, rank: int, item: Item) -> None:
        self.load[rank] += item[2]
        self.count[rank] += 1
        self.experts[rank].add(item[0])
        heapq.heappush(self._heap, (self.load[rank], self.count[rank], rank))


def _by_load(items: List[Item]) -> List[Item]:
    return sorted(items, key=lambda it: (-it[2], it[0], it[1]))


def _preferred(item: Item, homes: Sequence[Sequence[int]]) -> Optional[int]:
    expert, share, _ = item
    return homes[expert][share] if share < len(homes[expert]) else None


def place_sticky(
    items: List[Item],
    homes: Homes,
    ep_size: int,
    cap: Optional[float],
    ordered: Optional[List[Item]] = None,
    give_up_above: Optional[float] = None,
) -> Optional[Assigned]:
    """Largest first; an item stays on its current rank unless that would exceed `cap` (None: always).
    ``ordered``: the items already sorted by _by_load (saves the sort when several packings share it).
    ``give_up_above``: return None once a rank's rounded load exceeds it (loads only grow, so such a
    packing's maximum would too: the caller has a better candidate already)."""
    bins, out = Bins(ep_size), []
    for item in ordered if ordered is not None else _by_load(items):
        pref = _preferred(item, homes)
        fits = (
            pref is not None
            and item[0] not in bins.experts[pref]
            and (cap is None or bins.load[pref] + item[2] <= cap + EPS)
        )
        rank = pref if fits and pref is not None else bins.least_loaded(item[0])
        bins.put(rank, item)
        out.append((item, rank))
        if give_up_above is not None and bins.load[rank] > give_up_above and round(bins.load[rank], 6) > give_up_above:
            return None
    return out


def place_lpt(items: List[Item], homes: Homes, ep_size: int, ordered: Optional[List[Item]] = None) -> Assigned:
    """Greedy largest-load-first onto the least loaded rank, then rename the ranks (bins are
    interchangeable) to keep as many items where they already are."""
    bins, out = Bins(ep_size), []
    for item in ordered if ordered is not None else _by_load(items):
        rank: int = bins.least_loaded(item[0])
        bins.put(rank, item)
        out.append((item, rank))
    rename = _best_renaming(out, homes, ep_size)
    return [(item, rename[b]) for item, b in out]


def _best_renaming(assigned: Assigned, homes: Homes, ep_size: int) -> List[int]:
    """Greedy over (bin, rank) pairs by overlap, descending, ties by (bin, rank). Only pairs that share
    items are sorted: the zero-overlap pairs come last in (bin, rank) order, which gives every bin
    still unnamed, in bin order, the lowest rank still free."""
    overlap: Dict[Tuple[int, int], int] = {}
    for item, b in assigned:
        pref = _preferred(item, homes)
        if pref is not None:
            overlap[b, pref] = overlap.get((b, pref), 0) + 1
    rename: List[Optional[int]] = [None] * ep_size
    used: Set[int] = set()
    for (b, r), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1])):
        if rename[b] is None and r not in used:
            rename[b] = r
            used.add(r)
    free = iter(r for r in range(ep_size) if r not in used)
    return [r if r is not None else next(free) for r in rename]


def count_moves(assigned: Assigned, homes: Homes, home_sets: Optional[List[Set[int]]] = None) -> int:
    """New (expert, rank) holdings of experts that already existed somewhere."""
    sets = home_sets if home_sets is not None else [set(h) for h in homes]
    return sum(1 for (expert, _, _), rank in assigned if sets[expert] and rank not in sets[expert])


def max_load(assigned: Assigned, ep_size: int) -> float:
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


def _assignments(
    items: List[Item], homes: Homes, ep_size: int, rebalance: bool, limit: Callable[[], Optional[float]] = lambda: None
) -> Iterator[Optional[Assigned]]:
    """The candidate packings of one replica option, lazily; ``limit()`` is the best rounded maximum
    load so far, above which a sticky packing is abandoned (yielded as None)."""
    ordered = _by_load(items)
    yield place_sticky(items, homes, ep_size, cap=None, ordered=ordered, give_up_above=limit())
    if not rebalance:
        return
    lpt = place_lpt(items, homes, ep_size, ordered=ordered)
    yield place_sticky(items, homes, ep_size, cap=max_load(lpt, ep_size), ordered=ordered, give_up_above=limit())
    yield lpt


def load_lower_bound(loads: Sequence[float], replicas: Sequence[int], ep_size: int) -> float:
    """No packing of these items has a smaller maximum rank load (as max_load sums it, in floats):
    the largest share (exact: a rank's float sum never falls below any of its terms), the sum of the
    ep-th and (ep+1)-th largest shares, which some rank holds together (pigeonhole; exact for the same
    reason), and the mean, shrunk by a relative 1e-9 because it is summed in another order."""
    by_share = sorted(((loads[e] / n, n) for e, n in enumerate(replicas)), reverse=True)
    bound = max(sum(loads) / ep_size * (1 - 1e-9), by_share[0][0] if by_share else 0.0)
    # The ep-th and (ep+1)-th largest item shares, walking the experts' share runs (n items each).
    wanted, found, seen = (ep_size - 1, ep_size), [], 0
    for share, n in by_share:
        found += [share for index in wanted if seen <= index < seen + n]
        seen += n
        if len(found) == 2:
            return max(bound, found[0] + found[1])
    return bound


def _cannot_win(bound: float, num_replicas: int, best_key: Optional[Key]) -> bool:
    """A candidate's key is (round(max load, 6), replicas, moves) >= (round(bound, 6), replicas, 0)."""
    return best_key is not None and (round(bound, 6), num_replicas) > best_key[:2]


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
    best: Optional[Assigned] = None
    best_key: Optional[Key] = None
    home_sets = [set(h) for h in homes]
    for replicas in replica_options(loads, ep_size, replicate_factor, max_replicas):
        if _cannot_win(load_lower_bound(loads, replicas, ep_size), sum(replicas), best_key):
            continue

        def limit() -> Optional[float]:
            # Late binding on purpose: the best key improves while this option's packings are tried.
            return None if best_key is None else best_key[0]  # noqa: B023

        for assigned in _assignments(make_items(loads, replicas), homes, ep_size, rebalance, limit):
            if assigned is None:
                continue
            key = (round(max_load(assigned, ep_size), 6), sum(replicas), count_moves(assigned, homes, home_sets))
            if best_key is None or key < best_key:
                best, best_key = assigned, key
    assert best is not None, "the first candidate is never abandoned"
    return to_placement(best, ep_size, len(loads)), count_moves(best, homes, home_sets)


def to_placement(assigned: Assigned, ep_size: int, num_experts: int) -> Placement:
    per_rank: List[List[int]] = [[] for _ in range(ep_size)]
    for (expert, _, _), rank in assigned:
        per_rank[rank].append(expert)
    return Placement.from_rank_lists(ep_size, num_experts, [sorted(r) for r in per_rank])


def place_unmoved(loads: Sequence[float], homes: Homes, ep_size: int) -> Placement:
    """The placement that moves nothing: every existing expert keeps all its current holders (its
    replicas too), and each new expert (no home yet) goes, largest first, to the least loaded rank.
    The planner compares a re-placement against this one."""
    replicas = [max(1, len(h)) for h in homes]
    assigned = place_sticky(make_items(loads, replicas), homes, ep_size, cap=None)
    assert assigned is not None, "without give_up_above a packing is never abandoned"
    return to_placement(assigned, ep_size, len(loads))


def rank_loads(placement: Placement, loads: Sequence[float]) -> List[float]:
    """Rows per rank when each expert's rows are shared evenly among its replicas."""
    per_rank = [0.0] * placement.ep_size
    for expert, slots in enumerate(placement.replicas):
        for rank, _ in slots:
            per_rank[rank] += loads[expert] / len(slots)
    return per_rank

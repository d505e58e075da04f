"""The optimised packer (heap, candidate pruning, sparse renaming) returns exactly the placements and
move counts of the plain packer it replaced (tests/unit/packing_before.py, kept verbatim)."""

import random

import packing_before
import pytest

from dynmoe_dist.planning import packing
from dynmoe_dist.planning.placement import Placement


def _loads(rng: random.Random, num_experts: int, kind: str):
    if kind == "zipf_shared":  # one shared expert with 30-60% of the rows, the rest Zipf
        share = rng.uniform(0.3, 0.6)
        tail = [1.0 / (i + 1) ** 1.1 for i in range(num_experts - 1)]
        rows = [share] + [(1 - share) * t / sum(tail) for t in tail]
        return [round(r * 10000) for r in rows]
    if kind == "ties":
        return [rng.choice([0, 5, 5, 10]) for _ in range(num_experts)]
    return [rng.uniform(0, 100) for _ in range(num_experts)]


def _homes(rng: random.Random, num_experts: int, ep_size: int, num_new: int):
    old = num_experts - num_new
    placement = Placement.default(old, ep_size)
    if rng.random() < 0.5 and old >= ep_size:  # a scrambled placement with a few replicas
        per_rank = [[] for _ in range(ep_size)]
        for e in range(old):
            for r in rng.sample(range(ep_size), rng.choice([1, 1, 1, min(2, ep_size)])):
                per_rank[r].append(e)
        if all(per_rank):
            placement = Placement.from_rank_lists(ep_size, old, per_rank)
    return [placement.holders(e) for e in range(old)] + [[] for _ in range(num_new)]


CASES = [(seed, kind) for seed in range(40) for kind in ("zipf_shared", "ties", "uniform")]


@pytest.mark.parametrize("seed,kind", CASES)
def test_same_placement_and_moves_as_the_plain_packer(seed, kind):
    rng = random.Random(seed)
    ep_size = rng.choice([1, 2, 3, 4, 6, 8, 12])
    num_experts = rng.randint(ep_size, 3 * ep_size + 2)
    loads = _loads(rng, num_experts, kind)
    homes = _homes(rng, num_experts, ep_size, num_new=rng.choice([0, 0, 1, 2]) if num_experts > ep_size else 0)
    options = dict(
        rebalance=rng.random() < 0.8,
        replicate_factor=rng.choice([1.2, 1.5, 2.0]),
        max_replicas=rng.choice([0, 0, 2, 3]),
    )
    mine = packing.pack_experts(loads, homes, ep_size, **options)
    theirs = packing_before.pack_experts(loads, homes, ep_size, **options)
    assert mine == theirs


def test_bins_least_loaded_matches_a_scan():
    rng = random.Random(7)
    bins = packing.Bins(5)
    for step in range(200):
        expert = rng.randrange(6)
        if len(bins.allowed(expert)) == 0:
            continue
        scan = min(bins.allowed(expert), key=lambda r: (bins.load[r], bins.count[r], r))
        assert bins.least_loaded(expert) == scan
        bins.put(scan, (expert, step, rng.choice([0.0, 1.0, 2.5])))


def test_lower_bound_never_exceeds_a_packing():
    rng = random.Random(3)
    for _ in range(50):
        ep_size = rng.choice([2, 3, 5, 8])
        loads = [rng.uniform(0, 10) for _ in range(rng.randint(ep_size, 3 * ep_size))]
        replicas = packing.replica_counts(loads, ep_size, 1.5, 0)
        items = packing.make_items(loads, replicas)
        homes = [[] for _ in loads]
        for assigned in packing._assignments(items, homes, ep_size, True):
            assert packing.load_lower_bound(loads, replicas, ep_size) <= packing.max_load(assigned, ep_size)


@pytest.mark.parametrize("seed", range(6))
def test_same_result_at_larger_sizes_with_a_shared_expert(seed):
    rng = random.Random(100 + seed)
    ep_size = rng.choice([16, 24, 32])
    num_experts = rng.choice([ep_size, 2 * ep_size])
    loads = _loads(rng, num_experts, "zipf_shared")
    homes = _homes(rng, num_experts, ep_size, num_new=1)
    assert packing.pack_experts(loads, homes, ep_size) == packing_before.pack_experts(loads, homes, ep_size)

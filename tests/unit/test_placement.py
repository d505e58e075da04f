"""Placement (planning/placement.py): construction, validation and the slot queries, on hand-worked cases."""

import dataclasses

import pytest

from dynmoe_dist.planning.placement import Placement


def test_balanced_gives_the_first_ranks_the_extra_expert():
    # 5 experts on 2 ranks: 3 + 2, contiguous blocks.
    p = Placement.balanced(5, 2)
    assert p.replicas == (((0, 0),), ((0, 1),), ((0, 2),), ((1, 0),), ((1, 1),))
    assert p.experts_on(0) == [0, 1, 2] and p.experts_on(1) == [3, 4]
    with pytest.raises(ValueError, match=r"num_experts \(1\) < ep_size \(2\)"):
        Placement.balanced(1, 2)
    with pytest.raises(ValueError, match=r"ep_size \(0\) must be >= 1"):
        Placement.balanced(3, 0)


def test_default_with_fewer_experts_than_ranks_leaves_the_last_ranks_empty():
    p = Placement.default(2, 4)  # e0 -> rank 0, e1 -> rank 1, ranks 2 and 3 hold nothing
    assert p.ep_size == 4 and p.replicas == (((0, 0),), ((1, 0),))
    assert p.slots_per_rank() == (1, 1, 0, 0) and p.experts_on(3) == []
    assert Placement.default(5, 2) == Placement.balanced(5, 2)
    assert Placement.default(2, 2) == Placement.balanced(2, 2)


def test_from_rank_lists_and_the_slot_queries():
    # 3 ranks: rank 0 holds [2], rank 1 holds [0, 3, 1], rank 2 holds [0, 4] (expert 0 replicated).
    p = Placement.from_rank_lists(3, 5, [[2], [0, 3, 1], [0, 4]])
    assert p.replicas == (((1, 0), (2, 0)), ((1, 2),), ((0, 0),), ((1, 1),), ((2, 1),))
    assert p.num_experts == 5
    assert p.slots_per_rank() == (1, 3, 2)
    assert p.slot_offsets() == (0, 1, 4)  # rank-major global slots: rank 1 starts at 1, rank 2 at 4
    assert p.num_slots == 6
    assert [p.experts_on(r) for r in range(3)] == [[2], [0, 3, 1], [0, 4]]
    assert p.num_replicas(0) == 2 and p.num_replicas(1) == 1
    assert p.replicated_experts() == [0]
    assert p.holders(0) == [1, 2] and p.holders(2) == [0]
    with pytest.raises(ValueError, match=r"expert id \(5\) outside \[0, 5\)"):
        Placement.from_rank_lists(3, 5, [[5], [0, 3, 1], [2, 4]])


def test_no_replicated_experts():
    assert Placement.balanced(4, 2).replicated_experts() == []


def test_to_lists_and_from_lists_round_trip():
    p = Placement.from_rank_lists(2, 3, [[0, 2], [0, 1]])
    data = p.to_lists()
    assert data == {"ep_size": 2, "replicas": [[[0, 0], [1, 0]], [[1, 1]], [[0, 1]]]}
    back = Placement.from_lists(data)
    assert back == p and back.replicas == p.replicas and back.ep_size == 2
    assert Placement.from_lists({"ep_size": "2", "replicas": data["replicas"]}) == p  # ints, not strings


@pytest.mark.parametrize(
    "ep_size, replicas, message",
    [
        (0, (), r"ep_size \(0\) must be >= 1"),
        (2, (((0, 0),), ()), r"expert 1 has no replica"),
        (2, (((0, 0), (0, 1)),), r"expert 0 has two replicas on one rank"),
        (2, (((0, 0),), ((2, 0),)), r"expert 1 placed on rank 2 outside \[0, 2\)"),
        (2, (((0, 0),), ((-1, 0),)), r"expert 1 placed on rank -1 outside \[0, 2\)"),
        (2, (((0, 0),), ((0, 0),)), r"rank 0 slot 0 holds two experts"),
        (2, (((0, 0),), ((0, 2),)), r"rank 0 slots \[0, 2\] are not 0\.\.1"),
        (2, (((1, 1),),), r"rank 1 slots \[1\] are not 0\.\.0"),
    ],
)
def test_invalid_placements_are_refused(ep_size, replicas, message):
    with pytest.raises(ValueError, match=message):
        Placement(ep_size, replicas)


def test_placement_is_an_immutable_hashable_value_with_a_short_digest():
    a = Placement.balanced(4, 2)
    b = Placement(2, [[[0, 0]], [[0, 1]], [[1, 0]], [[1, 1]]])  # lists are frozen into tuples
    assert a == b and hash(a) == hash(b) and b.replicas == (((0, 0),), ((0, 1),), ((1, 0),), ((1, 1),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ep_size = 3
    assert a.digest() == b.digest() and len(a.digest()) == 16 and int(a.digest(), 16) >= 0
    assert a.digest() != Placement.balanced(4, 1).digest()
    assert a.digest() != Placement.from_rank_lists(2, 4, [[0, 2], [1, 3]]).digest()

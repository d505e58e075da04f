"""Placement: where every logical expert of one MoE layer lives.

``replicas[e]`` lists the (ep rank, local slot) pairs that hold a copy of logical expert e. Every rank's
slots are numbered 0..n_r-1 without gaps, so a rank's ExpertBank is simply its slots in order. A
Placement is an immutable value: it is compared, hashed and sent between processes as plain tuples.

Global slot numbering (used by the dispatcher): rank-major, ``slot_offset[r] + slot``, so the rows for
one destination rank are contiguous once rows are sorted by global slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

Slot = Tuple[int, int]


@dataclass(frozen=True)
class Placement:
    ep_size: int
    replicas: Tuple[Tuple[Slot, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(tuple(tuple(s) for s in r) for r in self.replicas))
        self.validate()

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def balanced(cls, num_experts: int, ep_size: int) -> "Placement":
        """Contiguous blocks of experts, rank sizes differing by at most one (first ranks larger)."""
        if ep_size < 1:
            raise ValueError(f"ep_size ({ep_size}) must be >= 1")
        if num_experts < ep_size:
            raise ValueError(f"num_experts ({num_experts}) < ep_size ({ep_size})")
        base, extra = divmod(num_experts, ep_size)
        replicas, expert = [], 0
        for rank in range(ep_size):
            for slot in range(base + (rank < extra)):
                replicas.append(((rank, slot),))
                expert += 1
        return cls(ep_size, tuple(replicas))

    @classmethod
    def default(cls, num_experts: int, ep_size: int) -> "Placement":
        """Balanced when there are at least as many experts as ranks; otherwise one expert per rank on
        the first ranks and the rest empty (removals can leave fewer experts than ranks)."""
        if num_experts >= ep_size:
            return cls.balanced(num_experts, ep_size)
        return cls(ep_size, tuple(((e, 0),) for e in range(num_experts)))

    def to_lists(self) -> Dict[str, Any]:
        return {"ep_size": self.ep_size, "replicas": [[list(s) for s in slots] for slots in self.replicas]}

    @classmethod
    def from_lists(cls, data: Mapping[str, Any]) -> "Placement":
        return cls(int(data["ep_size"]), tuple(tuple(tuple(s) for s in slots) for slots in data["replicas"]))

    @classmethod
    def from_rank_lists(cls, ep_size: int, num_experts: int, experts_per_rank: Sequence[Sequence[int]]) -> "Placement":
        """Build from what each rank holds, in slot order: experts_per_rank[r] = [e, ...]."""
        replicas: List[List[Slot]] = [[] for _ in range(num_experts)]
        for rank, experts in enumerate(experts_per_rank):
            for slot, expert in enumerate(experts):
                if not 0 <= expert < num_experts:
                    raise ValueError(f"expert id ({expert}) outside [0, {num_experts})")
                replicas[expert].append((rank, slot))
        return cls(ep_size, tuple(tuple(sorted(r)) for r in replicas))

    # -- checks -----------------------------------------------------------------------------------
    def validate(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size ({self.ep_size}) must be >= 1")
        slots_seen: List[Set[int]] = [set() for _ in range(self.ep_size)]
        for expert, slots in enumerate(self.replicas):
            if not slots:
                raise ValueError(f"expert {expert} has no replica")
            ranks = [rank for rank, _ in slots]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"expert {expert} has two replicas on one rank: {slots}")
            for rank, slot in slots:
                if not 0 <= rank < self.ep_size:
                    raise ValueError(f"expert {expert} placed on rank {rank} outside [0, {self.ep_size})")
                if slot in slots_seen[rank]:
                    raise ValueError(f"rank {rank} slot {slot} holds two experts")
                slots_seen[rank].add(slot)
        for rank, seen in enumerate(slots_seen):
            if seen != set(range(len(seen))):
                raise ValueError(f"rank {rank} slots {sorted(seen)} are not 0..{len(seen) - 1}")

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def slots_per_rank(self) -> Tuple[int, ...]:
        counts = [0] * self.ep_size
        for slots in self.replicas:
            for rank, _ in slots:
                counts[rank] += 1
        return tuple(counts)

    def slot_offsets(self) -> Tuple[int, ...]:
        offsets, total = [], 0
        for count in self.slots_per_rank():
            offsets.append(total)
            total += count
        return tuple(offsets)

    @property
    def num_slots(self) -> int:
        return sum(self.slots_per_rank())

    def experts_on(self, rank: int) -> List[int]:
        """Logical experts held by `rank`, in slot order."""
        held = sorted((slot, expert) for expert, slots in enumerate(self.replicas) for r, slot in slots if r == rank)
        return [expert for _, expert in held]

    def num_replicas(self, expert: int) -> int:
        return len(self.replicas[expert])

    def replicated_experts(self) -> List[int]:
        return [e for e, slots in enumerate(self.replicas) if len(slots) > 1]

    def holders(self, expert: int) -> List[int]:
        return [rank for rank, _ in self.replicas[expert]]

    def owner(self, expert: int) -> int:
        """The ep rank that speaks for an expert wherever one copy must act alone (it contributes the
        expert to combinations, sends it when it moves, writes it to checkpoints): its first holder."""
        return min(self.holders(expert))

    def digest(self) -> str:
        return hashlib.sha256(repr((self.ep_size, self.replicas)).encode()).hexdigest()[:16]

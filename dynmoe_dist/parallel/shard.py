"""The expert-parallel state of each MoE layer on this rank: owned here, and nowhere else.

``parallelize()`` returns one ``LayerShard`` per MoE layer. Gradient sync, migration, checkpoints, the
adaptive controller and telemetry take that record; the plain model (moe/) carries no placement. Its
``ExpertBank`` simply holds this rank's experts in slot order, and its dispatcher holds the slot tables
the shard built. A plan produces a new shard (``LayerShard.moved_to``): records are never edited.

Shape legend: E logical experts, R max replicas of an expert, S global slots (rank-major), W ep size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..moe.layer import MoELayer
from ..planning.placement import Placement


@dataclass(frozen=True)
class SlotTables:
    """Per-placement lookup tensors the dispatcher needs, built once per placement."""

    num_replicas_E: Tensor
    slot_ER: Tensor
    """Global slot of replica r of expert e (padded with -1)."""
    rank_of_slot_S: Tensor
    slots_per_rank: List[int]
    num_slots: int

    @property
    def ep_size(self) -> int:
        return len(self.slots_per_rank)

    @classmethod
    def build(cls, placement: Placement, device: torch.device) -> "SlotTables":
        offsets = placement.slot_offsets()
        max_rep = max(len(r) for r in placement.replicas)
        table = torch.full((placement.num_experts, max_rep), -1, dtype=torch.long)
        for expert, slots in enumerate(placement.replicas):
            for i, (rank, slot) in enumerate(slots):
                table[expert, i] = offsets[rank] + slot
        num_rep = torch.tensor([len(r) for r in placement.replicas], dtype=torch.long)
        per_rank = list(placement.slots_per_rank())
        rank_of_slot = torch.repeat_interleave(
            torch.arange(placement.ep_size), torch.tensor(per_rank), output_size=placement.num_slots
        )
        return cls(num_rep.to(device), table.to(device), rank_of_slot.to(device), per_rank, placement.num_slots)


@dataclass(frozen=True, eq=False)
class LayerShard:
    """One MoE layer's expert-parallel record: where every logical expert lives and what this rank holds."""

    index: int
    """Position of the layer among the model's MoE layers (the layer id of plans and checkpoints)."""
    name: str
    """Qualified module name in the model ('' when the model is the layer itself)."""
    layer: MoELayer
    placement: Placement
    ep_rank: int
    tables: SlotTables

    @classmethod
    def build(
        cls, index: int, name: str, layer: MoELayer, placement: Placement, ep_rank: int, device: torch.device
    ) -> "LayerShard":
        return cls(index, name, layer, placement, ep_rank, SlotTables.build(placement, device))

    def moved_to(self, placement: Placement) -> "LayerShard":
        """The same layer under a new placement (after a plan or a resume)."""
        return LayerShard.build(
            self.index, self.name, self.layer, placement, self.ep_rank, self.tables.rank_of_slot_S.device
        )

    @property
    def label(self) -> str:
        """How collectives and errors name the layer."""
        return self.name or f"moe{self.index}"

    @property
    def local_experts(self) -> List[int]:
        """Logical ids of the experts this rank holds, in slot order (= the ExpertBank's order)."""
        return self.placement.experts_on(self.ep_rank)

    def owner(self, expert: int) -> int:
        return self.placement.owner(expert)

    def owns(self, expert: int) -> bool:
        return self.placement.owner(expert) == self.ep_rank

    def is_replicated(self, expert: int) -> bool:
        return self.placement.num_replicas(expert) > 1

    def local_modules(self) -> Iterator[Tuple[int, nn.Module]]:
        """(logical id, module) of every expert this rank holds."""
        experts = self.layer.experts.experts
        assert len(experts) == len(self.local_experts), "the bank and the placement disagree"
        return zip(self.local_experts, experts)

    def owned_modules(self) -> List[Tuple[int, nn.Module]]:
        """(logical id, module) of the experts this rank speaks for (their first holder)."""
        return [(e, m) for e, m in self.local_modules() if self.owns(e)]

"""ExpertSet: the one owner of a run's experts.

It holds, for every MoE layer, the ``LayerShard`` record (where each logical expert lives, what this rank
holds), the expert sharding (FSDP over the expert-dp group, or none), the optimizer whose state the
experts carry, and the expert each layer last discarded (for ``adaptive.expert_init = reuse_discarded``).
Nothing else writes the shards or refreshes the optimizer's param groups: every change goes through
``apply_plan`` (an adaptive event) or ``reshard_from`` (a resume), and each ends in one ``_commit`` that
shards the experts again and points the optimizer at the model's current parameters. A caller can no
longer leave the optimizer half-updated by forgetting a step.

For checkpoints: ``layout()`` (the placements and the discarded experts) and ``owned_tensors()`` (the
experts this rank owns with their Adam state, by logical key ``moe.experts.expert_key``, not copied) are
what it saves; ``load_state_dict()`` takes the placements and at least the experts this rank will hold,
whatever the world size that wrote them. Which files hold them is train/checkpoint_parts.py's business.
It also keeps every logical expert's recipe (train/checkpoint_base.py: what its frozen weights are, in terms of
the base's experts), which a LoRA checkpoint saves instead of the frozen weights (``trainable_only``).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from ..moe.experts import added_expert_trains, stored_discarded
from ..moe.layer import MoELayer
from ..parallel.fsdp import Sharding, shard_experts, unshard_experts
from ..parallel.groups import ParallelGroups
from ..parallel.migrate import apply_layer_plan
from ..parallel.reshard import local_expert_parameters, owned_expert_parameters, reshard, resume_placement
from ..parallel.shard import LayerShard
from ..planning.placement import Placement
from ..planning.planner import LayerPlan, Plan
from .checkpoint_base import FROZEN_BASE, LayerRecipes, recipes_entry, recipes_from
from .optim import ExpertOptimizerState, refresh_param_groups

ExpertPayload = Dict[str, Dict[str, Any]]
"""'layer/expert' -> {"params": {name: tensor}, "state": {name: Adam state}} (and, for a LoRA checkpoint's, the
names of the parameters that do not train, "frozen")."""


class ExpertSet:
    def __init__(
        self,
        model: nn.Module,
        shards: Sequence[LayerShard],
        sharding: Sharding,
        optimizer: Optimizer,
        groups: ParallelGroups,
    ):
        self._model = model
        self._shards: List[LayerShard] = list(shards)
        self._sharding = sharding
        self._optimizer = optimizer
        self._groups = groups
        self._discarded: List[Optional[List[Tensor]]] = [None] * len(self._shards)
        self._recipes = [LayerRecipes.of_base(shard.placement.num_experts) for shard in self._shards]

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def shards(self) -> Tuple[LayerShard, ...]:
        return tuple(self._shards)

    @property
    def layers(self) -> List[MoELayer]:
        return [shard.layer for shard in self._shards]

    @property
    def placements(self) -> Tuple[Placement, ...]:
        return tuple(shard.placement for shard in self._shards)

    @property
    def has_discarded(self) -> Tuple[bool, ...]:
        return tuple(d is not None for d in self._discarded)

    @property
    def sharded(self) -> bool:
        """Experts are FSDP-sharded over their expert-dp group (gathering one is then a collective)."""
        return self._sharding.experts

    def __len__(self) -> int:
        return len(self._shards)

    # -- changes: each ends in one commit ----------------------------------------------------------
    def apply_plan(self, plan: Plan) -> List[LayerPlan]:
        """Apply an adaptive event's plan on this rank (collective over the ep groups, in the same order
        everywhere); returns the layer plans that added, removed or moved experts."""
        unshard_experts(self._shards, self._sharding, self._optimizer)  # plans move and combine whole experts
        changed = []
        for lp in plan.layers:
            before = self._shards[lp.layer]
            self._shards[lp.layer], self._discarded[lp.layer] = apply_layer_plan(
                lp, before, self._optimizer, self._groups, self._discarded[lp.layer]
            )
            self._recipes[lp.layer] = self._recipes[lp.layer].planned(lp)
            if lp.changes_experts() or lp.placement != before.placement:
                changed.append(lp)
        self._commit()
        return changed

    def reshard_from(
        self,
        placements: Sequence[Placement],
        experts: Mapping[str, Mapping[str, Tensor]],
        frozen: Optional[Mapping[str, Sequence[str]]] = None,
    ) -> None:
        """Rebuild every layer for ``placements`` from logical expert tensors ('layer/expert' -> {name:
        tensor}; at least the experts this rank holds), the parameters ``frozen`` names ('layer/expert' ->
        names) without a gradient. Routers are resized to the new expert counts with zero rows: their values,
        like every dense parameter's, come from the dense state loaded next."""
        self._shards = reshard(self._shards, placements, experts, self._groups)
        for key, params in local_expert_parameters(self._shards).items():
            if frozen is not None and key in frozen:  # what trained trains again (an added expert may train whole)
                for name, p in params.items():
                    p.requires_grad_(name not in frozen[key])
        self._commit()

    def _commit(self) -> None:
        """The one end of every change: shard the (plain) experts again, optimizer state included, and
        point the optimizer's groups at the model's parameters (dropping the state of those that left)."""
        shard_experts(self._shards, self._sharding, self._optimizer)
        refresh_param_groups(self._optimizer, self._model)

    # -- checkpointed state ------------------------------------------------------------------------
    def layout(self, trainable_only: bool = False) -> Dict[str, Any]:
        """What every rank needs to know before reading any expert: placements and the discarded experts.
        ``trainable_only`` (LoRA): the discarded expert's frozen weights as None, and every expert's recipe."""
        layout = {
            "placements": [json.dumps(p.to_lists()) for p in self.placements],
            "num_experts": [p.num_experts for p in self.placements],
            "discarded": [self._saved_discarded(index, trainable_only) for index in range(len(self))],
        }
        if trainable_only:
            layout[FROZEN_BASE] = "model.path"
            layout.update(recipes_entry(self._recipes))
        return layout

    def _saved_discarded(self, index: int, trainable_only: bool) -> Optional[List[Optional[Tensor]]]:
        discarded = self._discarded[index]
        if discarded is None:
            return None
        trains = added_expert_trains(self._shards[index].layer.config)  # as a reused discarded expert would
        return [t.detach().cpu().clone() if keep or not trainable_only else None for t, keep in zip(discarded, trains)]

    def owned_tensors(self, trainable_only: bool = False) -> ExpertPayload:
        """The experts this rank owns (each logical expert is owned by exactly one rank of every ep group)
        with their Adam state, as the tensors the model and optimizer hold: no copies (a sharded expert's
        are its shards' DTensors, whole only once gathered). A checkpoint streams them to disk one at a time
        (train/checkpoint_parts.py); ``trainable_only`` (LoRA) leaves out the parameters that do not train."""
        states = self._optimizer_state().owned_state()
        owned = owned_expert_parameters(self._shards)
        return {
            key: {
                "params": {n: p.detach() for n, p in params.items() if p.requires_grad or not trainable_only},
                "state": states.get(key, {}),
            }
            for key, params in owned.items()
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a (possibly other world size's) saved state: the saved placements where they fit this
        ep size (rebalanced layouts and replicas survive), the default ones otherwise."""
        payload: ExpertPayload = state["experts"]
        params = {key: e["params"] for key, e in payload.items()}
        # a LoRA checkpoint says which of an expert's parameters were frozen (train/checkpoint_base.py)
        frozen = {key: e["frozen"] for key, e in payload.items() if "frozen" in e}
        self.reshard_from(self.resume_placements(state), params, frozen)
        self.load_optimizer_state({key: e["state"] for key, e in payload.items()})
        self._discarded = list(state["discarded"])
        if len(self._discarded) != len(self._shards):
            raise ValueError(f"saved discarded experts for {len(self._discarded)} layers, the model has {len(self)}")
        self._discarded = [  # a low-precision base's as the run holds it (moe/frozen_base.py)
            None if d is None else stored_discarded(list(d), layer.config)
            for d, layer in zip(self._discarded, self.layers)
        ]
        if "recipes" in state:
            self._recipes = recipes_from(state)
        else:  # a checkpoint that saved every weight: the recipes matter only to a LoRA run, which refuses it
            self._recipes = [LayerRecipes.of_base(p.num_experts) for p in self.placements]

    def resume_placements(self, state: Mapping[str, Any]) -> List[Placement]:
        return [resume_placement(p, self._groups.ep_size) for p in saved_placements(state)]

    def load_optimizer_state(self, states: Mapping[str, Dict]) -> None:
        self._optimizer_state().load_state_dict(dict(states))

    def _optimizer_state(self) -> ExpertOptimizerState:
        """The experts' Adam state by logical name (saved by owners, restored on every holder)."""
        return ExpertOptimizerState(
            self._optimizer, owned_expert_parameters(self._shards), local_expert_parameters(self._shards)
        )


def saved_placements(state: Mapping[str, Any]) -> List[Placement]:
    """The placements a state_dict() (or a checkpoint's layout entry) was saved with."""
    return [Placement.from_lists(json.loads(p)) for p in state["placements"]]

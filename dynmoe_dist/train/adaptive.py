"""Adaptive experts during training: the recording window, the event at its end, the plan's application.

The window is counted in *optimizer steps* (gradient accumulation and activation checkpointing do not
change it): by default from 1/3 to 2/3 of every epoch, or of every ``period_steps`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..coordination import Coordinator, PlanRequest
from ..moe.layer import block_labels
from ..parallel.fsdp import shard_experts, unshard_experts
from ..parallel.migrate import apply_layer_plan
from ..planning.planner import Plan, PlannerConfig
from .optim import refresh_param_groups


@dataclass(frozen=True)
class WindowSchedule:
    period: int
    """Steps per period: an epoch, or adaptive.period_steps."""
    start: int
    """First recorded step within a period (0-based)."""
    end: int
    """One past the last recorded step; the event runs after step end - 1."""

    @classmethod
    def build(cls, adaptive_config, steps_per_epoch: int) -> "WindowSchedule":
        period = adaptive_config.period_steps or steps_per_epoch
        start = int(period * adaptive_config.window_start)
        end = max(start + 1, int(period * adaptive_config.window_end))
        return cls(period, min(start, period - 1), min(end, period))

    def starts_at(self, step: int) -> bool:
        return step % self.period == self.start

    def recording(self, step: int) -> bool:
        return self.start <= step % self.period < self.end

    def ends_at(self, step: int) -> bool:
        return step % self.period == self.end - 1


class AdaptiveController:
    """Runs the window and its event for a Trainer; stateful for checkpoints (plan version, the
    remembered discarded expert of each layer)."""

    def __init__(self, trainer, coordinator: Coordinator):
        self.trainer = trainer
        self.coordinator = coordinator
        self.config = trainer.config.adaptive
        self.schedule = WindowSchedule.build(self.config, trainer.schedule.steps_per_epoch)
        self.version = 0
        self.discarded: List[Optional[list]] = [None] * len(trainer.moe_layers)

    # -- hooks around one optimizer step (step = 0-based index of the step being run) ------------------
    def before_step(self, step: int) -> None:
        recorders = self.trainer.recorders
        if self.schedule.recording(step) and not recorders.in_window:
            recorders.start_window()

    def after_step(self, step: int) -> List[Dict]:
        recorders = self.trainer.recorders
        if not self.schedule.ends_at(step) or not len(recorders):
            return []
        plan = self.coordinator.submit(self.request(step + 1), recorders.windows())
        return self.apply(plan)

    def request(self, step: int) -> PlanRequest:
        shards = self.trainer.shards
        return PlanRequest(
            version=self.version + 1,
            step=step,
            placements=tuple(shard.placement for shard in shards),
            configs=tuple(PlannerConfig(shard.layer.config, self.config) for shard in shards),
            has_discarded=tuple(d is not None for d in self.discarded),
            dims=tuple(shard.layer.config.dim for shard in shards),
        )

    # -- application ---------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> List[Dict]:
        t = self.trainer
        events = []
        unshard_experts(t.shards, t.sharding, t.optimizer)  # plans move and combine whole experts
        for lp in plan.layers:
            before = t.shards[lp.layer]
            t.shards[lp.layer], self.discarded[lp.layer] = apply_layer_plan(
                lp, before, t.optimizer, t.groups, self.discarded[lp.layer]
            )
            if lp.changes_experts() or lp.placement != before.placement:
                events.append(self.event_record(plan, lp))
        shard_experts(t.shards, t.sharding, t.optimizer)
        refresh_param_groups(t.optimizer, t.model)
        t.recorders.end_window()
        self.version = plan.version
        return events

    # -- checkpointed state --------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {"version": self.version, "discarded": list(self.discarded)}

    def load_state_dict(self, state: Dict) -> None:
        self.version = int(state["version"])
        self.discarded = list(state["discarded"]) or [None] * len(self.trainer.moe_layers)

    def event_record(self, plan: Plan, lp) -> Dict:
        first_added = len(lp.kept)
        return {
            "kind": "event",
            "step": plan.step,
            "epoch": plan.step / self.trainer.schedule.steps_per_epoch,
            "layer": lp.layer,
            "block": block_labels([shard.name for shard in self.trainer.shards])[lp.layer],  # the model's numbering
            "removed": list(lp.removed),
            "added": [{"expert": first_added + i, "init": spec.init} for i, spec in enumerate(lp.added)],
            "moves": lp.moves,
            "replicas": {str(e): lp.placement.num_replicas(e) for e in lp.placement.replicated_experts()},
            "imbalance_before": lp.imbalance_before,
            "imbalance_after": lp.imbalance_after,
            "imbalance_unmoved": lp.imbalance_unmoved,
            "num_experts": lp.num_experts,
            "planned_by": plan.planned_by,
            "version": plan.version,
        }

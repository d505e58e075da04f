"""Adaptive experts during training: the recording window, the event at its end, the plan's application.

The window is counted in *optimizer steps* (gradient accumulation and activation checkpointing do not
change it): by default from 1/3 to 2/3 of every epoch, or of every ``period_steps`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from ..config import AdaptiveConfig
from ..coordination import Coordinator, PlanRequest
from ..moe.layer import block_labels
from ..planning.planner import LayerPlan, Plan, PlannerConfig
from .experts import ExpertSet
from .recorder import Recorders


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
    """Runs the window and its event: the recorders record, the coordinator plans from every rank's
    statistics, the expert set applies the plan. Stateful for checkpoints (the plan version)."""

    def __init__(
        self,
        config: AdaptiveConfig,
        steps_per_epoch: int,
        experts: ExpertSet,
        recorders: Recorders,
        coordinator: Coordinator,
    ):
        self.config = config
        self.steps_per_epoch = steps_per_epoch
        self.schedule = WindowSchedule.build(config, steps_per_epoch)
        self.experts = experts
        self.recorders = recorders
        self.coordinator = coordinator
        self.version = 0

    # -- hooks around one optimizer step (step = 0-based index of the step being run) ------------------
    def before_step(self, step: int) -> None:
        if self.schedule.recording(step) and not self.recorders.in_window:
            self.recorders.start_window()

    def after_step(self, step: int) -> List[Dict]:
        if not self.schedule.ends_at(step) or not len(self.recorders):
            return []
        plan = self.coordinator.submit(self.request(step + 1), self.recorders.windows())
        return self.apply(plan)

    def request(self, step: int) -> PlanRequest:
        layers = self.experts.layers
        return PlanRequest(
            version=self.version + 1,
            step=step,
            placements=self.experts.placements,
            configs=tuple(PlannerConfig(layer.config, self.config) for layer in layers),
            has_discarded=self.experts.has_discarded,
            dims=tuple(layer.config.dim for layer in layers),
        )

    # -- application ---------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> List[Dict]:
        """Apply the plan; its records: the window's summary, then an event per layer that changed."""
        blocks = block_labels([shard.name for shard in self.experts.shards])  # before the plan replaces them
        changed = self.experts.apply_plan(plan)
        self.recorders.end_window()
        self.version = plan.version
        return [self.window_record(plan, blocks)] + [self.event_record(plan, lp) for lp in changed]

    def window_record(self, plan: Plan, blocks: List[int]) -> Dict:
        """What the window saw in every layer, changed or not: the experts no token chose ("dead")."""
        return {
            "kind": "window",
            "step": plan.step,
            "epoch": plan.step / self.steps_per_epoch,
            "blocks": blocks,
            "dead_experts": [list(lp.dead) for lp in plan.layers],
            "num_experts_before": [len(lp.kept) + len(lp.removed) for lp in plan.layers],
        }

    # -- checkpointed state --------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {"version": self.version}

    def load_state_dict(self, state: Dict) -> None:
        self.version = int(state["version"])

    def event_record(self, plan: Plan, lp: LayerPlan) -> Dict:
        first_added = len(lp.kept)
        return {
            "kind": "event",
            "step": plan.step,
            "epoch": plan.step / self.steps_per_epoch,
            "layer": lp.layer,
            "block": block_labels([shard.name for shard in self.experts.shards])[lp.layer],  # the model's numbering
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

"""Adaptive experts during training: the recording window, the event at its end, the plan's application.

The window is counted in *optimizer steps* (gradient accumulation and activation checkpointing do not
change it): by default from 1/3 to 2/3 of every epoch, or of every ``period_steps`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..coordination import Coordinator, PlanRequest
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


def planner_config(layer, adaptive_config) -> PlannerConfig:
    moe = layer.config
    return PlannerConfig(min_experts=moe.min_experts, max_experts=moe.max_experts,
                         max_adds_per_event=adaptive_config.max_adds_per_event,
                         expert_init=adaptive_config.expert_init, rebalance=adaptive_config.rebalance,
                         replicate_factor=adaptive_config.replicate_factor,
                         max_replicas=adaptive_config.max_replicas,
                         adapt_experts=moe.router == "top_any")


class AdaptiveController:
    def __init__(self, trainer, coordinator: Coordinator):
        self.trainer = trainer
        self.coordinator = coordinator
        self.config = trainer.config.adaptive
        self.schedule = WindowSchedule.build(self.config, trainer.schedule.steps_per_epoch)
        self.version = 0
        self.discarded: List[Optional[list]] = [None] * len(trainer.moe_layers)

    # -- hooks around one optimizer step (step = 0-based index of the step being run) ------------------
    def before_step(self, step: int) -> None:
        if self.schedule.recording(step) and any(r.window is None for r in self.trainer.recorders):
            for recorder in self.trainer.recorders:
                recorder.start_window()

    def after_step(self, step: int) -> List[Dict]:
        if not self.schedule.ends_at(step) or not self.trainer.recorders:
            return []
        recorders = self.trainer.recorders
        request = self.request(step + 1)
        plan = self.coordinator.submit(request, [r.window for r in recorders])
        return self.apply(plan)

    def request(self, step: int) -> PlanRequest:
        layers = self.trainer.moe_layers
        return PlanRequest(version=self.version + 1, step=step,
                           placements=tuple(layer.placement for layer in layers),
                           configs=tuple(planner_config(layer, self.config) for layer in layers),
                           has_discarded=tuple(d is not None for d in self.discarded),
                           dims=tuple(layer.config.dim for layer in layers))

    # -- application ---------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> List[Dict]:
        t = self.trainer
        events = []
        for lp, layer in zip(plan.layers, t.moe_layers):
            before = layer.placement
            self.discarded[lp.layer] = apply_layer_plan(lp, layer, t.optimizer, t.groups,
                                                        self.discarded[lp.layer], name=f"moe{lp.layer}")
            if lp.changes_experts() or lp.placement != before:
                events.append(self.event_record(plan, lp))
        refresh_param_groups(t.optimizer, t.model)
        for recorder in t.recorders:
            recorder.window = None
            recorder.reset_step()
        self.version = plan.version
        return events

    def event_record(self, plan: Plan, lp) -> Dict:
        first_added = len(lp.kept)
        return {"kind": "event", "step": plan.step, "epoch": plan.step / self.trainer.schedule.steps_per_epoch,
                "layer": lp.layer, "removed": list(lp.removed),
                "added": [{"expert": first_added + i, "init": spec.init} for i, spec in enumerate(lp.added)],
                "moves": lp.moves,
                "replicas": {str(e): lp.placement.num_replicas(e) for e in lp.placement.replicated_experts()},
                "imbalance_before": lp.imbalance_before, "imbalance_after": lp.imbalance_after,
                "num_experts": lp.num_experts, "planned_by": plan.planned_by, "version": plan.version}

"""`python -m dynmoe_dist.bench adapt`: the wall time of an adaptation event against a training step.

The demo run (launcher/configs/demo.toml) trains on simulated gloo clusters of 2 and 3 ranks (one torch
thread each). Every optimizer step and every adaptation event is timed on its own, after a barrier:
  step   Trainer.train_step (forward, backward, gradient sync, optimizer step, metrics);
  event  AdaptiveController.after_step at a window end, exactly as training runs it: the window
         statistics all-reduce, planning on rank 0, the plan broadcast and digest check, then the plan's
         application (expert migration with optimizer state, router resize, param-group refresh).
A phase's time is the slowest rank's. Two scenarios per world size:
  natural  the demo as it is;
  skewed   router thresholds set so the event has work to do: in layer 0 every token picks expert 0
           (threshold -1: a hot expert, replicated) and experts 1-5 sit at 0.3 (rarely picked); in
           layer 1 every threshold is 0.35, so most tokens pick no expert (one is added) and an expert
           nobody picks is removed. adaptive.replicate_factor is lowered to 1.2 (from 2.0).
Load imbalance (max / mean rows per rank) is reported as the planner estimated it (event records) and
as measured by the steps' routing counts just before and just after the event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..coordination import CollectiveCoordinator, PlanRequest
from ..parallel.groups import barrier
from ..parallel.simulate import run_simulated
from ..planning.planner import Plan

DEMO = Path(__file__).resolve().parents[2] / "launcher" / "configs" / "demo.toml"
TARGET_STEPS = 3.0
SKEW_OVERRIDES = ["adaptive.replicate_factor=1.2"]
LOAD_STEPS = 5
"""Steps averaged for the measured imbalance on each side of an event."""


class TimedCoordinator(CollectiveCoordinator):
    """CollectiveCoordinator.submit with a clock between its phases (same calls, same order)."""

    def __init__(self, groups) -> None:
        super().__init__(groups)
        self.phases: Dict[str, float] = {}

    def submit(self, request: PlanRequest, local_stats) -> Plan:
        clock = time.perf_counter()
        self.check_request(request)
        self.phases["request_check_s"], clock = time.perf_counter() - clock, time.perf_counter()
        flat = self.reduce_stats(local_stats)
        self.phases["stats_all_reduce_s"], clock = time.perf_counter() - clock, time.perf_counter()
        payload = self.plan_on_rank0(request, flat, local_stats)
        self.phases["plan_s"], clock = time.perf_counter() - clock, time.perf_counter()
        plan_ = self.share(payload, request)
        self.phases["plan_broadcast_s"] = time.perf_counter() - clock
        return plan_


def skew_routing(trainer) -> None:
    """Thresholds that give the event something to do (see the module docstring)."""
    layer0, layer1 = trainer.moe_layers[:2]
    with torch.no_grad():
        layer0.router.threshold.fill_(0.3)
        layer0.router.threshold[0] = -1.0  # cos > -1: every token selects expert 0
        layer1.router.threshold.fill_(0.35)


def imbalance(loads: Sequence[float]) -> float:
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


def measured_imbalance(step_loads: List[List[List[float]]], layer: int) -> Optional[float]:
    """Mean over steps of max / mean rows per rank; step_loads[step][layer] = rows per rank."""
    values = [imbalance(loads[layer]) for loads in step_loads if layer < len(loads)]
    return statistics.mean(values) if values else None


# -- one rank -------------------------------------------------------------------------------------------
def train_and_time(trainer, adaptive, groups) -> Dict:
    steps, events = [], []
    records: List[Dict] = []
    while trainer.step < trainer.schedule.total_steps:
        index = trainer.step
        adaptive.before_step(index)
        barrier(groups, "bench step start")
        started = time.perf_counter()
        records.append(trainer.train_step())
        steps.append(time.perf_counter() - started)
        if not adaptive.schedule.ends_at(index):
            continue
        barrier(groups, "bench event start")
        started = time.perf_counter()
        event_records = adaptive.after_step(index)
        events.append(
            {
                "after_step": index,
                "event_s": time.perf_counter() - started,
                **adaptive.coordinator.phases,
                "records": event_records,
            }
        )
    return {
        "steps_s": steps,
        "events": events,
        "rank_load": [r["rank_load"] for r in records],
        "num_experts": [r["num_experts"] for r in records],
    }


def rank_worker(config_path: str, overrides: List[str], skewed: bool) -> Dict:
    from ..config import load_config
    from ..train.loop import Trainer
    from ..train.run import adaptive_controller

    trainer = Trainer(load_config(config_path, overrides))
    adaptive = adaptive_controller(trainer, TimedCoordinator(trainer.groups))
    if skewed:
        skew_routing(trainer)
    result = train_and_time(trainer, adaptive, trainer.groups)
    result["rank"] = trainer.groups.rank
    return result


# -- the parent -----------------------------------------------------------------------------------------
PHASES = ("event_s", "request_check_s", "stats_all_reduce_s", "plan_s", "plan_broadcast_s")


def slowest(per_rank: List[Dict], pick) -> List[float]:
    return [max(values) for values in zip(*(pick(r) for r in per_rank))]


def run_times(per_rank: List[Dict]) -> Dict:
    """One training run: the slowest rank's normal steps, and each event's phases (slowest rank each)."""
    steps = slowest(per_rank, lambda r: r["steps_s"])
    after = [e["after_step"] for e in per_rank[0]["events"]]
    # A normal step: not the first two (allocator and thread-pool warm-up), not one right after an event.
    normal = [s for i, s in enumerate(steps) if i >= 2 and i - 1 not in after]
    events = []
    for index, step in enumerate(after):
        ev = [r["events"][index] for r in per_rank]
        phases = {key: max(e[key] for e in ev) for key in PHASES}
        phases["apply_s"] = max(e["event_s"] - sum(e[key] for key in PHASES[1:]) for e in ev)
        phases["step_after_event_s"] = steps[step + 1] if step + 1 < len(steps) else None
        events.append(phases)
    return {"normal_steps": normal, "events": events}


def layer_changes(per_rank: List[Dict], index: int) -> List[Dict]:
    """What one event did to each layer it changed, with the planner's and the measured imbalance."""
    event = per_rank[0]["events"][index]
    step = event["after_step"]
    loads = per_rank[0]["rank_load"]
    before, after = loads[max(0, step + 1 - LOAD_STEPS) : step + 1], loads[step + 1 : step + 1 + LOAD_STEPS]
    changes = []
    for rec in (r for r in event["records"] if r["kind"] == "event"):  # the window's summary aside
        layer = rec["layer"]
        changes.append(
            {
                "layer": layer,
                "removed": len(rec["removed"]),
                "added": len(rec["added"]),
                "moved": rec["moves"],
                "replicas": rec["replicas"],
                "num_experts": rec["num_experts"],
                "planned_imbalance_before": rec["imbalance_before"],
                "planned_imbalance_after": rec["imbalance_after"],
                "measured_imbalance_before": measured_imbalance(before, layer),
                "measured_imbalance_after": measured_imbalance(after, layer),
            }
        )
    return changes


def spread(values: List[float]) -> Dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def event_summary(runs: List[Dict], per_rank: List[Dict], index: int, step_median: float) -> Dict:
    phases = {key: spread([r["events"][index][key] for r in runs]) for key in PHASES + ("apply_s",)}
    ratio = phases["event_s"]["median"] / step_median
    worst = max(r["events"][index]["event_s"] / statistics.median(r["normal_steps"]) for r in runs)
    return {
        "after_step": per_rank[0]["events"][index]["after_step"],
        "seconds": phases,
        "event_in_steps": ratio,
        "worst_run_event_in_steps": worst,
        "target_max_steps": TARGET_STEPS,
        "met": ratio <= TARGET_STEPS,
        "changed_layers": layer_changes(per_rank, index),
        "step_after_event_s": spread(
            [
                r["events"][index]["step_after_event_s"]
                for r in runs
                if r["events"][index]["step_after_event_s"] is not None
            ]
            or [0.0]
        ),
    }


def scenario(world: int, skewed: bool, config_path: str, extra: List[str], repeats: int, timeout: float) -> Dict:
    """The same (deterministic) training run `repeats` times; times are spread over the repeats."""
    overrides = (SKEW_OVERRIDES if skewed else []) + extra
    results = [
        run_simulated(rank_worker, world, args=(config_path, overrides, skewed), timeout_s=timeout)
        for _ in range(repeats)
    ]
    runs = [run_times(per_rank) for per_rank in results]
    normal = [s for r in runs for s in r["normal_steps"]]
    step_median = statistics.median(normal)
    first = results[0]
    same = all([e["records"] for e in pr[0]["events"]] == [e["records"] for e in first[0]["events"]] for pr in results)
    events = [event_summary(runs, first, i, step_median) for i in range(len(first[0]["events"]))]
    return {
        "ranks": world,
        "scenario": "skewed" if skewed else "natural",
        "overrides": overrides,
        "repeats": repeats,
        "steps_per_run": len(first[0]["steps_s"]),
        "step_median_s": step_median,
        "step_min_s": min(normal),
        "events": events,
        "num_experts_final": first[0]["num_experts"][-1],
        "same_events_every_repeat": same,
        "all_events_met": all(e["met"] for e in events),
    }


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.bench adapt", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEMO))
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--scenarios", nargs="+", choices=("natural", "skewed"), default=["natural", "skewed"])
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override a.b=c")
    p.add_argument("--repeats", type=int, default=3, help="training runs per scenario (times: min/median/max)")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    runs = [
        scenario(world, name == "skewed", args.config, args.overrides, args.repeats, args.timeout)
        for world in args.ranks
        for name in args.scenarios
    ]
    print(
        json.dumps(
            {
                "benchmark": "adapt",
                "config": args.config,
                "torch_threads_per_rank": 1,
                "backend": "gloo",
                "target_max_steps": TARGET_STEPS,
                "runs": runs,
                "all_met": all(r["all_events_met"] for r in runs),
            },
            indent=2,
        )
    )

"""run(config): the whole job — build, resume, train with adaptive events, evaluate, report."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..config import RunConfig
from ..coordination import CollectiveCoordinator
from ..moe.layer import block_labels
from ..parallel.groups import barrier
from .adaptive import AdaptiveController
from .calibrate import calibrate_converted
from .checkpoint import CheckpointManager, complete_checkpoints
from .control import StepControl, StopSignals
from .finish import finished_files
from .loop import Trainer
from .notices import checkpoint_line, length_change_line, unreachable_window_line
from .startup import resolve_optional_features
from .telemetry import Telemetry


def adaptive_controller(trainer: Trainer, coordinator) -> AdaptiveController:
    """The adaptive controller of the trainer's expert set and recorders."""
    return AdaptiveController(
        trainer.config.adaptive,
        trainer.schedule.steps_per_epoch,
        trainer.parts.experts,
        trainer.recorders,
        coordinator,
    )


def make_coordinator(trainer: Trainer, factory: Optional[Callable] = None):
    """The Ray entry point (dynmoe_dist.cluster) injects a factory for its actor-backed coordinator;
    'auto' means that one when given, collectives otherwise. train/ never imports Ray itself."""
    choice = trainer.config.parallel.coordinator
    if factory is not None and choice in ("auto", "ray"):
        return factory(trainer.groups)
    if choice == "ray":
        raise ValueError(ray_coordinator_hint())
    return CollectiveCoordinator(trainer.groups)


def ray_coordinator_hint() -> str:
    """Why parallel.coordinator='ray' cannot work here; names the extra to install when Ray is missing.
    (find_spec looks Ray up without importing it: train/ never imports Ray.)"""
    entry = "python -m dynmoe_dist.cluster.submit (see docs/multinode.md)"
    if importlib.util.find_spec("ray") is None:
        return (
            f"parallel.coordinator ('ray') needs Ray, which is not installed: pip install -e '.[ray]' in the checkout, "
            f"then submit the job with {entry}"
        )
    return f"parallel.coordinator ('ray') needs the Ray job entry point: {entry}"


def maybe_crash(config: RunConfig, trainer: Trainer) -> None:
    """Fault injection for tests: die abruptly (no cleanup, like a lost machine) after a given step."""
    fault = config.fault
    if fault.crash_at_step < 0 or trainer.step != fault.crash_at_step or trainer.groups.rank != fault.crash_rank:
        return
    if fault.crash_once_file:
        marker = Path(fault.crash_once_file)
        if marker.exists():
            return
        marker.write_text(f"crashed at step {trainer.step}\n")
    os._exit(17)


def step_once(trainer: Trainer, adaptive: Optional[AdaptiveController], votes: List[float]):
    """One optimizer step with the adaptive hooks around it: (step record, adaptive event records)."""
    step_index = trainer.step
    if adaptive:
        adaptive.before_step(step_index)
    record = trainer.train_step(votes)
    return record, adaptive.after_step(step_index) if adaptive else []


@dataclass(frozen=True)
class Start:
    """A run ready for its first step: resumed or fresh (the previous run's files archived, a top-any
    conversion calibrated)."""

    config: RunConfig
    trainer: Trainer
    adaptive: Optional[AdaptiveController]
    checkpoints: CheckpointManager
    calibration: Optional[Dict]
    """The calibration record of a fresh run that converted an imported MoE's routers; else None."""
    resumed: Optional[Path] = None
    """The checkpoint the run resumed from; None for a fresh start."""


def start(
    config: RunConfig, trainer: Optional[Trainer] = None, coordinator_factory: Optional[Callable] = None
) -> Start:
    """Everything before the first step, in its one order: the trainer, the adaptive controller and its
    coordinator, the checkpoints, resume (or archive the previous run), the calibration of a fresh start."""
    config = resolve_optional_features(config)  # idempotent: the CLI has done it already
    trainer = trainer or Trainer(config)
    enabled = config.adaptive.enabled
    adaptive = adaptive_controller(trainer, make_coordinator(trainer, coordinator_factory)) if enabled else None
    checkpoints = trainer.checkpoint_manager(adaptive)
    resumed = checkpoints.resume(config.output.resume)
    if resumed is None and trainer.is_rank0:
        archive_previous_run(Path(config.output.out_dir))
    # An imported MoE converted to top-any: thresholds calibrated once, at the fresh start.
    calibration = calibrate_at_start(trainer) if resumed is None else None
    return Start(config, trainer, adaptive, checkpoints, calibration, resumed)


def calibrate_at_start(trainer: Trainer) -> Optional[Dict]:
    """The calibration of a converted imported MoE on the first moe.calibrate_samples training sequences
    (every rank its share), then the held-out split evaluated once, before any step; None for other runs."""
    moe = trainer.config.moe

    def sample() -> Dict[str, torch.Tensor]:
        count = min(trainer.task.size("train"), max(moe.calibrate_samples, trainer.world_size))
        return trainer.local_batch("train", torch.arange(count)).inputs

    shown = trainer.is_rank0 and trainer.config.output.progress
    # the budget when there is one (MoEConfig refuses a calibrate_k that differs), else calibrate_k, else the model's k
    target_k = moe.target_k or moe.calibrate_k
    record = calibrate_converted(trainer.source, trainer.parts, sample, target_k, trainer.autocast, shown)
    if record is None:
        return None
    scores = trainer.evaluate("held-out scoring after the conversion")
    after = {f"{key}_after_conversion": value for key, value in scores.items()}
    return {"kind": "calibration", "step": trainer.step, **record, **after}


def run(
    config: RunConfig,
    trainer: Optional[Trainer] = None,
    coordinator_factory: Optional[Callable] = None,
    signals: Optional[StopSignals] = None,
) -> Dict:
    """The whole job. ``signals``: the rank's SIGINT / SIGTERM handlers (the CLI installs them); a stop
    they ask for ends the run after a step and a checkpoint, with a "stopped" result instead of "final"."""
    started = time.perf_counter()
    begun = start(config, trainer, coordinator_factory)
    config, trainer, adaptive, checkpoints = begun.config, begun.trainer, begun.adaptive, begun.checkpoints
    resumed = begun.resumed
    if trainer.is_rank0:
        say_at_start(trainer, adaptive, resumed, checkpoints.resumed_config)
    control = StepControl(config.output, trainer.is_rank0, signals, trainer.step if resumed else -1)
    out = config.output
    with Telemetry(
        out.out_dir,
        trainer.schedule.total_steps,
        rank0=trainer.is_rank0,
        progress=out.progress,
        tensorboard=out.tensorboard,
        initial_step=trainer.step,
    ) as telemetry:
        if resumed is not None:
            telemetry.log(resume_record(trainer, resumed))
        if begun.calibration is not None:
            telemetry.log(begun.calibration)
        stopped = train_steps(trainer, adaptive, telemetry, Saver(checkpoints, control), control)
        if stopped is not None:
            return stopped
        final = final_record(trainer, started)
        telemetry.log(final)
    if out.final_checkpoint and control.last_saved_step != trainer.step:
        checkpoints.save(trainer.step)
    if trainer.is_rank0:
        final.update(run_files(config, trainer))
    barrier(trainer.groups, "end of run")
    final["rank0"] = trainer.is_rank0
    return final


class Saver:
    """Writes a checkpoint and tells the step control when (for the time rule and the end's save)."""

    def __init__(self, checkpoints: CheckpointManager, control: StepControl):
        self.checkpoints, self.control = checkpoints, control

    def __call__(self, step: int) -> Path:
        path = self.checkpoints.save(step)
        self.control.saved(step)
        return path


def train_steps(trainer: Trainer, adaptive, telemetry: Telemetry, save: Saver, control: StepControl) -> Optional[Dict]:
    """The steps up to the run's last, with their logging, evaluations and checkpoints; None when they
    all ran, the "stopped" result when a stop signal ended them early (after a checkpoint)."""
    config, total = trainer.config, trainer.schedule.total_steps
    blocks = block_labels([shard.name for shard in trainer.parts.experts.shards])  # labels for the report
    while trainer.step < total:
        record, events = step_once(trainer, adaptive, control.votes())
        decision = control.decide(record.pop("votes"), trainer.step)
        record["blocks"] = blocks
        if (trainer.step - 1) % config.train.log_every == 0 or trainer.step == total or decision.stop:
            telemetry.log(record)
        for event in events:
            telemetry.log(event)
        evaluate_now = config.train.eval_every and trainer.step % config.train.eval_every == 0
        if evaluate_now and trainer.step < total and not decision.stop:
            telemetry.log({"kind": "eval", "step": trainer.step, "epoch": record["epoch"], **evaluation(trainer)})
        if decision.checkpoint or (decision.stop and config.output.final_checkpoint):
            save(trainer.step)
        maybe_crash(config, trainer)
        if decision.stop:
            # A rank the signal did not reach stops for the others (as a preempted job's would, by SIGTERM).
            return stopped_record(trainer, control.signum or signal.SIGTERM)
    return None


def stopped_record(trainer: Trainer, signum: int) -> Dict:
    """What a run stopped by a signal returns on every rank (the signal may have reached only some):
    the step it stopped after, and on rank 0 the newest complete checkpoint (the one just written unless
    output.final_checkpoint is off)."""
    barrier(trainer.groups, "stopped")
    found = complete_checkpoints(trainer.config.output.out_dir) if trainer.is_rank0 else []
    return {
        "kind": "stopped",
        "step": trainer.step,
        "signal": signum,
        "checkpoint": str(found[-1]) if found else None,
        "rank0": trainer.is_rank0,
    }


def final_record(trainer: Trainer, started: float) -> Dict:
    return {
        "kind": "final",
        "step": trainer.step,
        "epoch": trainer.step / trainer.schedule.steps_per_epoch,
        **evaluation(trainer, "final evaluation"),
        "wall_s": time.perf_counter() - started,
        "num_experts": [layer.num_experts for layer in trainer.moe_layers],
        "blocks": block_labels([shard.name for shard in trainer.parts.experts.shards]),
    }


def resume_record(trainer: Trainer, checkpoint: Path) -> Dict:
    """Marks the resume in metrics.jsonl: readers drop what the run recorded past this step before."""
    return {
        "kind": "resume",
        "step": trainer.step,
        "epoch": trainer.step / trainer.schedule.steps_per_epoch,
        "checkpoint": str(checkpoint),
        "total_steps": trainer.schedule.total_steps,
    }


def say_at_start(
    trainer: Trainer, adaptive: Optional[AdaptiveController], resumed: Optional[Path], resumed_config: Optional[Dict]
) -> None:
    """Rank 0's lines before the first step: where checkpoints go and where the run resumed from
    (stdout); a run length changed by the resume and an adaptive window the run never reaches (warnings,
    stderr)."""
    config, schedule, step = trainer.config, trainer.schedule, trainer.step
    print(checkpoint_line(config.output), flush=True)
    if resumed is not None:
        print(f"resumed from {resumed} at step {step} of {schedule.total_steps}", flush=True)
    warnings = []
    if resumed_config is not None:
        saved_train = resumed_config.get("train", {})
        saved = replace(
            schedule,
            epochs=saved_train.get("epochs", schedule.epochs),
            max_steps=saved_train.get("max_steps", schedule.max_steps),
        )
        warnings.append(length_change_line(saved_train, config.train, saved.total_steps, schedule.total_steps, step))
    if adaptive is not None:
        by_epoch = not config.adaptive.period_steps
        warnings.append(unreachable_window_line(adaptive.schedule, schedule.total_steps, by_epoch))
    for line in filter(None, warnings):
        print(f"dynmoe-train: warning: {line}", file=sys.stderr, flush=True)


def evaluation(trainer: Trainer, wait: str = "held-out scoring") -> Dict:
    """The test scores, with the held-out perplexity for a language model (exp of the loss per token)."""
    scores = trainer.evaluate(wait)
    if trainer.task.scores_perplexity:
        scores["test_perplexity"] = math.exp(min(scores["test_loss"], 700.0))  # exp overflows past ~709
    return scores


def run_files(config: RunConfig, trainer: Trainer) -> Dict[str, str]:
    """Where the run left what a user looks at next (rank 0, at the end), the report drawn first."""
    out_dir = config.output.out_dir
    report = draw_run_report(Path(out_dir)) if config.output.report else None
    return finished_files(out_dir, exportable=config.model.source == "hf", report=report)


RUN_FILES = ("metrics.jsonl", "tensorboard", "checkpoints", "report.png")


def archive_previous_run(out_dir: Path) -> Optional[Path]:
    """A fresh start in a directory that holds an earlier run moves that run's files to
    OUT/previous/<time>/ instead of appending to them or deleting them."""
    present = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    if not present:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    while (target := out_dir / "previous" / (stamp + (f"-{n}" if n else ""))).exists():
        n += 1
    target.mkdir(parents=True)
    for path in present:
        path.rename(target / path.name)
    return target


def draw_run_report(out_dir: Path) -> Optional[Path]:
    from .report import draw_report

    return draw_report(out_dir / "metrics.jsonl", out_dir / "report.png")

"""The paper comparison in miniature: top-k (k = 1, 2, 4, 8) against DynMoE with each expert-init strategy.

    python -m dynmoe_dist.experiments compare --task vit-mnist [--epochs 10] [--seeds 0,1,2] [--out DIR]

Every model gets the same budget: the same task split, model, epochs, batch size, lr schedule and seed
set; only the router (and, for DynMoE, the expert-init strategy) differs. Every epoch end is evaluated.
Writes, under --out: runs/<model>/seed<s>/ (each run's metrics.jsonl), results.md (the table in the
shape of docs/algorithm.md section 6), results.json and comparison.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import RunConfig, load_config, parse_override
from ..tasks import build_task
from ..train.telemetry import METRICS_FILE, read_metrics
from .probe import RoutingProbe, add_totals, routing_summary
from .summary import ModelRow, RunSummary, aggregate, markdown_table, summarise_run

CONFIG_FILE = "config.toml"
ROUTING_FILE = "routing.json"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    overrides: Tuple[str, ...]


def _top_k(k: int) -> ModelSpec:
    # Adaptive off: a top-k layer never adds or removes experts, and on one rank there is nothing to
    # re-place, so the baseline is the plain fixed-k MoE of the paper.
    return ModelSpec(f"top{k}", f"MoE k={k}", ("moe.router='top_k'", f"moe.top_k={k}", "adaptive.enabled=false"))


def _dynmoe(init: str) -> ModelSpec:
    return ModelSpec(f"dynmoe-{init}", f"DynMoE ({init.replace('_', ' ')})",
                     ("moe.router='top_any'", "adaptive.enabled=true", f"adaptive.expert_init='{init}'"))


MODELS: Dict[str, ModelSpec] = {spec.name: spec for spec in (
    *(_top_k(k) for k in (1, 2, 4, 8)),
    *(_dynmoe(init) for init in ("reuse_discarded", "average", "weighted_average", "most_activated", "random")))}
DEFAULT_MODELS = [name for name in MODELS if name != "dynmoe-random"]  # the paper's eight rows

# The paper's vision setup in miniature (2 MoE layers of 8 experts in a small ViT, 16 patches per image);
# sized so that the eight default models x 10 epochs x 3 seeds take about 10 minutes on one CPU thread.
# lr: top-2 (seed 0, 10 epochs) reached 85.8 / 89.5 / 91.4 / 91.5 % at 0.001 / 0.002 / 0.004 / 0.008;
# 0.004 is the lower of the two tied best. Tuned on a baseline, not on DynMoE.
TASK_PRESETS: Dict[str, Tuple[str, ...]] = {
    "vit-mnist": ("model.dim=64", "model.num_heads=4", "model.num_layers=4", "model.ffn_dim=128",
                  "model.moe_layers=[1, 3]", "model.patch_size=7", "moe.num_experts=8",
                  "train.global_batch_size=64", "train.lr=0.004", "train.warmup_steps=30"),
    "synthetic": ("task.num_samples=2048", "task.max_len=16", "model.dim=32", "model.num_layers=2",
                  "model.ffn_dim=64", "model.moe_layers=[0, 1]", "moe.num_experts=8",
                  "train.global_batch_size=32", "train.lr=0.003"),
}
# Set per model or per run by compare itself: an override of these would break "same budget" or the
# per-epoch evaluation the table is built from.
RESERVED_KEYS = ("task.name", "moe.router", "moe.top_k", "adaptive.enabled", "adaptive.expert_init",
                 "train.epochs", "train.max_steps", "train.seed", "train.eval_every", "output.out_dir",
                 "output.resume")


def parse_models(text: str) -> List[str]:
    """'top2,dynmoe-average' -> names in the given order; 'all' -> every model; 'default' -> the paper's 8."""
    if text.strip() in ("all", "default"):
        return list(MODELS) if text.strip() == "all" else list(DEFAULT_MODELS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"--models ({text!r}): unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--models ({text!r}) names a model twice")
    return names


def parse_seeds(text: str) -> List[int]:
    """'0,1,2' -> [0, 1, 2]; '3' -> [3]."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds ({text!r}) must be comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds ({text!r}) must name at least one seed, each once")
    return seeds


def check_overrides(overrides: Sequence[str]) -> None:
    for text in overrides:
        section, key, _ = parse_override(text)
        if f"{section}.{key}" in RESERVED_KEYS:
            raise ValueError(f"--set {text}: {section}.{key} is set by compare itself "
                             f"(use --task / --epochs / --seeds / --out / --models instead)")


def build_config(task: str, spec: ModelSpec, seed: int, epochs: int, out_dir: Path,
                 overrides: Sequence[str] = (), eval_every: int = 0, dynmoe_overrides: Sequence[str] = ()) -> RunConfig:
    """One run's config: task preset < --set < --dynmoe-set (DynMoE runs only) < the model's router < the
    run's own fields."""
    if task not in TASK_PRESETS:
        raise ValueError(f"--task ({task!r}) must be one of {', '.join(TASK_PRESETS)}")
    check_overrides([*overrides, *dynmoe_overrides])
    if spec.name.startswith("dynmoe"):
        overrides = [*overrides, *dynmoe_overrides]
    own = [f"task.name='{task}'", f"train.epochs={epochs}", f"train.seed={seed}", f"train.eval_every={eval_every}",
           f"output.out_dir='{run_dir(out_dir, spec.name, seed).as_posix()}'", "output.progress=false",
           "output.tensorboard=false"]
    return load_config(None, [*TASK_PRESETS[task], "output.report=false", *overrides, *spec.overrides, *own])


def run_dir(out_dir: Path, model: str, seed: int) -> Path:
    return Path(out_dir) / "runs" / model / f"seed{seed}"


def steps_per_epoch(config: RunConfig) -> int:
    """Optimizer steps per epoch of this config's task (the same for every model of a comparison)."""
    return build_task(config.task).size("train") // config.train.global_batch_size


# ----------------------------------------------------------------------------------------------------
# Running


def _run_on_rank(config: RunConfig) -> Dict[str, List[float]]:
    """run(config) with a RoutingProbe on the model; returns this rank's probe counts."""
    from ..train.loop import Trainer
    from ..train.run import run

    trainer = Trainer(config)
    probe = RoutingProbe.attach(trainer.model)
    run(config, trainer=trainer)
    return probe.totals()


def train(config: RunConfig, world_size: int) -> Dict[str, List[float]]:
    """One run in this process (world size 1) or on simulated gloo ranks (one process per rank); returns
    the routing probe's counts summed over ranks."""
    if world_size == 1:
        return _run_on_rank(config)
    from ..parallel.simulate import run_simulated
    # No overall deadline worth having: a long comparison is long; collectives still time out.
    per_rank = run_simulated(_run_on_rank, world_size, args=(config,), timeout_s=7 * 24 * 3600.0,
                             collective_timeout_s=config.parallel.timeout_s)
    return add_totals(per_rank)


def finished(config: RunConfig) -> bool:
    """True when the run directory holds a finished run of exactly this config."""
    folder = Path(config.output.out_dir)
    saved = folder / CONFIG_FILE
    if not saved.is_file() or saved.read_text() != config.to_toml():
        return False
    if not (folder / METRICS_FILE).is_file() or not (folder / ROUTING_FILE).is_file():
        return False
    return any(r["kind"] == "final" for r in read_metrics(folder / METRICS_FILE))


def _log(message: str) -> None:
    print(message, flush=True)  # progress of a long comparison, also when stdout is a file


def run_or_reuse(spec: ModelSpec, seed: int, config: RunConfig, world_size: int, reuse: bool,
                 log=_log) -> RunSummary:
    folder = Path(config.output.out_dir)
    if reuse and finished(config):
        log(f"{spec.name} seed {seed}: reusing the finished run in {folder}")
    else:
        # metrics.jsonl is appended to: a stale or half-finished run must not leak into this one.
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        totals = train(config, world_size)
        (folder / ROUTING_FILE).write_text(json.dumps(totals))
        # Written last: its presence (with the same text) marks a finished run that may be reused.
        (folder / CONFIG_FILE).write_text(config.to_toml())
        log(f"{spec.name} seed {seed}: done in {time.perf_counter() - started:.0f}s")
    routing = routing_summary(json.loads((folder / ROUTING_FILE).read_text()))
    summary = summarise_run(spec.name, seed, read_metrics(folder / METRICS_FILE), routing)
    log(f"  test accuracy by epoch {[round(a, 2) for a in summary.test_accuracy]}, mean k {summary.mean_k:.2f}, "
        f"k=0 share {summary.train_k0_share:.2f}, eval k {summary.eval_k:.2f}, experts {summary.num_experts}")
    return summary


@dataclass
class Plan:
    """What a comparison will run: validated before the first (long) run starts."""
    task: str
    models: List[str]
    seeds: List[int]
    epochs: int
    out_dir: Path
    overrides: List[str]
    world_size: int
    steps_per_epoch: int
    dynmoe_overrides: List[str] = field(default_factory=list)

    def config(self, model: str, seed: int) -> RunConfig:
        return build_config(self.task, MODELS[model], seed, self.epochs, self.out_dir, self.overrides,
                            eval_every=self.steps_per_epoch, dynmoe_overrides=self.dynmoe_overrides)


def make_plan(args) -> Plan:
    if args.epochs < 1:
        raise ValueError(f"--epochs ({args.epochs}) must be >= 1")
    if args.world_size < 1:
        raise ValueError(f"--world-size ({args.world_size}) must be >= 1")
    models, seeds = parse_models(args.models), parse_seeds(args.seeds)
    first = build_config(args.task, MODELS[models[0]], seeds[0], args.epochs, Path(args.out), args.overrides)
    plan = Plan(args.task, models, seeds, args.epochs, Path(args.out), list(args.overrides), args.world_size,
                steps_per_epoch(first), list(args.dynmoe_overrides))
    for model in models:  # every config must validate before hours of training start
        for seed in seeds:
            plan.config(model, seed)
    return plan


def run_plan(plan: Plan, reuse: bool = True, log=_log) -> List[ModelRow]:
    """Every (seed, model) run, seeds outermost so an interrupted comparison has whole seeds done."""
    summaries: Dict[str, List[RunSummary]] = {m: [] for m in plan.models}
    for seed in plan.seeds:
        for model in plan.models:
            summaries[model].append(run_or_reuse(MODELS[model], seed, plan.config(model, seed),
                                                 plan.world_size, reuse, log))
    return [aggregate(m, MODELS[m].label, summaries[m]) for m in plan.models]


# ----------------------------------------------------------------------------------------------------
# Outputs


def settings_lines(plan: Plan) -> List[str]:
    c = plan.config(plan.models[0], plan.seeds[0])
    task = build_task(c.task)
    source = getattr(task, "source", c.task.name)
    return [
        f"- task: `{plan.task}` ({source}), {task.size('train')} train / {task.size('test')} test samples "
        f"(split seed {c.task.seed})",
        f"- model: dim {c.model.dim}, {c.model.num_layers} blocks, {c.model.num_heads} heads, FFN/expert dim "
        f"{c.model.ffn_dim}, MoE in blocks {list(c.model.moe_layers)}, {c.moe.num_experts} experts each "
        f"(DynMoE: {c.moe.min_experts}..{c.moe.max_experts})"
        + (f", patch {c.model.patch_size}" if plan.task == "vit-mnist" else ""),
        f"- training: {plan.epochs} epochs x {plan.steps_per_epoch} steps, batch {c.train.global_batch_size}, "
        f"AdamW lr {c.train.lr:g} (warm-up {c.train.warmup_steps} steps, cosine to {c.train.min_lr_ratio:g}x), "
        f"weight decay {c.train.weight_decay:g}, {c.train.precision}",
        f"- seeds: {', '.join(map(str, plan.seeds))}; world size {plan.world_size}",
        f"- extra overrides: {' '.join(plan.overrides) if plan.overrides else 'none'}; DynMoE runs only: "
        f"{' '.join(plan.dynmoe_overrides) if plan.dynmoe_overrides else 'none'}",
    ]


def results_markdown(plan: Plan, rows: Sequence[ModelRow], command: str, wall_s: float) -> str:
    seeds = len(plan.seeds)
    spread = f"mean ± sample std over {seeds} seeds" if seeds > 1 else "one seed"
    run_minutes = sum(run.wall_s for row in rows for run in row.runs) / 60
    return "\n".join([
        f"# DynMoE vs top-k on {plan.task}", "",
        f"Command (this invocation {wall_s / 60:.1f} min; the {sum(len(r.runs) for r in rows)} runs' own wall times "
        f"add up to {run_minutes:.1f} min, reused runs included):", "",
        f"    {command}", "", *settings_lines(plan), "",
        f"Test accuracy (%) after each epoch ({spread}; best of each column in bold):", "",
        markdown_table(rows), "",
        "- mean k: experts per token, averaged over the MoE layers and every training step; "
        "final k: the same over the last epoch only. Both count a token that selected no expert as 0.",
        "- eval k: experts per token at the final evaluation, where a DynMoE token that selects no expert "
        "falls back to its top-1 expert (moe.eval_k0 = 'top1').",
        "- k=0 %: share of the last epoch's training tokens (all MoE layers) that selected no expert and "
        "so skipped the MoE layer (moe.train_k0 = 'zero', the reference behaviour).",
        "- experts: experts per MoE layer at the end of training (top-k models keep theirs).",
        "- wall s: seconds per run (training plus the per-epoch evaluations).", "",
        "![comparison](comparison.png)", ""])


def write_outputs(plan: Plan, rows: Sequence[ModelRow], command: str, wall_s: float) -> Dict[str, Path]:
    from .plots import draw_comparison

    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "json": out / "results.json", "png": out / "comparison.png"}
    paths["md"].write_text(results_markdown(plan, rows, command, wall_s))
    settings = {"task": plan.task, "models": plan.models, "seeds": plan.seeds, "epochs": plan.epochs,
                "steps_per_epoch": plan.steps_per_epoch, "world_size": plan.world_size,
                "overrides": plan.overrides, "dynmoe_overrides": plan.dynmoe_overrides, "command": command, "wall_s": wall_s,
                "config_of_first_run": plan.config(plan.models[0], plan.seeds[0]).to_dict()}
    paths["json"].write_text(json.dumps({"settings": settings, "models": [r.to_dict() for r in rows]}, indent=1))
    draw_comparison(rows, paths["png"], title=f"{plan.task}: {len(rows)} models, {plan.epochs} epochs, "
                                                           f"{len(plan.seeds)} seed(s)")
    return paths


# ----------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="vit-mnist", help=f"one of {', '.join(TASK_PRESETS)} (default vit-mnist)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs of every run (default 10)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2: mean ± std "
                   "over three seeds, about 10 min for the default models on one CPU core; '0' for a quick look)")
    p.add_argument("--models", default="default", help="comma-separated subset of: " + ", ".join(MODELS)
                   + "; 'default' = all but dynmoe-random (the paper's rows), 'all' = every model")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--world-size", type=int, default=1, help="simulated gloo ranks per run (default 1: "
                   "one process, the cheapest on a small machine; results agree across world sizes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a run option for every model (repeatable), e.g. --set train.lr=0.001")
    p.add_argument("--dynmoe-set", dest="dynmoe_overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a run option for the DynMoE models only "
                   "(repeatable), e.g. --dynmoe-set 'moe.aux_losses=[\"diverse\", \"simple\"]' (the original "
                   "paper's losses; top-k keeps its switch loss)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in this process (default 1)")
    p.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="re-run even runs whose directory holds a finished run of the same config")


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m dynmoe_dist.experiments compare") -> Dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as err:
        parser.error(str(err))
    import torch
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = run_plan(plan, reuse=args.reuse)
    command = f"{prog} {shlex.join(argv)}".strip()
    paths = write_outputs(plan, rows, command, time.perf_counter() - started)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"plan": plan, "rows": rows, "paths": paths}

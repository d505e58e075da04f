"""The paper comparison in miniature: a dense model, top-k (k = 1, 2, 4, 8), top-p and DynMoE with each
expert-init strategy and each loss set (experiments/models.py).

    python -m dynmoe_dist.experiments compare --task vit-mnist [--epochs 10] [--seeds 0,1,2,3,4] [--out DIR]

Every model gets the same budget: the same task split, model, epochs, batch size, lr schedule and seed
set; only the router (and, for DynMoE, the expert-init strategy and losses) differs. Every epoch end is
evaluated; DynMoE models are evaluated once more with moe.eval_k0 = 'skip'. Writes, under --out:
runs/<model>/seed<s>/ (each run's metrics.jsonl), results.md (the table in the shape of
docs/algorithm.md section 6, paired tests against the best top-k, dense and top-p, the skip
evaluation), results.json and comparison.png.
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import RunConfig, load_config, parse_override
from ..tasks import build_task
from ..train.telemetry import METRICS_FILE, read_metrics
from .models import DEFAULT_MODELS, MODELS, ModelSpec
from .probe import FIELDS, RoutingProbe, add_totals, routing_summary
from .stats import expert_flops_per_token
from .summary import (
    ModelRow,
    RunSummary,
    aggregate,
    markdown_table,
    paired_results,
    paired_table,
    skip_table,
    summarise_run,
)

CONFIG_FILE = "config.toml"
ROUTING_FILE = "routing.json"


# The paper's vision setup in miniature (2 MoE layers of 8 experts in a small ViT, 16 patches per image);
# sized so that the eight default models x 10 epochs x 3 seeds take about 10 minutes on one CPU thread.
# lr: top-2 (seed 0, 10 epochs) reached 85.8 / 89.5 / 91.4 / 91.5 % at 0.001 / 0.002 / 0.004 / 0.008;
# 0.004 is the lower of the two tied best. Tuned on a baseline, not on DynMoE.
TASK_PRESETS: Dict[str, Tuple[str, ...]] = {
    "vit-mnist": (
        "model.dim=64",
        "model.num_heads=4",
        "model.num_layers=4",
        "model.ffn_dim=128",
        "model.moe_layers=[1, 3]",
        "model.patch_size=7",
        "moe.num_experts=8",
        "train.global_batch_size=64",
        "train.lr=0.004",
        "train.warmup_steps=30",
    ),
    # The upcycled finetune of launcher/configs/quickstart_long.toml, shortened for 16 models x 5 seeds:
    # layers 0-3 and the embeddings frozen (the quickstart's note: half the time, about one point),
    # max_len 48 instead of 64 (truncates 4.6% of the training snippets, 64 truncates 0.1%; padding is
    # routed too, so cost grows with max_len), 8 experts in layers 4 and 5 (the other tasks' count),
    # 1 epoch instead of 2 (TASK_EPOCHS). CPU time per step: 0.65 s dense, 0.83 s top-2, 2.2 s top-8.
    "minilm-sentiment": (
        "task.max_len=48",
        "model.num_layers=6",
        "model.moe_layers=[4, 5]",
        "model.freeze=['embeddings', 'layers.0', 'layers.1', 'layers.2', 'layers.3']",
        "moe.num_experts=8",
        "train.global_batch_size=32",
        "train.lr=5e-5",
        "train.warmup_steps=20",
    ),
    "synthetic": (
        "task.num_samples=2048",
        "task.max_len=16",
        "model.dim=32",
        "model.num_layers=2",
        "model.ffn_dim=64",
        "model.moe_layers=[0, 1]",
        "moe.num_experts=8",
        "train.global_batch_size=32",
        "train.lr=0.003",
    ),
}
# --epochs when not given: from scratch needs many, an upcycled finetune few.
TASK_EPOCHS = {"vit-mnist": 10, "minilm-sentiment": 1, "synthetic": 10}
DEFAULT_SEEDS = "0,1,2,3,4"
# Set per model or per run by compare itself: an override of these would break "same budget" or the
# per-epoch evaluation the table is built from.
RESERVED_KEYS = (
    "task.name",
    "moe.router",
    "moe.top_k",
    "adaptive.enabled",
    "adaptive.expert_init",
    "train.epochs",
    "train.max_steps",
    "train.seed",
    "train.eval_every",
    "output.out_dir",
    "output.resume",
)


def parse_models(text: str) -> List[str]:
    """'top2,dynmoe-average' -> names in the given order; 'all' -> every model; 'default' -> every model
    but those make_plan finds to duplicate another's config."""
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
            raise ValueError(
                f"--set {text}: {section}.{key} is set by compare itself "
                f"(use --task / --epochs / --seeds / --out / --models instead)"
            )


def build_config(
    task: str,
    spec: ModelSpec,
    seed: int,
    epochs: int,
    out_dir: Path,
    overrides: Sequence[str] = (),
    eval_every: int = 0,
    dynmoe_overrides: Sequence[str] = (),
) -> RunConfig:
    """One run's config: task preset < --set < --dynmoe-set (DynMoE runs only) < the model's router < the
    run's own fields."""
    if task not in TASK_PRESETS:
        raise ValueError(f"--task ({task!r}) must be one of {', '.join(TASK_PRESETS)}")
    check_overrides([*overrides, *dynmoe_overrides])
    if spec.is_dynmoe:
        overrides = [*overrides, *dynmoe_overrides]
    own = [
        f"task.name='{task}'",
        f"train.epochs={epochs}",
        f"train.seed={seed}",
        f"train.eval_every={eval_every}",
        f"output.out_dir='{run_dir(out_dir, spec.name, seed).as_posix()}'",
        "output.progress=false",
        "output.tensorboard=false",
    ]
    return load_config(None, [*TASK_PRESETS[task], "output.report=false", *overrides, *spec.overrides, *own])


def run_dir(out_dir: Path, model: str, seed: int) -> Path:
    return Path(out_dir) / "runs" / model / f"seed{seed}"


def steps_per_epoch(config: RunConfig) -> int:
    """Optimizer steps per epoch of this config's task (the same for every model of a comparison)."""
    return build_task(config.task).size("train") // config.train.global_batch_size


# ----------------------------------------------------------------------------------------------------
# Running


def _run_on_rank(config: RunConfig) -> Dict:
    """run(config) with a RoutingProbe on the model; returns this rank's probe counts and, for top-any
    layers, the final model re-evaluated with eval_k0 = 'skip'."""
    from ..train.loop import Trainer
    from ..train.run import run

    trainer = Trainer(config)
    probe = RoutingProbe.attach(trainer.model)
    run(config, trainer=trainer)
    totals = probe.totals()  # before the extra evaluation: the table's eval k is the configured one's
    return {"probe": totals, "skip": skip_evaluation(trainer, probe, totals)}


def skip_evaluation(trainer, probe: RoutingProbe, before: Dict[str, List[float]]) -> Optional[Dict]:
    """Accuracy with eval_k0 = 'skip' (a k = 0 token passes the layer on the residual alone) and, per layer,
    the test tokens that skipped it; None without top-any layers. The layers' eval_k0 is restored after:
    it is the run's own config object, and the run's config.toml is written after this."""
    layers = [layer for layer in trainer.moe_layers if layer.config.router == "top_any"]
    if not layers:
        return None
    saved = [layer.config.eval_k0 for layer in layers]
    try:
        for layer in layers:
            layer.config.eval_k0 = "skip"
        accuracy = trainer.evaluate()["test_accuracy"]
    finally:
        for layer, value in zip(layers, saved):
            layer.config.eval_k0 = value
    # The probe adds consecutive evaluations: the skip pass is the difference.
    after = probe.totals()
    delta = {name: [a - b for a, b in zip(after[name], before[name])] for name in ("eval_tokens", "eval_fallback")}
    return {"accuracy": 100.0 * accuracy, "tokens": delta["eval_tokens"], "skipped": delta["eval_fallback"]}


def _merge_ranks(per_rank: List[Dict]) -> Dict:
    """Probe and skip counts summed over ranks; the accuracy is already global (evaluate reduces it)."""
    merged = {"probe": add_totals([r["probe"] for r in per_rank]), "skip": per_rank[0]["skip"]}
    if merged["skip"] is not None:
        for name in ("tokens", "skipped"):
            merged["skip"][name] = [sum(v) for v in zip(*(r["skip"][name] for r in per_rank))]
    return merged


def train(config: RunConfig, world_size: int) -> Dict:
    """One run in this process (world size 1) or on simulated gloo ranks (one process per rank); returns
    the routing probe's counts summed over ranks and the skip evaluation."""
    if world_size == 1:
        return _run_on_rank(config)
    from ..parallel.simulate import run_simulated

    # No overall deadline worth having: a long comparison is long; collectives still time out.
    per_rank = run_simulated(
        _run_on_rank,
        world_size,
        args=(config,),
        timeout_s=7 * 24 * 3600.0,
        collective_timeout_s=config.parallel.timeout_s,
    )
    return _merge_ranks(per_rank)


def routing_of(saved: Dict) -> Dict[str, Any]:
    """routing.json -> the RunSummary fields it gives (probe shares, skip evaluation). A routing.json of an
    earlier version holds the bare probe counts and no skip evaluation: still read."""
    probe = saved.get("probe", saved)
    out: Dict[str, Any] = dict(routing_summary({name: probe[name] for name in FIELDS}))
    skip = saved.get("skip")
    if skip:
        out["skip_accuracy"] = skip["accuracy"]
        out["skip_share_per_layer"] = [s / t if t else float("nan") for s, t in zip(skip["skipped"], skip["tokens"])]
    return out


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


def run_or_reuse(spec: ModelSpec, seed: int, config: RunConfig, world_size: int, reuse: bool, log=_log) -> RunSummary:
    folder = Path(config.output.out_dir)
    if reuse and finished(config):
        log(f"{spec.name} seed {seed}: reusing the finished run in {folder}")
    else:
        # metrics.jsonl is appended to: a stale or half-finished run must not leak into this one.
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        (folder / ROUTING_FILE).write_text(json.dumps(train(config, world_size)))
        # Written last: its presence (with the same text) marks a finished run that may be reused.
        (folder / CONFIG_FILE).write_text(config.to_toml())
        log(f"{spec.name} seed {seed}: done in {time.perf_counter() - started:.0f}s")
    routing = routing_of(json.loads((folder / ROUTING_FILE).read_text()))
    summary = summarise_run(spec.name, seed, read_metrics(folder / METRICS_FILE), routing)
    log(
        f"  test accuracy by epoch {[round(a, 2) for a in summary.test_accuracy]}, mean k {summary.mean_k:.2f}, "
        f"k=0 share {summary.train_k0_share:.2f}, eval k {summary.eval_k:.2f}, experts {summary.num_experts}"
    )
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
        return build_config(
            self.task,
            MODELS[model],
            seed,
            self.epochs,
            self.out_dir,
            self.overrides,
            eval_every=self.steps_per_epoch,
            dynmoe_overrides=self.dynmoe_overrides,
        )


def training_key(config: RunConfig) -> str:
    """What decides the training of a run: the config without the output section and without the preset's
    name (a preset only fills in values, which stay in the key)."""
    data = {k: v for k, v in config.to_dict().items() if k != "output"}
    data["moe"] = {k: v for k, v in data["moe"].items() if k != "preset"}
    return json.dumps(data, sort_keys=True, default=str)


def without_duplicates(models: Sequence[str], config_of) -> List[str]:
    """Models whose training differs from every earlier model's (training_key): the same config trains the
    same run, so 'default' runs it once."""
    kept, seen = [], set()
    for model in models:
        key = training_key(config_of(model))
        if key not in seen:
            kept.append(model)
            seen.add(key)
    return kept


def make_plan(args) -> Plan:
    epochs = TASK_EPOCHS.get(args.task, 10) if args.epochs is None else args.epochs
    if epochs < 1:
        raise ValueError(f"--epochs ({epochs}) must be >= 1")
    if args.world_size < 1:
        raise ValueError(f"--world-size ({args.world_size}) must be >= 1")
    models, seeds = parse_models(args.models), parse_seeds(args.seeds)
    first = build_config(args.task, MODELS[models[0]], seeds[0], epochs, Path(args.out), args.overrides)
    plan = Plan(
        args.task,
        models,
        seeds,
        epochs,
        Path(args.out),
        list(args.overrides),
        args.world_size,
        steps_per_epoch(first),
        list(args.dynmoe_overrides),
    )
    for model in models:  # every config must validate before hours of training start
        for seed in seeds:
            plan.config(model, seed)
    if args.models.strip() == "default":
        plan.models = without_duplicates(models, lambda m: plan.config(m, seeds[0]))
    return plan


def ffn_shape(config: RunConfig) -> Tuple[int, int]:
    """(D, F) of one expert / dense FFN: the model section's, or the pre-trained MiniLM block's."""
    if config.task.name == "minilm-sentiment":
        from ..models.hf.minilm import ffn_shape as pretrained_ffn_shape
        from ..tasks.assets import minilm_dir

        return pretrained_ffn_shape(minilm_dir())
    return config.model.dim, config.model.ffn_dim


def attach_cost(row: ModelRow, family: str, shape: Tuple[int, int], num_positions: int) -> ModelRow:
    """Expert FLOPs per token (stats.expert_flops_per_token). The dense model runs one FFN of the same
    shape where the others have an MoE layer: k = 1 there."""
    dim, ffn_dim = shape
    if family == "dense":
        row.flops_train = row.flops_eval = expert_flops_per_token([1.0] * num_positions, dim, ffn_dim)
        return row
    per_layer = np.mean([r.mean_k_per_layer for r in row.runs], axis=0)
    row.flops_train = expert_flops_per_token(per_layer, dim, ffn_dim)
    # eval k is a mean over layers that all see every test token: the layers' sum is eval k x layers.
    row.flops_eval = expert_flops_per_token([row.eval_k] * len(per_layer), dim, ffn_dim)
    return row


def run_plan(plan: Plan, reuse: bool = True, log=_log) -> List[ModelRow]:
    """Every (seed, model) run, seeds outermost so an interrupted comparison has whole seeds done."""
    summaries: Dict[str, List[RunSummary]] = {m: [] for m in plan.models}
    for seed in plan.seeds:
        for model in plan.models:
            summaries[model].append(
                run_or_reuse(MODELS[model], seed, plan.config(model, seed), plan.world_size, reuse, log)
            )
    reference = build_config(plan.task, MODELS["top1"], plan.seeds[0], plan.epochs, plan.out_dir, plan.overrides)
    shape, positions = ffn_shape(reference), len(reference.model.moe_layers)
    return [
        attach_cost(aggregate(m, MODELS[m].label, summaries[m], MODELS[m].family), MODELS[m].family, shape, positions)
        for m in plan.models
    ]


# ----------------------------------------------------------------------------------------------------
# Outputs


def model_line(c: RunConfig) -> str:
    """The model of a run config: the built model's shape, or the pre-trained MiniLM's (ffn_shape)."""
    dim, ffn_dim = ffn_shape(c)
    if c.task.name == "minilm-sentiment":
        shape = f"pre-trained all-MiniLM-L6-v2 (dim {dim}, FFN/expert dim {ffn_dim}), first {c.model.num_layers} layers"
        shape += f", frozen: {', '.join(c.model.freeze) or 'none'}"
    else:
        shape = f"dim {dim}, {c.model.num_layers} blocks, {c.model.num_heads} heads, FFN/expert dim {ffn_dim}"
    return (
        f"- model: {shape}, MoE in blocks {list(c.model.moe_layers)}, {c.moe.num_experts} experts each "
        f"(DynMoE: {c.moe.min_experts}..{c.moe.max_experts})"
        + (f", patch {c.model.patch_size}" if c.task.name == "vit-mnist" else "")
    )


def settings_lines(plan: Plan) -> List[str]:
    # An MoE model's config: the dense model's has no MoE layers to describe.
    c = build_config(plan.task, MODELS["top1"], plan.seeds[0], plan.epochs, plan.out_dir, plan.overrides)
    task = build_task(c.task)
    source = getattr(task, "source", c.task.name)
    return [
        f"- task: `{plan.task}` ({source}), {task.size('train')} train / {task.size('test')} test samples "
        f"(split seed {c.task.seed})",
        model_line(c),
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
    return "\n".join(
        [
            f"# DynMoE vs top-k on {plan.task}",
            "",
            f"Command (this invocation {wall_s / 60:.1f} min; the {sum(len(r.runs) for r in rows)} runs' own wall "
            f"times add up to {run_minutes:.1f} min, reused runs included):",
            "",
            f"    {command}",
            "",
            *settings_lines(plan),
            "",
            f"Test accuracy (%) after each epoch ({spread}; best of each column in bold):",
            "",
            markdown_table(rows),
            "",
            "- mean k: experts per token, averaged over the MoE layers and every training step; "
            "final k: the same over the last epoch only. Both count a token that selected no expert as 0.",
            "- eval k: experts per token at the final evaluation, where a DynMoE token that selects no expert "
            "falls back to its top-1 expert (moe.eval_k0 = 'top1').",
            "- k=0 %: share of the last epoch's training tokens (all MoE layers) that selected no expert and "
            "so skipped the MoE layer (moe.train_k0 = 'zero', the reference behaviour).",
            "- experts: experts per MoE layer at the end of training (top-k models keep theirs).",
            "- kFLOP/token: expert FLOPs per token summed over the MoE layers, k x 4 x D x F per layer (two "
            "matmuls D x F and F x D = 2 D F multiply-adds per selected expert); train at the mean k of "
            "training, eval at the eval k. The dense model counts its FFN (same D x F) as k = 1 where the "
            "others have MoE layers. Router, attention and dispatch are left out.",
            "- reaches best top-k: the first epoch at which the model's mean accuracy reaches the final mean "
            "accuracy of the best top-k row ('never' if it does not).",
            "- ms/step: wall time of one run divided by its optimizer steps (per-epoch evaluations included).",
            "",
            *paired_section(rows),
            *skip_section(rows),
            "![comparison](comparison.png)",
            "",
        ]
    )


def paired_section(rows: Sequence[ModelRow]) -> List[str]:
    table = paired_table(rows)
    if not table:
        return []
    return [
        "Final accuracy of each DynMoE model minus the reference, paired by seed (points): mean "
        "difference, 95% confidence interval of the paired t over seeds, two-sided p:",
        "",
        table,
        "",
    ]


def skip_section(rows: Sequence[ModelRow]) -> List[str]:
    table = skip_table(rows)
    if not table:
        return []
    return [
        'The final DynMoE models evaluated again with `moe.eval_k0 = "skip"` (a token that selects no '
        "expert passes the layer on the residual alone) against the default top-1 fallback "
        "(means over seeds):",
        "",
        table,
        "",
    ]


def write_outputs(plan: Plan, rows: Sequence[ModelRow], command: str, wall_s: float) -> Dict[str, Path]:
    from .plots import draw_comparison

    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "json": out / "results.json", "png": out / "comparison.png"}
    paths["md"].write_text(results_markdown(plan, rows, command, wall_s))
    settings = {
        "task": plan.task,
        "models": plan.models,
        "seeds": plan.seeds,
        "epochs": plan.epochs,
        "steps_per_epoch": plan.steps_per_epoch,
        "world_size": plan.world_size,
        "overrides": plan.overrides,
        "dynmoe_overrides": plan.dynmoe_overrides,
        "command": command,
        "wall_s": wall_s,
        "config_of_first_run": plan.config(plan.models[0], plan.seeds[0]).to_dict(),
    }
    paths["json"].write_text(
        json.dumps(
            {"settings": settings, "models": [r.to_dict() for r in rows], "paired": paired_results(rows)}, indent=1
        )
    )
    draw_comparison(
        rows, paths["png"], title=f"{plan.task}: {len(rows)} models, {plan.epochs} epochs, {len(plan.seeds)} seed(s)"
    )
    return paths


# ----------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="vit-mnist", help=f"one of {', '.join(TASK_PRESETS)} (default vit-mnist)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="training epochs of every run (default per task: "
        + ", ".join(f"{t} {e}" for t, e in TASK_EPOCHS.items())
        + ")",
    )
    p.add_argument(
        "--seeds",
        default=DEFAULT_SEEDS,
        help=f"comma-separated training seeds (default {DEFAULT_SEEDS}:"
        " mean ± std and paired tests over five seeds; '0' for a quick look)",
    )
    p.add_argument(
        "--models",
        default="default",
        help="comma-separated subset of: "
        + ", ".join(MODELS)
        + "; 'default' = every model, a duplicate config run once; 'all' = every model",
    )
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="simulated gloo ranks per run (default 1: "
        "one process, the cheapest on a small machine; results agree across world sizes)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a run option for every model (repeatable), e.g. --set train.lr=0.001",
    )
    p.add_argument(
        "--dynmoe-set",
        dest="dynmoe_overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a run option for the DynMoE models only "
        '(repeatable), e.g. --dynmoe-set \'moe.aux_losses=["diverse", "simple"]\' (the original '
        "paper's losses; top-k keeps its switch loss)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in this process (default 1)")
    p.add_argument(
        "--no-reuse",
        dest="reuse",
        action="store_false",
        help="re-run even runs whose directory holds a finished run of the same config",
    )


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

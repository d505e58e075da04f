"""`moe-finetune`'s outputs: OUT/results.md (the section for docs/results.md) and OUT/results.json."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Sequence

from .moe_report import (
    END_SHARE,
    FLOPS_GOAL,
    LOSS_GOAL,
    REMOVED_GOAL,
    Spread,
    VariantRow,
    goal_check,
    paired_loss,
)

STEP0_LABELS = {
    "native": "native top-k",
    "top-any-equal": "top-any, combine 'equal' (1/k)",
    "top-any-softmax": "top-any, combine 'softmax' (router probabilities)",
}


def _row(rows: Sequence[VariantRow], variant: str) -> VariantRow:
    return next(r for r in rows if r.variant == variant)


def _ms(spread: Spread) -> str:
    return spread.cell(2)


def _layers(values: Sequence[float]) -> str:
    return "/".join(f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}" for v in values) or "-"


def step0_table(step0_by_seed: Dict[int, Dict[str, Any]], chosen: str) -> str:
    lines = ["| model | held-out loss at step 0 | eval k at step 0 |", "|---|---|---|"]
    for name, label in STEP0_LABELS.items():
        loss = Spread.of([s[name]["test_loss"] for s in step0_by_seed.values()])
        k = Spread.of([sum(s[name]["eval_k"]) / len(s[name]["eval_k"]) for s in step0_by_seed.values()])
        mark = " (chosen)" if name == f"top-any-{chosen}" else ""
        lines.append(f"| {label}{mark} | {loss.cell()} | {k.cell(2)} |")
    return "\n".join(lines)


def finetune_table(rows: Sequence[VariantRow]) -> str:
    head = (
        "| variant | held-out loss | 95 % CI | loss at step 0 | k train / end / eval | experts per layer (end) "
        "| removed / added | expert MFLOP/token | vs native | ms/token (export) | ms/token (pre-trained) |"
    )
    lines = [head, "|---" * 11 + "|"]
    for r in rows:
        k = f"{r.train_k.mean:.2f} / {r.end_k.mean:.2f} / {r.eval_k.mean:.2f}"
        cells = [
            r.label,
            r.test_loss.cell(),
            r.test_loss.interval(),
            r.step0_loss.cell(),
            k,
            _layers(r.experts_end),
            f"{r.removed.mean:.1f} / {r.added.mean:.1f}",
            r.flops_mflop.cell(2),
            r.flops_ratio.cell(2),
            _ms(r.per_token_ms),
            _ms(r.base_per_token_ms),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_per_layer(lists: Sequence[Sequence[float]]) -> List[float]:
    return [sum(values) / len(values) for values in zip(*lists)]


def layer_table(rows: Sequence[VariantRow], step0_by_seed: Dict[int, Dict[str, Any]], combine: str) -> str:
    """Per MoE layer (means over seeds): k at step 0 and at the end, experts at the start and the end, and
    what the events removed and added: where the FLOPs and the pruning came from, or did not."""
    lines = [
        "| variant | layer | eval k at step 0 | eval k at the end | experts start -> end | removed | added |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        start_model = "native" if row.variant == "native" else f"top-any-{combine}"
        k0 = _mean_per_layer([s[start_model]["eval_k"] for s in step0_by_seed.values()])
        k_end = _mean_per_layer([r.eval_k for r in row.runs])
        start, removed, added = (
            _mean_per_layer([getattr(r, name) for r in row.runs]) for name in ("experts_start", "removed", "added")
        )
        for layer, k_start in enumerate(k0):
            lines.append(
                f"| {row.label} | {layer} | {k_start:.2f} | {k_end[layer]:.2f} | {start[layer]:.0f} -> "
                f"{row.experts_end[layer]:.1f} | {removed[layer]:.1f} | {added[layer]:.1f} |"
            )
    return "\n".join(lines)


def paired_rows(rows: Sequence[VariantRow]) -> List[Dict[str, Any]]:
    """Every top-any variant's held-out loss minus native's, paired by seed (pruned first: the goal's)."""
    native = _row(rows, "native")
    out = []
    for row in sorted((r for r in rows if r is not native), key=lambda r: r.variant != "top-any-pruned"):
        result = paired_loss(row, native)
        out.append({"comparison": f"{row.variant} - native", "result": result.to_dict() if result else None})
    return out


def paired_table(rows: Sequence[VariantRow]) -> str:
    lines = ["| held-out loss | mean difference | 95 % CI | p |", "|---|---|---|---|"]
    for item in paired_rows(rows):
        r = item["result"]
        if r is None:
            lines.append(f"| {item['comparison']} | - (needs 2 seeds) | - | - |")
        else:
            ci = f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]"
            lines.append(f"| {item['comparison']} | {r['mean_diff']:+.4f} | {ci} | {r['p_value']:.3f} |")
    return "\n".join(lines)


def goal_lines(goal: Dict[str, Any]) -> List[str]:
    def mark(ok: bool) -> str:
        return "yes" if ok else "**no**"

    return [
        f"- held-out loss within the native finetune's seed spread ({LOSS_GOAL}): "
        f"{mark(goal['loss_within_native_spread'])} (difference {goal['loss_diff']:+.4f}, native std "
        f"{goal['native_loss_std']:.4f})",
        f"- expert FLOPs at most {100 * FLOPS_GOAL:.0f} % of native's: {mark(goal['flops_at_most_85_percent'])} "
        f"({100 * goal['flops_ratio']:.1f} %)",
        f"- at least {100 * REMOVED_GOAL:.0f} % of the experts removed (net of added ones): "
        f"{mark(goal['at_least_20_percent_removed'])} ({100 * goal['removed_share']:.1f} %)",
        f"- **goal {'met' if goal['met'] else 'not met'}**",
    ]


def failure_lines(rows: Sequence[VariantRow]) -> List[str]:
    lines = []
    for r in (run for row in rows for run in row.runs):
        for what, error in (("export", r.export_error), ("generation timing", r.generate_error)):
            if error and not (what == "generation timing" and r.export_error):
                lines.append(f"- {r.variant} seed {r.seed}: {what} failed: {error}")
    return ["Failed (rerun the command to retry them; training is reused):", "", *lines, ""] if lines else []


def settings_lines(plan, outcome: Dict[str, Any]) -> List[str]:
    info, shape, s = plan.model_info, outcome["shape"], plan.sizes
    pretrain_file = plan.model / "pretrain.json"
    lines = [
        f"- model: `{plan.model}` ({info['model_type']}, {info['num_experts']} experts per MoE layer, top-"
        f"{info['top_k']}, expert D x F = {shape['dim']} x {shape['ffn_dim']}, {shape['matmuls']} matmuls per expert)",
    ]
    if pretrain_file.is_file():
        p = json.loads(pretrain_file.read_text())
        lines.append(
            f"- pre-training (`pretrain-moe`): {p['corpus_mb']} MB of docstrings, {p['steps']} steps, "
            f"{p['tokens_trained']} tokens, held-out loss {p['test_loss']:.4f}, {p['parameters']} parameters"
        )
    lines += [
        f"- finetune: Rotten Tomatoes snippets ({s.num_samples or 'all'}; 20 % of them held out, split seed "
        f"1234), windows of {s.max_len} tokens, batch {s.batch}, {s.epochs:g} epochs, AdamW lr {s.lr:g} "
        f"(warm-up {s.warmup_steps}), {s.world_size} simulated ranks, expert parallel",
        f"- seeds: {', '.join(map(str, plan.seeds))}; top-any combine rule: '{outcome['combine']}'",
    ]
    return lines


def results_markdown(plan, outcome: Dict[str, Any], command: str, wall_s: float) -> str:
    rows, spread = outcome["rows"], f"mean ± sample std over {len(plan.seeds)} seed(s)"
    goal = goal_check(_row(rows, "native"), _row(rows, "top-any-pruned"))
    return "\n".join(
        [
            f"Command (this invocation {wall_s / 60:.1f} min):",
            "",
            f"    {command}",
            "",
            *settings_lines(plan, outcome),
            "",
            f"Right after conversion, before any step ({spread}):",
            "",
            step0_table(outcome["step0"], outcome["combine"]),
            "",
            f"After finetuning ({spread}; the interval is the 95 % t interval of the mean):",
            "",
            finetune_table(rows),
            "",
            f"- k: experts per token and MoE layer, averaged over the layers; train: every step; end: the last "
            f"{100 * END_SHARE:.0f} % of the steps (a k = 0 token counts 0); eval: the final evaluation, a "
            "k = 0 token falling back to its top-1 expert: what the export computes.",
            "- expert MFLOP/token: eval k x matmuls x 2 D F, summed over the MoE layers; vs native: the same "
            "over the native model's top-k. FLOPs follow k, not how many experts a layer holds: a removed "
            "expert nobody routed to saves memory, not compute. Router, attention and dispatch left out.",
            "- removed / added: experts the adaptive events removed and added, summed over the layers.",
            "- ms/token: one cached decode step of the export (`bench generate`, median of its repeats), and "
            "of the pre-trained model timed in the same command.",
            "",
            "Per MoE layer (means over the seeds):",
            "",
            layer_table(rows, outcome["step0"], outcome["combine"]),
            "",
            "Paired by seed (the same data order and held-out split):",
            "",
            paired_table(rows),
            "",
            "The goal (the pruned top-any model against the native finetune):",
            "",
            *goal_lines(goal),
            "",
            *failure_lines(rows),
        ]
    )


def finite(value: Any) -> Any:
    """JSON has no NaN: None instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_outputs(plan, outcome: Dict[str, Any], command: str, wall_s: float) -> Dict[str, Path]:
    rows = outcome["rows"]
    plan.out.mkdir(parents=True, exist_ok=True)
    paths = {"md": plan.out / "results.md", "json": plan.out / "results.json"}
    paths["md"].write_text(results_markdown(plan, outcome, command, wall_s))
    report = {
        "command": command,
        "wall_s": wall_s,
        "model": str(plan.model),
        "model_info": plan.model_info,
        "shape": outcome["shape"],
        "sizes": asdict(plan.sizes),
        "seeds": plan.seeds,
        "combine": outcome["combine"],
        "step0": {str(seed): models for seed, models in outcome["step0"].items()},
        "variants": [r.to_dict() for r in rows],
        "paired": paired_rows(rows),
        "goal": goal_check(_row(rows, "native"), _row(rows, "top-any-pruned")),
    }
    paths["json"].write_text(json.dumps(finite(report), indent=1))
    return paths

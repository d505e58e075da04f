"""`python -m dynmoe_dist.experiments moe-lora --model DIR [--seeds 3] [--out OUT] [--tiny]`: does LoRA finetune a
pre-trained MoE as well as a full finetune, and at what memory?

On `pretrain-moe`'s model, with `moe-frontier`'s data, batch, epoch and held-out split (and its run folders: the
two full finetunes below are the frontier's own runs, reused when finished), per routing and seed:
  full            every weight trained with Adam at the frontier's lr (native-k2 / top-any-2 of moe-frontier)
  lora-r8         LoRA rank 8 (alpha 16) on the attention projections and every routed expert, the rest frozen
  lora-r32        rank 32 (alpha 64)
  qlora-r8        rank 8 with the frozen base stored NF4 (lora.base_dtype = 'nf4')
for the native top-2 routing and top-any at target k 2 with pruning (routers frozen: LoRA's default); and, to
choose what an expert added under LoRA is (lora.added_experts: 'copy', 'fresh_adapter', 'trainable'), top-any
LoRA r 8 with DynMoE's full events (removals and adds). Held-out
loss with its spread and interval, paired differences against the full finetune, and each run's peak memory
(the largest rank's resident memory above what the process held before the model was built). Writes
OUT/lora.json and OUT/lora.md.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .frontier_report import experts_text
from .moe_frontier import PRUNING_ONLY, Variant, run_cli, variants
from .moe_markdown import finite
from .moe_report import VariantRow, paired_loss

LORA_LR = 2e-3
"""4x the full finetune's 5e-4: adapters start at zero (B = 0) and their updates are scaled by alpha / r, so
LoRA is usually run at several times a full finetune's rate (PEFT's and the LoRA paper's practice); not tuned
here."""
LORA_TARGETS = "['attention', 'routed_experts']"
# (tag, label, rank, base dtype)
ADAPTERS = (
    ("lora-r8", "LoRA r 8", 8, "run"),
    ("lora-r32", "LoRA r 32", 32, "run"),
    ("qlora-r8", "QLoRA r 8", 8, "nf4"),
)
FULL = {"native": "native-k2", "top-any": "top-any-2"}
"""The full finetune of each routing: moe-frontier's variant (the same config, so the same run folder)."""


ADDED_EXPERTS = ("copy", "fresh_adapter", "trainable")
"""lora.added_experts, compared on top-any runs whose adaptive events add experts (issue 30 item 3)."""


def lora_overrides(rank: int, base: str) -> Tuple[str, ...]:
    return (
        "lora.enabled=true",
        f"lora.rank={rank}",
        f"lora.alpha={2 * rank}",
        f"lora.targets={LORA_TARGETS}",
        f"lora.base_dtype='{base}'",
        f"train.lr={LORA_LR}",
    )


def lora_variants() -> List[Variant]:
    frontier = {v.name: v for v in variants()}
    found: List[Variant] = []
    for routing, full_name in FULL.items():
        full = frontier[full_name]
        found.append(replace(full, label=f"{routing}: full finetune", family=f"{routing}:full"))
        for tag, label, rank, base in ADAPTERS:
            name, overrides = f"{full_name}-{tag}", full.overrides + lora_overrides(rank, base)
            found.append(
                replace(full, name=name, label=f"{routing}: {label}", family=f"{routing}:{tag}", overrides=overrides)
            )
    return found + added_expert_variants(frontier[FULL["top-any"]])


def added_expert_variants(top_any: Variant) -> List[Variant]:
    """Top-any LoRA r 8 with DynMoE's full events (removals and adds; the budget places an added expert's
    threshold), once per lora.added_experts."""
    with_adds = tuple(o for o in top_any.overrides if o not in PRUNING_ONLY) + lora_overrides(8, "run")
    return [
        replace(
            top_any,
            name=f"{top_any.name}-adds-lora-r8-{added}",
            label=f"top-any: LoRA r 8, adds, added_experts '{added}'",
            family=f"top-any:adds-{added}",
            overrides=with_adds + (f"lora.added_experts='{added}'",),
        )
        for added in ADDED_EXPERTS
    ]


def full_of(row: VariantRow, rows: Sequence[VariantRow], families: Dict[str, str]) -> Optional[VariantRow]:
    routing = families[row.variant].split(":")[0]
    return next((r for r in rows if families[r.variant] == f"{routing}:full"), None)


def lora_table(rows: Sequence[VariantRow], families: Dict[str, str]) -> str:
    lines = [
        "| run | held-out loss | 95 % CI | vs full finetune (paired) | p | peak MiB | eval k | experts (end) "
        "| removed / added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        full = full_of(row, rows, families)
        paired = None if full is None or full is row else paired_loss(row, full)
        diff = "-" if paired is None else f"{paired.mean_diff:+.4f} [{paired.ci_low:+.4f}, {paired.ci_high:+.4f}]"
        p = "-" if paired is None else f"{paired.p_value:.3f}"
        experts = experts_text(row.experts_end)
        lines.append(
            f"| {row.label} | {row.test_loss.cell(4)} | {row.test_loss.interval(4)} | {diff} | {p} "
            f"| {row.peak_mib.cell(0)} | {row.eval_k.cell(2)} | {experts} "
            f"| {row.removed.cell(1)} / {row.added.cell(1)} |"
        )
    return "\n".join(lines)


def write_outputs(out: Path, outcome: Dict[str, Any], command: str, model_info: Dict[str, Any]) -> Dict[str, Path]:
    rows, families = outcome["rows"], outcome["families"]
    out.mkdir(parents=True, exist_ok=True)
    seeds = len(rows[0].seeds) if rows else 0
    md = "\n".join(
        [f"# LoRA and QLoRA against the full finetune (mean ± std over {seeds} seeds)", "", f"Command: `{command}`", ""]
        + [lora_table(rows, families), ""]
    )
    paths = {"json": out / "lora.json", "md": out / "lora.md"}
    paths["json"].write_text(
        json.dumps(
            finite({"command": command, "families": families, "variants": [r.to_dict() for r in rows]}), indent=1
        )
    )
    paths["md"].write_text(md)
    return paths


def main(argv: Optional[Sequence[str]] = None, prog: str = "moe-lora") -> Dict[str, Any]:
    return run_cli(argv, prog, __doc__ or "", lora_variants(), write_outputs)

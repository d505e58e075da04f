"""`moe-frontier`'s numbers: the baselines' frontier, the verdict at each top-any budget, the balance study, the
markdown and the figure. Pure (numpy, matplotlib's Agg canvas): tested on hand-made rows.

The verdict (issue 31): **top-any pays at a budget if its held-out loss there is below the line joining the
baselines' best points around it, by more than the seeds' spread.** The baselines' best points are those no
other baseline beats on both axes (lower or equal expert FLOPs and lower or equal loss) and that lie on the
lower convex hull of the baselines (a point above the segment joining two others is beaten by mixing them); the
line joins the nearest such point at or below top-any's FLOPs and the nearest at or above, and is read at
top-any's FLOPs.
"By more than the seeds' spread": the gap exceeds top-any's seed std plus the line's (the two end points'
stds interpolated the same way). A budget outside the baselines' FLOPs range is reported, not judged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..train.report import matplotlib_canvas
from .moe_markdown import finite
from .moe_report import VariantRow, paired_loss

BASELINES = ("native", "top_p")
JUDGED = ("top_any", "top_any_top1")
"""The families whose every budget is judged against the baselines' line."""


@dataclass(frozen=True)
class Point:
    name: str
    label: str
    family: str
    flops: float
    """Expert FLOPs per token relative to the model's own top-k (mean over seeds)."""
    flops_std: float
    loss: float
    loss_std: float


def points(rows: Sequence[VariantRow], families: Dict[str, str]) -> List[Point]:
    return [
        Point(
            r.variant,
            r.label,
            families[r.variant],
            r.flops_ratio.mean,
            r.flops_ratio.std,
            r.test_loss.mean,
            r.test_loss.std,
        )
        for r in rows
    ]


def best_baselines(found: Sequence[Point]) -> List[Point]:
    """The baselines' best points, by increasing FLOPs: those no other baseline beats on both FLOPs and loss,
    and that lie on the lower convex hull of them all. A point above the segment joining two others is beaten
    by mixing those two (serving a share of the tokens with each), so the line through it would flatter
    top-any."""
    base = [p for p in found if p.family in BASELINES]
    undominated = sorted((p for p in base if not any(_beats(q, p) for q in base)), key=lambda p: (p.flops, p.loss))
    hull: List[Point] = []
    for p in undominated:
        while len(hull) >= 2 and not _below(hull[-2], hull[-1], p):
            hull.pop()
        hull.append(p)
    return hull


def _below(a: Point, b: Point, c: Point) -> bool:
    """b lies strictly below the segment from a to c (a, b, c by increasing FLOPs)."""
    return (b.flops - a.flops) * (c.loss - a.loss) - (b.loss - a.loss) * (c.flops - a.flops) > 0


def _beats(q: Point, p: Point) -> bool:
    return q is not p and q.flops <= p.flops and q.loss <= p.loss and (q.flops, q.loss) != (p.flops, p.loss)


@dataclass(frozen=True)
class Verdict:
    name: str
    flops: float
    loss: float
    loss_std: float
    left: Optional[str]
    right: Optional[str]
    line_loss: float
    """The baselines' line read at this FLOPs (NaN outside their range)."""
    line_std: float
    gap: float
    """line_loss - loss: > 0 means top-any is below the line."""
    pays: Optional[bool]
    """None: outside the baselines' FLOPs range, not judged."""


def judge(point: Point, best: Sequence[Point]) -> Verdict:
    left = max((b for b in best if b.flops <= point.flops), key=lambda b: b.flops, default=None)
    right = min((b for b in best if b.flops >= point.flops), key=lambda b: b.flops, default=None)
    if left is None or right is None:
        nan = math.nan
        return Verdict(
            point.name, point.flops, point.loss, point.loss_std, _name(left), _name(right), nan, nan, nan, None
        )
    share = 0.0 if right.flops == left.flops else (point.flops - left.flops) / (right.flops - left.flops)
    line = left.loss + share * (right.loss - left.loss)
    line_std = left.loss_std + share * (right.loss_std - left.loss_std)
    gap = line - point.loss
    pays = gap > point.loss_std + line_std
    return Verdict(
        point.name, point.flops, point.loss, point.loss_std, left.name, right.name, line, line_std, gap, pays
    )


def _name(point: Optional[Point]) -> Optional[str]:
    return point.name if point else None


def verdicts(found: Sequence[Point]) -> List[Verdict]:
    best = best_baselines(found)
    return [judge(p, best) for p in sorted(found, key=lambda p: p.flops) if p.family in JUDGED]


# ----------------------------------------------------------------------------------------------------
# Markdown


def experts_text(per_layer: Sequence[float]) -> str:
    """Experts per layer as '16/12.7/15/16' (means over seeds: a whole number without decimals)."""
    return "/".join(f"{n:g}" if float(n).is_integer() else f"{n:.1f}" for n in per_layer)


def rows_table(rows: Sequence[VariantRow], families: Dict[str, str]) -> str:
    lines = [
        "| variant | family | eval k | expert FLOPs vs top-2 | held-out loss | 95 % CI | experts per layer (end) "
        "| removed | load CV |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (families[r.variant] == "balance", r.flops_ratio.mean)):
        experts = experts_text(r.experts_end)
        lines.append(
            f"| {r.label} | {families[r.variant]} | {r.eval_k.cell(2)} "
            f"| {r.flops_ratio.cell(3)} | {r.test_loss.cell(4)} | {r.test_loss.interval(4)} "
            f"| {experts} | {r.removed.cell(1)} | {r.load_cv.cell(3)} |"
        )
    return "\n".join(lines)


def verdict_table(found: Sequence[Verdict]) -> str:
    lines = [
        "| top-any budget | FLOPs | loss | baselines around it | line at this FLOPs | gap (line - loss) | spread "
        "| pays? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in found:
        if v.pays is None:
            around = f"{v.left or 'none'} .. {v.right or 'none'}"
            lines.append(f"| {v.name} | {v.flops:.3f} | {v.loss:.4f} | {around} | - | - | - | outside the baselines |")
            continue
        spread = v.loss_std + v.line_std
        lines.append(
            f"| {v.name} | {v.flops:.3f} | {v.loss:.4f} ± {v.loss_std:.4f} | {v.left} .. {v.right} "
            f"| {v.line_loss:.4f} ± {v.line_std:.4f} | {v.gap:+.4f} | {spread:.4f} | {'**yes**' if v.pays else 'no'} |"
        )
    return "\n".join(lines)


def balance_lines(rows: Sequence[VariantRow]) -> List[str]:
    """Bias balance against the aux loss, paired by seed; [] when the pair was not run."""
    by_name = {r.variant: r for r in rows}
    aux, bias = by_name.get("top-k2-aux"), by_name.get("top-k2-bias")
    if aux is None or bias is None:
        return []
    paired = paired_loss(bias, aux)
    diff = "-"
    if paired is not None:
        interval = f"[{paired.ci_low:+.4f}, {paired.ci_high:+.4f}]"
        diff = f"{paired.mean_diff:+.4f} (95 % CI {interval}, p = {paired.p_value:.3f})"
    return [
        "| balance rule | held-out loss | load CV (training mean) | eval k |",
        "|---|---|---|---|",
        f"| {aux.label} | {aux.test_loss.cell(4)} | {aux.load_cv.cell(3)} | {aux.eval_k.cell(2)} |",
        f"| {bias.label} | {bias.test_loss.cell(4)} | {bias.load_cv.cell(3)} | {bias.eval_k.cell(2)} |",
        "",
        f"Held-out loss, bias - aux, paired by seed: {diff}.",
    ]


def frontier_markdown(outcome: Dict[str, Any], command: str, model_info: Dict[str, Any]) -> str:
    rows, families = outcome["rows"], outcome["families"]
    found = verdicts(points(rows, families))
    judged = [v for v in found if v.pays is not None]
    paying = [v.name for v in judged if v.pays]
    seeds = len(rows[0].seeds) if rows else 0
    parts = [
        f"# Loss against expert FLOPs ({model_info['model_type']}, {model_info['num_experts']} experts, native top-"
        f"{model_info['top_k']}; mean ± std over {seeds} seeds)",
        "",
        f"Command: `{command}`",
        "",
        rows_table(rows, families),
        "",
        "## Does top-any pay?",
        "",
        verdict_table(found),
        "",
        f"Top-any pays at {len(paying)} of {len(judged)} judged budgets"
        + (f": {', '.join(paying)}." if paying else "."),
    ]
    balance = balance_lines(rows)
    if balance:
        parts += ["", "## Balance without an aux loss", "", *balance]
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------------
# Figure

STYLES = {
    "native": dict(color="tab:blue", marker="s", label="native top-k"),
    "top_p": dict(color="dimgrey", marker="^", label="top-p"),
    "top_any": dict(color="tab:red", marker="o", label="top-any (target k), pruning"),
    "top_any_top1": dict(color="tab:orange", marker="v", label="top-any, train_k0 top1"),
    "balance": dict(color="tab:green", marker="D", label="top-k 2, aux / bias balance"),
}


def draw_frontier(found: Sequence[Point], out_png: Path) -> Path:
    """Held-out loss against expert FLOPs, std error bars on both axes; the baselines' best points joined."""
    Figure, FigureCanvasAgg = matplotlib_canvas()
    fig = Figure(figsize=(9, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for family, style in STYLES.items():
        mine = sorted((p for p in found if p.family == family), key=lambda p: p.flops)
        if not mine:
            continue
        ax.errorbar(
            [p.flops for p in mine],
            [p.loss for p in mine],
            xerr=[p.flops_std for p in mine],
            yerr=[p.loss_std for p in mine],
            linestyle="-" if family in JUDGED else "none",
            capsize=3,
            **style,
        )
        for p in mine:
            ax.annotate(p.name, (p.flops, p.loss), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    best = best_baselines(found)
    if best:
        ax.plot(
            [p.flops for p in best],
            [p.loss for p in best],
            color="black",
            linestyle=":",
            label="baselines' best points",
        )
    ax.set(xlabel="expert FLOPs per token / native top-2's", ylabel="held-out loss (Rotten Tomatoes)")
    ax.set_title("Loss against expert FLOPs after finetuning (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    return out_png


def write_outputs(out: Path, outcome: Dict[str, Any], command: str, model_info: Dict[str, Any]) -> Dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows, families = outcome["rows"], outcome["families"]
    found = points(rows, families)
    report = {
        "command": command,
        "model": model_info,
        "families": families,
        "variants": [r.to_dict() for r in rows],
        "verdicts": [v.__dict__ for v in verdicts(found)],
    }
    paths = {"json": out / "frontier.json", "md": out / "frontier.md", "png": out / "frontier.png"}
    paths["json"].write_text(json.dumps(finite(report), indent=1))
    paths["md"].write_text(frontier_markdown(outcome, command, model_info))
    draw_frontier(found, paths["png"])
    return paths

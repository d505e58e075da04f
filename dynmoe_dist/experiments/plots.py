"""comparison.png: test accuracy per epoch for every model (all epochs, and a zoom on the second half),
and the k each one activated.

Drawn on matplotlib's Agg canvas without pyplot (as train/report.py does), so importing this module
chooses no global backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..train.report import matplotlib_canvas
from .summary import ModelRow


def _is_dynmoe(row: ModelRow) -> bool:
    return row.family == "dynmoe" if row.family else row.model.startswith("dynmoe")


def _styles(rows: Sequence[ModelRow]):
    """Top-k baselines in shades of grey-blue and dashed, the dense model black and dotted, top-p grey and
    dash-dotted; DynMoE variants in strong colours, solid (tab20 beyond 9 of them, so none repeats)."""
    from matplotlib import colormaps

    dyn = [r for r in rows if _is_dynmoe(r)]
    topk = [r for r in rows if not _is_dynmoe(r) and r.family not in ("dense", "top_p")]
    styles = {}
    for i, row in enumerate(topk):
        styles[row.model] = dict(color=colormaps["Blues"](0.4 + 0.6 * (i + 1) / (len(topk) + 1)), linestyle="--")
    for row in rows:
        if row.family == "dense":
            styles[row.model] = dict(color="black", linestyle=":")
        elif row.family == "top_p":
            styles[row.model] = dict(color="dimgrey", linestyle="-.")
    palette, offset = (colormaps["tab10"], 1) if len(dyn) <= 9 else (colormaps["tab20"], 2)
    for i, row in enumerate(dyn):
        styles[row.model] = dict(color=palette(offset + i), linestyle="-")
    return styles


def _draw_accuracy(ax, rows: Sequence[ModelRow], styles, first_epoch: int = 1, legend: bool = True) -> None:
    for row in rows:
        epochs = np.arange(1, len(row.accuracy_mean) + 1)[first_epoch - 1 :]
        mean = np.array(row.accuracy_mean)[first_epoch - 1 :]
        std = np.array(row.accuracy_std)[first_epoch - 1 :]
        marker = "o" if len(epochs) <= 20 else None
        ax.plot(epochs, mean, marker=marker, markersize=3, label=row.label, **styles[row.model])
        if len(row.seeds) > 1:
            ax.fill_between(epochs, mean - std, mean + std, color=styles[row.model]["color"], alpha=0.12)
    seeds = len(rows[0].seeds)
    note = f"mean ± std over {seeds} seeds" if seeds > 1 else "1 seed"
    title = f"Test accuracy after each epoch ({note})" if first_epoch == 1 else f"Zoom: epochs {first_epoch}+"
    ax.set(title=title, xlabel="epoch", ylabel="test accuracy (%)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(loc="lower right", fontsize="small")


def _experts_text(row: ModelRow) -> str:
    return "/".join(f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}" for n in row.num_experts)


def _draw_mean_k(ax, rows: Sequence[ModelRow], styles) -> None:
    x = np.arange(len(rows))
    colours = [styles[r.model]["color"] for r in rows]
    ax.bar(
        x,
        [r.mean_k for r in rows],
        yerr=[r.mean_k_std if len(r.seeds) > 1 else 0 for r in rows],
        color=colours,
        label="training, mean over all steps",
    )
    ax.scatter(x, [r.final_k for r in rows], color="black", marker="_", s=300, zorder=3, label="training, last epoch")
    # At evaluation a DynMoE token that selected nothing falls back to top-1: the k inference pays for.
    ax.scatter(x, [r.eval_k for r in rows], color="tab:red", marker="x", s=40, zorder=4, label="final evaluation")
    # Expert counts go into the tick labels: annotations above equal-height bars collide with each other.
    labels = [f"{r.label}\n{_experts_text(r)} experts" if _is_dynmoe(r) and r.num_experts else r.label for r in rows]
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize="small")
    top = np.nanmax([[r.mean_k + r.mean_k_std, r.final_k, r.eval_k] for r in rows])
    ax.set_ylim(0, 1.35 * top)  # room for the legend above the bars
    ax.set(title="Experts per token (k), mean over MoE layers", ylabel="k")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", ncol=2)


def draw_comparison(rows: Sequence[ModelRow], out_png: str | Path, title: str = "") -> Path:
    """Accuracy curves (left) and the mean-k bar chart (right) in one PNG; returns its path."""
    if not rows:
        raise ValueError("no model rows to draw")
    Figure, FigureCanvasAgg = matplotlib_canvas()
    fig = Figure(figsize=(18, 5.5))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 3, width_ratios=(1.3, 1, 1))
    styles = _styles(rows)
    _draw_accuracy(fig.add_subplot(grid[0, 0]), rows, styles)
    # Early epochs span tens of points and flatten the differences that matter at the end.
    num_epochs = len(rows[0].accuracy_mean)
    _draw_accuracy(fig.add_subplot(grid[0, 1]), rows, styles, first_epoch=max(1, num_epochs // 2), legend=False)
    _draw_mean_k(fig.add_subplot(grid[0, 2]), rows, styles)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    return out_png

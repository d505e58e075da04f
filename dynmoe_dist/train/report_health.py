"""The MoE health panels of report.png (train/report.py draws the rest): how evenly the experts are used
(the load's coefficient of variation per block over time), the experts no token chose in each adaptive
window (dead experts), how many experts tokens choose (the k histogram of the last steps), and each
expert's utilisation at the end (the share of tokens routed to it).

Shapes: S logged steps, W windows, K k-histogram bins (k = 0 .. K - 2, and K - 1 or more).
Pure shaping first (numpy, tested exactly), then drawing on axes handed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np

LAST_STEPS_SHARE = 0.1
"""The k histogram and the utilisation are averaged over the last tenth of the logged steps."""


@dataclass
class HealthSeries:
    steps_S: np.ndarray
    load_cv_LS: np.ndarray
    """Coefficient of variation of each MoE layer's expert load per step (NaN where not logged)."""
    window_steps_W: np.ndarray
    dead_LW: np.ndarray
    """Experts no token chose in each layer's window."""
    k_share_LK: np.ndarray
    """Share of tokens that chose k experts, per layer, over the last steps."""
    utilization: List[np.ndarray]
    """Each layer's per-expert share of tokens over the last steps (its expert count at the end)."""


def health_series(records: Sequence[Dict[str, Any]], num_layers: int) -> HealthSeries:
    steps = [r for r in records if r["kind"] == "step"]
    windows = [r for r in records if r["kind"] == "window"]
    last = steps[-max(1, int(len(steps) * LAST_STEPS_SHARE)) :]
    return HealthSeries(
        steps_S=np.array([r["step"] for r in steps], dtype=np.int64),
        load_cv_LS=np.array([[_nth(r.get("load_cv"), layer) for r in steps] for layer in range(num_layers)]),
        window_steps_W=np.array([w["step"] for w in windows], dtype=np.int64),
        dead_LW=np.array([[len(w["dead_experts"][layer]) for w in windows] for layer in range(num_layers)]),
        k_share_LK=np.array([_k_share(last, layer) for layer in range(num_layers)]),
        utilization=[_utilization(last, layer) for layer in range(num_layers)],
    )


def _nth(values: Any, index: int) -> float:
    return float(values[index]) if values is not None and index < len(values) else np.nan


def _k_share(steps: Sequence[Dict[str, Any]], layer: int) -> np.ndarray:
    """Summed k histograms of these steps, as shares (empty when the run did not log them)."""
    hists = [r["k_histogram"][layer] for r in steps if r.get("k_histogram")]
    if not hists:
        return np.zeros(0)
    total = np.sum(np.array(hists, dtype=np.float64), axis=0)
    return total / max(total.sum(), 1.0)


def _utilization(steps: Sequence[Dict[str, Any]], layer: int) -> np.ndarray:
    """Mean utilisation of each expert over the steps that had the final expert count."""
    final = steps[-1]["num_experts"][layer]
    rows = [r["expert_utilization"][layer] for r in steps if r.get("expert_utilization")]
    rows = [row for row in rows if len(row) == final]
    return np.mean(np.array(rows, dtype=np.float64), axis=0) if rows else np.zeros(0)


def draw_health(axes: Sequence[Any], series: HealthSeries, labels: Sequence[str], colour) -> None:
    """Four panels on ``axes``: load CV over time, dead experts per window, k histogram, utilisation."""
    cv_ax, dead_ax, k_ax, use_ax = axes
    for layer, label in enumerate(labels):
        cv_ax.plot(series.steps_S, series.load_cv_LS[layer], label=label, color=colour(layer))
    cv_ax.set(title="Expert load: coefficient of variation (0 = even)", xlabel="step", ylabel="std / mean")
    width = 0.8 / max(len(labels), 1)
    positions = np.arange(len(series.window_steps_W))
    for layer, label in enumerate(labels):
        dead_ax.bar(positions + layer * width, series.dead_LW[layer], width, label=label, color=colour(layer))
    dead_ax.set_xticks(positions + 0.4 - width / 2, [str(s) for s in series.window_steps_W])
    dead_ax.set(title="Dead experts per window (no token chose them)", xlabel="window end (step)", ylabel="experts")
    for layer, label in enumerate(labels):
        share = series.k_share_LK[layer]
        ticks = np.arange(len(share))
        k_ax.bar(ticks + layer * width, share, width, label=label, color=colour(layer))
    k_ax.set(title="Experts per token (k), last steps", xlabel="k (last bin: or more)", ylabel="share of tokens")
    for layer, label in enumerate(labels):
        use = np.sort(series.utilization[layer])[::-1]
        use_ax.plot(np.arange(len(use)), use, "o-", label=label, color=colour(layer), markersize=3)
    use_ax.set(title="Expert utilisation at the end (sorted)", xlabel="expert (by use)", ylabel="share of tokens")
    for ax in axes:
        ax.legend(loc="best", fontsize="small")

"""One-figure report of a run, drawn from its ``metrics.jsonl`` alone.

    python -m dynmoe_dist.train.report RUN_DIR_OR_METRICS [-o report.png]

Two halves: ``report_series`` turns records into arrays (pure numpy, tested exactly), and
``draw_report`` draws them with matplotlib's Agg canvas (no pyplot, so no global backend is chosen for
whoever imports this module). Shapes: S logged steps, X experts slots (the most a layer ever had),
B time bins.
"""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .report_health import HealthSeries, draw_health, health_series
from .telemetry import METRICS_FILE, read_metrics

EVENT_CHANGES = ("removed", "added", "replicated", "moved")


# ----------------------------------------------------------------------------------------------------
# Data shaping (pure)


@dataclass
class LayerSeries:
    num_experts_S: np.ndarray
    mean_k_S: np.ndarray
    num_replicas_S: np.ndarray
    load_XS: np.ndarray
    """Rows routed to expert slot x at each step; NaN where the layer had fewer than x+1 experts."""
    rank_imbalance_S: np.ndarray
    """Max over mean of the rows each EP rank received; NaN where not recorded."""


@dataclass
class ReportSeries:
    steps_S: np.ndarray
    loss_S: np.ndarray
    accuracy_S: np.ndarray
    layers: List[LayerSeries]
    eval_steps: np.ndarray
    test_loss: np.ndarray
    test_accuracy: np.ndarray
    events: List[Tuple[int, int, str]] = field(default_factory=list)
    """(step, layer, change) with change in EVENT_CHANGES, in step order."""
    final: Optional[Dict[str, Any]] = None
    blocks: List[int] = field(default_factory=list)
    """The model block of each MoE layer (step records' ``blocks``); empty for runs logged before it."""
    health: Optional[HealthSeries] = None
    """The MoE health panels' arrays (train/report_health.py)."""

    def layer_label(self, layer: int) -> str:
        """'block 4': the model's own numbering (model.moe_layers); 'MoE layer 0' for older runs."""
        return f"block {self.blocks[layer]}" if layer < len(self.blocks) else f"MoE layer {layer}"

    def event_steps(self, change: str, layer: Optional[int] = None) -> np.ndarray:
        return np.array([s for s, at, c in self.events if c == change and layer in (None, at)], dtype=np.int64)


def latest_attempt(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Records of the last attempt at every step: a resumed run appends from its checkpoint's step,
    so when a step record goes back to step s, everything logged earlier at steps >= s is superseded."""
    kept: List[Dict[str, Any]] = []
    last_step = -1
    for record in records:
        if record["kind"] == "step":
            if record["step"] <= last_step:
                kept = [r for r in kept if r["step"] < record["step"]]
            last_step = record["step"]
        kept.append(record)
    return kept


def _scalar(records: Sequence[Dict[str, Any]], name: str) -> np.ndarray:
    return np.array([_number_or_nan(r.get(name)) for r in records], dtype=np.float64)


def _number_or_nan(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _per_layer(steps: Sequence[Dict[str, Any]], name: str, layer: int) -> np.ndarray:
    return np.array([_number_or_nan((r.get(name) or [math.nan] * (layer + 1))[layer]) for r in steps])


def _num_layers(steps: Sequence[Dict[str, Any]]) -> int:
    counts = {len(r.get("num_experts") or []) for r in steps}
    if len(counts) > 1:
        raise ValueError(f"step records disagree on the number of MoE layers (len(num_experts) in {sorted(counts)})")
    return counts.pop() if counts else 0


def _layer_series(steps: Sequence[Dict[str, Any]], layer: int) -> LayerSeries:
    num_experts_S = np.array([r["num_experts"][layer] for r in steps], dtype=np.int64)
    load_XS = np.full((int(num_experts_S.max(initial=0)), len(steps)), np.nan)
    for s, record in enumerate(steps):
        loads = (record.get("expert_load") or [None] * (layer + 1))[layer]
        if loads is not None:
            load_XS[: len(loads), s] = loads
    imbalance_S = np.array([_imbalance((r.get("rank_load") or [None] * (layer + 1))[layer]) for r in steps])
    return LayerSeries(
        num_experts_S,
        _per_layer(steps, "mean_k", layer),
        _per_layer(steps, "num_replicas", layer),
        load_XS,
        imbalance_S,
    )


def _imbalance(loads: Optional[Sequence[float]]) -> float:
    if not loads or sum(loads) <= 0:
        return math.nan
    return max(loads) / (sum(loads) / len(loads))


def _event_marks(events: Sequence[Dict[str, Any]]) -> List[Tuple[int, int, str]]:
    """An event marks 'removed' / 'added' when it did so, 'moved' when it moved experts between ranks (a
    re-placement), and 'replicated' when the layer's replica map differs from its previous event's (the
    map is the plan's full state, not a delta, so an unchanged map repeated every window is not a new
    replication)."""
    marks: List[Any] = []
    previous_replicas: Dict[int, Any] = {}
    for event in events:
        layer = int(event.get("layer", 0))
        replicas = dict(event.get("replicas") or {})
        for change, happened in (
            ("removed", bool(event.get("removed"))),
            ("added", bool(event.get("added"))),
            ("replicated", replicas != previous_replicas.get(layer, {})),
            ("moved", bool(event.get("moves"))),
        ):
            if happened:
                marks.append((int(event["step"]), layer, change))
        previous_replicas[layer] = replicas
    return sorted(marks, key=lambda mark: mark[0])


def report_series(records: Sequence[Dict[str, Any]]) -> ReportSeries:
    """Arrays to draw, from metrics records in file order (resumed runs included)."""
    records = latest_attempt(records)
    steps = [r for r in records if r["kind"] == "step"]
    if not steps:
        raise ValueError(f"metrics have no step records ({len(records)} records of other kinds): nothing to draw")
    evals = [r for r in records if r["kind"] == "eval"]
    finals = [r for r in records if r["kind"] == "final"]
    # The final test score is the curve's last point unless an eval at that step already is.
    if finals and finals[-1]["step"] not in {r["step"] for r in evals}:
        evals = evals + [finals[-1]]
    return ReportSeries(
        steps_S=np.array([r["step"] for r in steps], dtype=np.int64),
        loss_S=_scalar(steps, "loss"),
        accuracy_S=_scalar(steps, "accuracy"),
        layers=[_layer_series(steps, layer) for layer in range(_num_layers(steps))],
        eval_steps=np.array([r["step"] for r in evals], dtype=np.int64),
        test_loss=_scalar(evals, "test_loss"),
        test_accuracy=_scalar(evals, "test_accuracy"),
        events=_event_marks([r for r in records if r["kind"] == "event"]),
        final=finals[-1] if finals else None,
        blocks=list(steps[-1].get("blocks") or []),
        health=health_series(records, _num_layers(steps)),
    )


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values, NaNs skipped (NaN only where all are NaN)."""
    if window < 1:
        raise ValueError(f"smoothing window ({window}) must be >= 1")
    present = ~np.isnan(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(present, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(present)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[end] - sums[start]) / (counts[end] - counts[start])


def column_edges(steps_S: np.ndarray) -> np.ndarray:
    """S+1 edges around logged steps (midpoints between neighbours; half a gap beyond the ends), so
    a heatmap column covers the steps it stands for even when steps are logged every N."""
    steps = steps_S.astype(np.float64)
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middles = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - middles[0]], middles, [2 * steps[-1] - middles[-1]]])


def bin_columns(matrix_XS: np.ndarray, edges: np.ndarray, max_bins: int) -> Tuple[np.ndarray, np.ndarray]:
    """Average columns into at most ``max_bins`` near-equal groups (NaN-aware), with their B+1 edges."""
    if max_bins < 1:
        raise ValueError(f"max_bins ({max_bins}) must be >= 1")
    num_columns = matrix_XS.shape[1]
    if num_columns <= max_bins:
        return matrix_XS, edges
    groups = np.array_split(np.arange(num_columns), max_bins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN bin -> NaN is the intended answer
        binned_XB = np.stack([np.nanmean(matrix_XS[:, g], axis=1) for g in groups], axis=1)
    bin_edges = np.array([edges[g[0]] for g in groups] + [edges[-1]])
    return binned_XB, bin_edges


def load_share(load_XS: np.ndarray) -> np.ndarray:
    """Each expert's share of the layer's routed rows per step: comparable across batch sizes."""
    totals_S = np.nansum(load_XS, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals_S > 0, load_XS / totals_S, np.nan)


# ----------------------------------------------------------------------------------------------------
# Drawing

EVENT_STYLE = {
    "removed": dict(color="tab:red", linestyle="--", label="expert removed"),
    "added": dict(color="tab:green", linestyle="-", label="expert added"),
    "replicated": dict(color="tab:purple", linestyle="-.", label="replicas changed"),
    "moved": dict(color="tab:blue", linestyle=":", label="experts moved"),
}


def matplotlib_canvas():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("the run report needs matplotlib: pip install -e '.[report]' in the checkout") from err
    return Figure, FigureCanvasAgg


def _plot(ax, x, y, **style):
    # A lone point draws nothing without a marker (a run with a single logged step).
    if np.count_nonzero(~np.isnan(np.asarray(y, dtype=np.float64))) < 3:
        style.setdefault("marker", "o")
    return ax.plot(x, y, **style)


def _layer_colour(layer: int, num_layers: int):
    from matplotlib import colormaps

    return colormaps["tab10"](layer % 10) if num_layers <= 10 else colormaps["viridis"](layer / (num_layers - 1))


def _mark_events(ax, series: ReportSeries) -> None:
    from matplotlib.transforms import offset_copy

    # Every layer is planned at the same window end, so removals, additions, replica changes and moves
    # share a step: each kind is shifted by a couple of points so the lines stand side by side.
    for offset, (change, style) in zip((-3.0, -1.0, 1.0, 3.0), EVENT_STYLE.items()):
        steps = series.event_steps(change)
        if len(steps):
            shifted = offset_copy(ax.get_xaxis_transform(), fig=ax.figure, x=offset, units="points")
            ax.vlines(
                steps,
                0,
                1,
                transform=shifted,
                color=style["color"],
                linestyle=style["linestyle"],
                linewidth=1.3,
                alpha=0.9,
            )


def _empty(ax, title: str, message: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="grey")


def _smoothing_window(num_steps: int) -> int:
    return max(1, num_steps // 25)


def _plot_smoothed(ax, steps_S: np.ndarray, values_S: np.ndarray, label: str) -> None:
    """The raw curve faint and its trailing mean on top (only the raw curve when too short to smooth)."""
    window = _smoothing_window(len(steps_S))
    if window == 1:
        _plot(ax, steps_S, values_S, color="tab:blue", label=label)
        return
    _plot(ax, steps_S, values_S, color="tab:blue", alpha=0.3, linewidth=0.8, label=label)
    _plot(ax, steps_S, smooth(values_S, window), color="tab:blue", label=f"{label} (mean of {window} logged steps)")


def _draw_loss(ax, series: ReportSeries) -> None:
    _plot_smoothed(ax, series.steps_S, series.loss_S, "train loss")
    if np.any(~np.isnan(series.test_loss)):
        ax.plot(series.eval_steps, series.test_loss, "o-", color="tab:orange", label="test loss")
    ax.set(title="Loss", xlabel="step", ylabel="loss")
    ax.legend(loc="upper right", fontsize="small")


def _draw_accuracy(ax, series: ReportSeries) -> None:
    has_train = np.any(~np.isnan(series.accuracy_S))
    has_test = np.any(~np.isnan(series.test_accuracy))
    if not (has_train or has_test):
        return _empty(ax, "Accuracy", "no accuracy recorded")
    if has_train:
        _plot_smoothed(ax, series.steps_S, series.accuracy_S, "train")
    if has_test:
        ax.plot(series.eval_steps, series.test_accuracy, "o-", color="tab:orange", label="test")
    ax.set(title="Accuracy", xlabel="step", ylabel="accuracy")
    ax.legend(loc="lower right", fontsize="small")


def _draw_per_layer(ax, series: ReportSeries, attribute: str, title: str, ylabel: str, steps_drawstyle: bool) -> None:
    num_layers = len(series.layers)
    # Per-step ratios are noisy enough to hide the trend of a long run; counts are never smoothed.
    window = 1 if steps_drawstyle else _smoothing_window(len(series.steps_S))
    for layer, data in enumerate(series.layers):
        # Integer counts of several layers often coincide: later layers are drawn thinner on top, so
        # a shared value still shows every layer's colour.
        width = max(1.2, 3.0 - 0.6 * layer) if steps_drawstyle else 1.2
        _plot(
            ax,
            series.steps_S,
            smooth(getattr(data, attribute), window),
            color=_layer_colour(layer, num_layers),
            label=series.layer_label(layer),
            linewidth=width,
            drawstyle="steps-post" if steps_drawstyle else "default",
        )
    if window > 1:
        title += f", mean of {window} logged steps"
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if steps_drawstyle:
        ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="best", fontsize="small", ncol=1 + num_layers // 6)


def _draw_rank_imbalance(ax, series: ReportSeries) -> None:
    if all(np.all(np.isnan(layer.rank_imbalance_S)) for layer in series.layers):
        return _empty(ax, "EP rank load imbalance", "rank_load not recorded")
    _draw_per_layer(
        ax,
        series,
        "rank_imbalance_S",
        "EP rank load imbalance (busiest rank / mean)",
        "max / mean rows",
        steps_drawstyle=False,
    )
    ax.axhline(1.0, color="grey", linewidth=0.8)


def _draw_heatmap(fig, ax, series: ReportSeries, layer: int, max_bins: int) -> None:
    data = series.layers[layer]
    title = f"{series.layer_label(layer)}: share of routed rows per expert (grey: no expert in that slot)"
    if data.load_XS.shape[0] == 0 or np.all(np.isnan(data.load_XS)):
        return _empty(ax, title, "expert_load not recorded")
    share_XB, edges = bin_columns(load_share(data.load_XS), column_edges(series.steps_S), max_bins)
    if share_XB.shape[1] < data.load_XS.shape[1]:
        title += f"; {data.load_XS.shape[1]} steps averaged into {share_XB.shape[1]} bins"
    from matplotlib.colors import PowerNorm

    # Square-root colour scale: a shared expert takes most rows, and a linear scale would paint every
    # other expert the same dark colour.
    norm = PowerNorm(0.5, vmin=0.0, vmax=max(float(np.nanmax(share_XB)), 1e-9))
    mesh = ax.pcolormesh(
        edges,
        np.arange(share_XB.shape[0] + 1) - 0.5,
        np.ma.masked_invalid(share_XB),
        cmap="viridis",
        norm=norm,
        shading="flat",
    )
    ax.set_facecolor("#d9d9d9")
    ax.set(title=title, xlabel="step", ylabel="expert slot")
    ax.yaxis.get_major_locator().set_params(integer=True)
    fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.03, label="share of rows")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _suptitle(series: ReportSeries, metrics_path: Path) -> str:
    parts = [
        f"{metrics_path.parent.name or metrics_path.name}: {_plural(len(series.steps_S), 'logged step')} "
        f"(last step {series.steps_S[-1]}), {_plural(len(series.layers), 'MoE layer')}"
    ]
    final = series.final or {}
    if isinstance(final.get("test_perplexity"), (int, float)):
        parts.append(f"final held-out perplexity {final['test_perplexity']:.2f}")
    elif isinstance(final.get("test_accuracy"), (int, float)):
        parts.append(f"final test accuracy {final['test_accuracy']:.4f}")
    if isinstance(final.get("wall_s"), (int, float)):
        parts.append(f"wall {final['wall_s']:.0f} s")
    return ", ".join(parts)


def _event_legend(fig, series: ReportSeries) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=s["color"], linestyle=s["linestyle"], label=s["label"])  # type: ignore[arg-type]
        for change, s in EVENT_STYLE.items()
        if len(series.event_steps(change))
    ]
    if handles:
        fig.legend(
            handles=handles,
            loc="outside upper right",
            ncol=len(handles),
            fontsize="small",
            title="adaptive events (vertical lines, all panels)",
        )


def draw_series(series: ReportSeries, out_png: str | Path, title: str, max_bins: int = 300) -> Path:
    """Draw the report figure of ``series`` to ``out_png``."""
    Figure, FigureCanvasAgg = matplotlib_canvas()
    num_layers = len(series.layers)
    num_rows = 1 + (4 + num_layers if num_layers else 0)
    fig = Figure(figsize=(15, 3.4 * num_rows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(num_rows, 2)
    loss_ax = fig.add_subplot(grid[0, 0])
    loss_ax.xaxis.get_major_locator().set_params(integer=True)  # shared by every time axis
    time_axes = [loss_ax, fig.add_subplot(grid[0, 1], sharex=loss_ax)]
    _draw_loss(time_axes[0], series)
    _draw_accuracy(time_axes[1], series)
    if num_layers:
        time_axes += _draw_moe_panels(fig, grid, loss_ax, series, max_bins)
    else:
        loss_ax.set_title("Loss (no MoE layers in this run)")
    for ax in time_axes:
        _mark_events(ax, series)
    _event_legend(fig, series)
    fig.suptitle(title, x=0.01, ha="left", fontsize="large")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def _draw_moe_panels(fig, grid, loss_ax, series: ReportSeries, max_bins: int) -> list:
    axes = [fig.add_subplot(grid[row, col], sharex=loss_ax) for row in (1, 2) for col in (0, 1)]
    _draw_per_layer(axes[0], series, "num_experts_S", "Experts per MoE layer", "experts", steps_drawstyle=True)
    _draw_per_layer(
        axes[1], series, "mean_k_S", "Mean experts per token (k) per MoE layer", "mean k", steps_drawstyle=False
    )
    _draw_per_layer(axes[2], series, "num_replicas_S", "Extra replicas per MoE layer", "replicas", steps_drawstyle=True)
    _draw_rank_imbalance(axes[3], series)
    if series.health is not None:  # MoE health: two rows, the first two panels over training steps
        health_axes = [
            fig.add_subplot(grid[3, 0], sharex=loss_ax),
            fig.add_subplot(grid[3, 1]),
            fig.add_subplot(grid[4, 0]),
            fig.add_subplot(grid[4, 1]),
        ]
        labels = [series.layer_label(i) for i in range(len(series.layers))]
        draw_health(health_axes, series.health, labels, lambda i: _layer_colour(i, len(series.layers)))
        axes.append(health_axes[0])
    for layer in range(len(series.layers)):
        ax = fig.add_subplot(grid[5 + layer, :], sharex=loss_ax)
        _draw_heatmap(fig, ax, series, layer, max_bins)
        axes.append(ax)
    return axes


def draw_report(metrics_path: str | Path, out_png: str | Path, max_bins: int = 300) -> Path:
    """Read a metrics.jsonl and draw its report to ``out_png``; returns the PNG's path."""
    metrics_path = Path(metrics_path)
    series = report_series(read_metrics(metrics_path))
    return draw_series(series, out_png, _suptitle(series, metrics_path), max_bins)


def main(argv: Optional[Sequence[str]] = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.train.report", description="Draw the one-figure report of a dynmoe_dist run."
    )
    parser.add_argument("run", help=f"a run's out dir (holding {METRICS_FILE}) or a metrics file")
    parser.add_argument("-o", "--output", help="PNG to write (default: report.png next to the metrics)")
    parser.add_argument("--max-bins", type=int, default=300, help="time bins of the load heatmaps")
    args = parser.parse_args(argv)
    metrics = Path(args.run) / METRICS_FILE if Path(args.run).is_dir() else Path(args.run)
    if not metrics.is_file():
        parser.error(f"no metrics file at {metrics}")
    out = draw_report(metrics, args.output or metrics.parent / "report.png", args.max_bins)
    print(out)
    return out


if __name__ == "__main__":
    main()

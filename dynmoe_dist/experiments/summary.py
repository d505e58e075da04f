"""Turning comparison runs into numbers: one run's metrics -> RunSummary, seeds -> ModelRow, rows -> markdown.

Pure (numpy only): the table builders are tested on hand-made records. Accuracies are in percent, as
in the paper's table (docs/algorithm.md, section 6).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..train.report import latest_attempt

EPOCH_TOLERANCE = 1e-6


@dataclass
class RunSummary:
    model: str
    seed: int
    test_accuracy: List[float]
    """Test accuracy (%) after epoch 1, 2, ..., E."""
    mean_k: float
    """Experts per token, averaged over MoE layers and every training step."""
    final_k: float
    """Experts per token, averaged over MoE layers and the steps of the last epoch."""
    mean_k_per_layer: List[float]
    num_experts: List[int]
    """Experts per MoE layer at the end of training."""
    wall_s: float
    train_k0_share: float = math.nan
    """Share of training tokens (all MoE layers) routed to no expert: they skip the layer."""
    last_epoch_k0_share: float = math.nan
    eval_k: float = math.nan
    """Experts per token at the final evaluation, top-1 fallback of k = 0 tokens included."""
    eval_fallback_share: float = math.nan
    """Share of tokens at the final evaluation that selected no expert and fell back to top-1."""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _epoch_number(record: Dict[str, Any]) -> Optional[int]:
    """The epoch a record closes (1-based), or None when it was taken mid-epoch."""
    epoch = float(record.get("epoch", math.nan))
    nearest = round(epoch) if math.isfinite(epoch) else 0
    return int(nearest) if nearest >= 1 and abs(epoch - nearest) < EPOCH_TOLERANCE else None


def accuracy_by_epoch(records: Sequence[Dict[str, Any]]) -> List[float]:
    """Test accuracy (%) at every epoch end, from eval records and the final record."""
    found: Dict[int, float] = {}
    for record in records:
        epoch = _epoch_number(record) if record["kind"] in ("eval", "final") else None
        if epoch is not None and "test_accuracy" in record:
            found[epoch] = 100.0 * float(record["test_accuracy"])
    if not found:
        raise ValueError("metrics hold no eval or final record at an epoch end (was train.eval_every "
                         "set to the steps per epoch?)")
    missing = [e for e in range(1, max(found) + 1) if e not in found]
    if missing:
        raise ValueError(f"metrics have no test accuracy after epoch(s) {missing} (have {sorted(found)})")
    return [found[e] for e in range(1, max(found) + 1)]


def _step_k(record: Dict[str, Any]) -> float:
    return float(np.mean(record["mean_k"])) if record.get("mean_k") else math.nan


def summarise_run(model: str, seed: int, records: Sequence[Dict[str, Any]],
                  routing: Optional[Dict[str, float]] = None) -> RunSummary:
    """One run's RunSummary from its metrics records (a resumed run's superseded records dropped) and
    the routing probe's shares (probe.routing_summary), when there are any."""
    records = latest_attempt(records)
    steps = [r for r in records if r["kind"] == "step"]
    finals = [r for r in records if r["kind"] == "final"]
    if not steps or not finals:
        raise ValueError(f"{model} seed {seed}: metrics have {len(steps)} step and {len(finals)} final "
                         "records; a finished run has both")
    accuracy = accuracy_by_epoch(records)
    final = finals[-1]
    steps_per_epoch = final["step"] / final["epoch"]
    last_epoch = [r for r in steps if r["step"] > final["step"] - steps_per_epoch]
    per_layer = np.array([r["mean_k"] for r in steps if r.get("mean_k")], dtype=np.float64)
    return RunSummary(
        model=model, seed=seed, test_accuracy=accuracy,
        mean_k=float(np.nanmean([_step_k(r) for r in steps])),
        final_k=float(np.nanmean([_step_k(r) for r in last_epoch])),
        mean_k_per_layer=per_layer.mean(axis=0).tolist() if per_layer.size else [],
        num_experts=[int(n) for n in final.get("num_experts", [])],
        wall_s=float(final.get("wall_s", math.nan)), **(routing or {}))


# ----------------------------------------------------------------------------------------------------
# Over seeds


@dataclass
class ModelRow:
    model: str
    label: str
    seeds: List[int]
    accuracy_mean: List[float]
    accuracy_std: List[float]
    """Sample standard deviation over seeds (ddof 1); 0 with a single seed."""
    mean_k: float
    mean_k_std: float
    final_k: float
    eval_k: float
    """Experts per token at the final evaluation (k = 0 tokens fall back to top-1), mean over seeds."""
    last_epoch_k0_share: float
    """Share of the last epoch's training tokens that selected no expert, mean over seeds."""
    num_experts: List[float]
    """Experts per MoE layer at the end, averaged over seeds."""
    wall_s: float
    """Mean wall time of one run."""
    runs: List[RunSummary] = field(default_factory=list, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["runs"] = [r.to_dict() for r in self.runs]
        return out


def _std(values: np.ndarray) -> np.ndarray:
    return values.std(axis=0, ddof=1) if values.shape[0] > 1 else np.zeros(values.shape[1:])


def _mean(values: Sequence[float]) -> float:
    """Mean that is NaN (no warning) when nothing was measured."""
    present = [v for v in values if not math.isnan(v)]
    return float(np.mean(present)) if present else math.nan


def aggregate(model: str, label: str, runs: Sequence[RunSummary]) -> ModelRow:
    """Mean (and std) over the seeds of one model; every seed must have the same number of epochs."""
    if not runs:
        raise ValueError(f"model {model!r} has no runs to aggregate")
    lengths = {len(r.test_accuracy) for r in runs}
    if len(lengths) != 1:
        raise ValueError(f"model {model!r}: seeds disagree on the number of epochs ({sorted(lengths)})")
    accuracy = np.array([r.test_accuracy for r in runs], dtype=np.float64)
    mean_k = np.array([r.mean_k for r in runs], dtype=np.float64)
    experts = np.array([r.num_experts for r in runs], dtype=np.float64)
    return ModelRow(model=model, label=label, seeds=[r.seed for r in runs],
                    accuracy_mean=accuracy.mean(axis=0).tolist(), accuracy_std=_std(accuracy).tolist(),
                    mean_k=float(mean_k.mean()), mean_k_std=float(_std(mean_k[:, None])[0]),
                    final_k=float(np.mean([r.final_k for r in runs])),
                    eval_k=_mean([r.eval_k for r in runs]),
                    last_epoch_k0_share=_mean([r.last_epoch_k0_share for r in runs]),
                    num_experts=experts.mean(axis=0).tolist() if experts.size else [],
                    wall_s=float(np.mean([r.wall_s for r in runs])), runs=list(runs))


# ----------------------------------------------------------------------------------------------------
# Markdown


def table_epochs(num_epochs: int, max_columns: int = 10) -> List[int]:
    """Epochs shown as columns: all of them up to max_columns, else max_columns evenly spaced ones ending
    at the last (like the paper's 10/50/100/150/200)."""
    if num_epochs < 1 or max_columns < 1:
        raise ValueError(f"num_epochs ({num_epochs}) and max_columns ({max_columns}) must be >= 1")
    if num_epochs <= max_columns:
        return list(range(1, num_epochs + 1))
    return sorted({max(1, round(num_epochs * i / max_columns)) for i in range(1, max_columns + 1)})


def _cell(mean: float, std: float, num_seeds: int, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" if num_seeds == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _number(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _experts_cell(num_experts: Sequence[float]) -> str:
    # Integers for one seed (or seeds that agree); one decimal when seeds ended on different counts.
    return "/".join(f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}" for n in num_experts) or "-"


def markdown_table(rows: Sequence[ModelRow], epochs: Optional[Sequence[int]] = None) -> str:
    """| model | acc after each shown epoch | mean k | final k | eval k | k=0 % | experts | wall s |, the best
    mean accuracy of each epoch column in bold."""
    if not rows:
        raise ValueError("no model rows to tabulate")
    num_epochs = len(rows[0].accuracy_mean)
    epochs = list(epochs or table_epochs(num_epochs))
    bad = [e for e in epochs if not 1 <= e <= num_epochs]
    if bad:
        raise ValueError(f"table epochs {bad} outside [1, {num_epochs}]")
    best = {e: max(row.accuracy_mean[e - 1] for row in rows) for e in epochs}
    lines = ["| model | " + " | ".join(str(e) for e in epochs) + " | mean k | final k | eval k | k=0 % | experts | wall s |",
             "|---|" + "---|" * (len(epochs) + 6)]
    for row in rows:
        cells = []
        for e in epochs:
            text = _cell(row.accuracy_mean[e - 1], row.accuracy_std[e - 1], len(row.seeds))
            cells.append(f"**{text}**" if row.accuracy_mean[e - 1] == best[e] else text)
        cells += [_cell(row.mean_k, row.mean_k_std, len(row.seeds)), f"{row.final_k:.2f}",
                  _number(row.eval_k, ".2f"), _number(100 * row.last_epoch_k0_share, ".1f"),
                  _experts_cell(row.num_experts), f"{row.wall_s:.0f}"]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

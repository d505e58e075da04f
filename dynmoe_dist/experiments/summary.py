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
from .stats import PairedResult, convergence_epoch, paired_test

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
    num_steps: int = 0
    """Optimizer steps of the run (for the wall time per step)."""
    skip_accuracy: float = math.nan
    """Test accuracy (%) of the final model re-evaluated with moe.eval_k0 = 'skip' (DynMoE only)."""
    skip_share_per_layer: List[float] = field(default_factory=list)
    """Per MoE layer, the share of tokens that selected no expert and skipped it in that evaluation."""

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
        raise ValueError(
            "metrics hold no eval or final record at an epoch end (was train.eval_every set to the steps per epoch?)"
        )
    missing = [e for e in range(1, max(found) + 1) if e not in found]
    if missing:
        raise ValueError(f"metrics have no test accuracy after epoch(s) {missing} (have {sorted(found)})")
    return [found[e] for e in range(1, max(found) + 1)]


def _mean(values: Sequence[float]) -> float:
    """Mean that is NaN (no warning) when nothing was measured."""
    present = [v for v in values if not math.isnan(v)]
    return float(np.mean(present)) if present else math.nan


def _step_k(record: Dict[str, Any]) -> float:
    return float(np.mean(record["mean_k"])) if record.get("mean_k") else math.nan


def summarise_run(
    model: str, seed: int, records: Sequence[Dict[str, Any]], routing: Optional[Dict[str, Any]] = None
) -> RunSummary:
    """One run's RunSummary from its metrics records (a resumed run's superseded records dropped) and
    the routing probe's shares (probe.routing_summary), when there are any."""
    records = latest_attempt(records)
    steps = [r for r in records if r["kind"] == "step"]
    finals = [r for r in records if r["kind"] == "final"]
    if not steps or not finals:
        raise ValueError(
            f"{model} seed {seed}: metrics have {len(steps)} step and {len(finals)} final "
            "records; a finished run has both"
        )
    accuracy = accuracy_by_epoch(records)
    final = finals[-1]
    steps_per_epoch = final["step"] / final["epoch"]
    last_epoch = [r for r in steps if r["step"] > final["step"] - steps_per_epoch]
    per_layer = np.array([r["mean_k"] for r in steps if r.get("mean_k")], dtype=np.float64)
    return RunSummary(
        model=model,
        seed=seed,
        test_accuracy=accuracy,
        # A dense model has no MoE layer and so no k: NaN, shown as '-'.
        mean_k=_mean([_step_k(r) for r in steps]),
        final_k=_mean([_step_k(r) for r in last_epoch]),
        mean_k_per_layer=per_layer.mean(axis=0).tolist() if per_layer.size else [],
        num_experts=[int(n) for n in final.get("num_experts", [])],
        wall_s=float(final.get("wall_s", math.nan)),
        num_steps=int(final["step"]),
        **(routing or {}),
    )


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
    family: str = ""
    """'dense', 'top_k', 'top_p' or 'dynmoe' (experiments/models.py)."""
    ms_per_step: float = math.nan
    """Wall time per optimizer step (ms; per-epoch evaluations included), mean over seeds."""
    skip_accuracy: float = math.nan
    """Final test accuracy (%) with moe.eval_k0 = 'skip', mean over seeds (DynMoE only)."""
    skip_share_per_layer: List[float] = field(default_factory=list)
    """Share of test tokens skipping each MoE layer under eval_k0 = 'skip', mean over seeds."""
    flops_train: float = math.nan
    """Expert FLOPs per token in training (stats.expert_flops_per_token at the mean k of every layer)."""
    flops_eval: float = math.nan
    """Expert FLOPs per token at the final evaluation (eval k, top-1 fallback included)."""
    runs: List[RunSummary] = field(default_factory=list, repr=False)

    def final_accuracies(self) -> Dict[int, float]:
        """Seed -> final test accuracy (%), for the paired tests."""
        return {r.seed: r.test_accuracy[-1] for r in self.runs}

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["runs"] = [r.to_dict() for r in self.runs]
        return out


def _std(values: np.ndarray) -> np.ndarray:
    return values.std(axis=0, ddof=1) if values.shape[0] > 1 else np.zeros(values.shape[1:])


def _mean_lists(lists: Sequence[Sequence[float]]) -> List[float]:
    present = [list(v) for v in lists if len(v)]
    return np.mean(np.array(present, dtype=np.float64), axis=0).tolist() if present else []


def aggregate(model: str, label: str, runs: Sequence[RunSummary], family: str = "") -> ModelRow:
    """Mean (and std) over the seeds of one model; every seed must have the same number of epochs."""
    if not runs:
        raise ValueError(f"model {model!r} has no runs to aggregate")
    lengths = {len(r.test_accuracy) for r in runs}
    if len(lengths) != 1:
        raise ValueError(f"model {model!r}: seeds disagree on the number of epochs ({sorted(lengths)})")
    accuracy = np.array([r.test_accuracy for r in runs], dtype=np.float64)
    mean_k = np.array([r.mean_k for r in runs], dtype=np.float64)
    experts = np.array([r.num_experts for r in runs], dtype=np.float64)
    return ModelRow(
        model=model,
        label=label,
        seeds=[r.seed for r in runs],
        accuracy_mean=accuracy.mean(axis=0).tolist(),
        accuracy_std=_std(accuracy).tolist(),
        mean_k=_mean(mean_k.tolist()),
        mean_k_std=float(_std(mean_k[:, None])[0]),
        final_k=_mean([r.final_k for r in runs]),
        eval_k=_mean([r.eval_k for r in runs]),
        last_epoch_k0_share=_mean([r.last_epoch_k0_share for r in runs]),
        num_experts=experts.mean(axis=0).tolist() if experts.size else [],
        wall_s=float(np.mean([r.wall_s for r in runs])),
        family=family,
        ms_per_step=_mean([1000 * r.wall_s / r.num_steps if r.num_steps else math.nan for r in runs]),
        skip_accuracy=_mean([r.skip_accuracy for r in runs]),
        skip_share_per_layer=_mean_lists([r.skip_share_per_layer for r in runs]),
        runs=list(runs),
    )


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


def best_of_family(rows: Sequence[ModelRow], family: str) -> Optional[ModelRow]:
    """The row of that family with the highest mean final accuracy (first of a tie), or None."""
    members = [r for r in rows if r.family == family]
    return max(members, key=lambda r: r.accuracy_mean[-1]) if members else None


def _reach_cell(row: ModelRow, target: Optional[float]) -> str:
    if target is None:
        return "-"
    epoch = convergence_epoch(row.accuracy_mean, target)
    return "never" if epoch is None else str(epoch)


def _kflops_cell(row: ModelRow) -> str:
    if math.isnan(row.flops_train) and math.isnan(row.flops_eval):
        return "-"
    return f"{_number(row.flops_train / 1e3, '.0f')} / {_number(row.flops_eval / 1e3, '.0f')}"


TABLE_TAIL = (
    "mean k",
    "final k",
    "eval k",
    "k=0 %",
    "experts",
    "kFLOP/token train / eval",
    "reaches best top-k",
    "ms/step",
)


def markdown_table(rows: Sequence[ModelRow], epochs: Optional[Sequence[int]] = None) -> str:
    """| model | acc after each shown epoch | mean k | final k | eval k | k=0 % | experts | kFLOP/token |
    reaches best top-k | ms/step |, the best mean accuracy of each epoch column in bold. "reaches best
    top-k": the first epoch whose mean accuracy reaches the best top-k row's final mean accuracy."""
    if not rows:
        raise ValueError("no model rows to tabulate")
    num_epochs = len(rows[0].accuracy_mean)
    epochs = list(epochs or table_epochs(num_epochs))
    bad = [e for e in epochs if not 1 <= e <= num_epochs]
    if bad:
        raise ValueError(f"table epochs {bad} outside [1, {num_epochs}]")
    best = {e: max(row.accuracy_mean[e - 1] for row in rows) for e in epochs}
    best_top_k = best_of_family(rows, "top_k")
    target = best_top_k.accuracy_mean[-1] if best_top_k else None
    lines = [
        "| model | " + " | ".join(str(e) for e in epochs) + " | " + " | ".join(TABLE_TAIL) + " |",
        "|---|" + "---|" * (len(epochs) + len(TABLE_TAIL)),
    ]
    for row in rows:
        cells = []
        for e in epochs:
            text = _cell(row.accuracy_mean[e - 1], row.accuracy_std[e - 1], len(row.seeds))
            cells.append(f"**{text}**" if row.accuracy_mean[e - 1] == best[e] else text)
        mean_k = "-" if math.isnan(row.mean_k) else _cell(row.mean_k, row.mean_k_std, len(row.seeds))
        cells += [
            mean_k,
            _number(row.final_k, ".2f"),
            _number(row.eval_k, ".2f"),
            _number(100 * row.last_epoch_k0_share, ".1f"),
            _experts_cell(row.num_experts),
            _kflops_cell(row),
            _reach_cell(row, target),
            _number(row.ms_per_step, ".0f"),
        ]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Paired tests and the eval_k0 = 'skip' measurement


def paired_against(row: ModelRow, reference: ModelRow) -> Optional[PairedResult]:
    """row - reference in final accuracy over the seeds both have (each seed is one pair)."""
    mine, theirs = row.final_accuracies(), reference.final_accuracies()
    seeds = [s for s in mine if s in theirs]
    return paired_test([mine[s] for s in seeds], [theirs[s] for s in seeds])


def _paired_cell(result: Optional[PairedResult]) -> str:
    if result is None:
        return "- (needs 2 seeds)"
    return f"{result.mean_diff:+.2f} [{result.ci_low:+.2f}, {result.ci_high:+.2f}], p = {result.p_value:.3f}"


def references(rows: Sequence[ModelRow]) -> List[ModelRow]:
    """The rows DynMoE is tested against: the best top-k, the dense model and the best top-p (present ones)."""
    return [r for r in (best_of_family(rows, f) for f in ("top_k", "dense", "top_p")) if r is not None]


def paired_results(rows: Sequence[ModelRow]) -> Dict[str, Dict[str, Optional[Dict[str, Any]]]]:
    """DynMoE model -> reference model -> PairedResult as a dict (None with one seed), for results.json."""
    out: Dict[str, Dict[str, Optional[Dict[str, Any]]]] = {}
    for row in (r for r in rows if r.family == "dynmoe"):
        out[row.model] = {}
        for ref in references(rows):
            result = paired_against(row, ref)
            out[row.model][ref.model] = result.to_dict() if result else None
    return out


def paired_table(rows: Sequence[ModelRow]) -> str:
    """| DynMoE model | vs <best top-k> | vs dense | vs <best top-p> |: final-accuracy difference (points),
    95% CI of the paired t over seeds, two-sided p. Empty when there is no DynMoE row or no reference."""
    refs, dyn = references(rows), [r for r in rows if r.family == "dynmoe"]
    if not refs or not dyn:
        return ""
    lines = ["| model | " + " | ".join(f"vs {r.label}" for r in refs) + " |", "|---|" + "---|" * len(refs)]
    for row in dyn:
        lines.append(f"| {row.label} | " + " | ".join(_paired_cell(paired_against(row, r)) for r in refs) + " |")
    return "\n".join(lines)


def skip_table(rows: Sequence[ModelRow]) -> str:
    """| model | final acc, eval_k0 top1 | eval_k0 skip | tokens skipping each layer |, DynMoE rows only."""
    dyn = [r for r in rows if r.family == "dynmoe" and not math.isnan(r.skip_accuracy)]
    if not dyn:
        return ""
    lines = [
        "| model | acc, eval_k0 = top1 | acc, eval_k0 = skip | skip − top1 | tokens skipping layer (%) |",
        "|---|---|---|---|---|",
    ]
    for row in dyn:
        shares = " / ".join(f"{100 * s:.1f}" for s in row.skip_share_per_layer) or "-"
        lines.append(
            f"| {row.label} | {row.accuracy_mean[-1]:.2f} | {row.skip_accuracy:.2f} | "
            f"{row.skip_accuracy - row.accuracy_mean[-1]:+.2f} | {shares} |"
        )
    return "\n".join(lines)

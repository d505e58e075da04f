"""`moe-finetune`'s numbers: one finetune's metrics -> FinetuneResult, seeds -> VariantRow, the goal check
and the markdown. Pure (numpy and the stats module): tested on hand-made records.

Expert FLOPs: a Qwen3-MoE expert is gated, three matmuls of D x F (gate, up, down), 3 D F multiply-adds =
6 D F FLOPs per token it serves; a layer costs k x 6 D F, k the experts the token is sent to. So FLOPs
follow k, not the number of experts a layer holds: removing experts nobody routes to saves memory, not
compute. Router, attention, embeddings and dispatch are left out (the same for every variant, or small).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..train.report import latest_attempt
from .stats import CONFIDENCE, PairedResult, paired_test, t_quantile

GATED_MATMULS = 3
LOSS_GOAL = "mean(pruned) <= mean(native) + std(native)"
FLOPS_GOAL = 0.85
"""The pruned model's expert FLOPs per token at most this share of the native finetune's."""
REMOVED_GOAL = 0.20
"""At least this share of the experts gone at the end (net of experts the add rule created)."""
END_SHARE = 0.1
"""'k at the end': the mean over the last tenth of the training steps."""


def expert_flops(k_per_layer: Sequence[float], dim: int, ffn_dim: int, matmuls: int = GATED_MATMULS) -> float:
    """FLOPs per token of the experts, summed over the MoE layers: k x matmuls x 2 D F per layer."""
    return float(sum(k_per_layer)) * matmuls * 2 * dim * ffn_dim


def flops_ratio(k_per_layer: Sequence[float], native_k: int) -> float:
    """Expert FLOPs relative to the native model, which sends every token to native_k experts per layer."""
    return float(sum(k_per_layer)) / (native_k * len(k_per_layer))


@dataclass
class FinetuneResult:
    """One finetune (variant, seed)."""

    variant: str
    seed: int
    test_loss: float
    """Held-out loss per token after training."""
    step0_loss: float
    """Held-out loss of the same model before its first step (after conversion and calibration)."""
    train_k: List[float]
    """Per MoE layer, experts per token averaged over every training step (k = 0 tokens count 0)."""
    end_k: List[float]
    """The same over the last END_SHARE of the steps."""
    eval_k: List[float]
    """Per MoE layer, experts per token at the final evaluation (top-1 fallback of k = 0 tokens included):
    what the exported model computes."""
    experts_start: List[int]
    experts_end: List[int]
    removed: List[int]
    """Per layer, experts the adaptive events removed (all events together)."""
    added: List[int]
    steps: int
    wall_s: float
    peak_mib: float = math.nan
    """The largest rank's peak resident memory during the run (model built, trained, evaluated) above what the
    process held before, in MiB."""
    load_cv: List[float] = field(default_factory=list)
    """Per MoE layer, the coefficient of variation of the experts' token counts (std / mean), averaged over
    the training steps: 0 = perfectly balanced."""
    export: str = ""
    export_error: str = ""
    per_token_ms: float = math.nan
    base_per_token_ms: float = math.nan
    generate_error: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _layer_means(rows: Sequence[Sequence[float]]) -> List[float]:
    return np.asarray(rows, dtype=np.float64).mean(axis=0).tolist() if len(rows) else []


def summarise_finetune(
    variant: str, seed: int, records: Sequence[Dict[str, Any]], eval_k: Sequence[float], step0_loss: float
) -> FinetuneResult:
    """A finished run's FinetuneResult from its metrics records (every step logged) and the routing probe's
    per-layer eval k."""
    records = latest_attempt(records)
    steps = [r for r in records if r["kind"] == "step"]
    finals = [r for r in records if r["kind"] == "final"]
    if not steps or not finals:
        raise ValueError(f"{variant} seed {seed}: {len(steps)} step and {len(finals)} final records; need both")
    events = [r for r in records if r["kind"] == "event"]
    num_layers = len(steps[0]["mean_k"])
    end = steps[-max(1, math.ceil(END_SHARE * len(steps))) :]
    return FinetuneResult(
        variant=variant,
        seed=seed,
        test_loss=float(finals[-1]["test_loss"]),
        step0_loss=step0_loss,
        train_k=_layer_means([r["mean_k"] for r in steps]),
        end_k=_layer_means([r["mean_k"] for r in end]),
        eval_k=[float(k) for k in eval_k],
        experts_start=[int(n) for n in steps[0]["num_experts"]],
        experts_end=[int(n) for n in finals[-1]["num_experts"]],
        removed=[sum(len(e["removed"]) for e in events if e["layer"] == i) for i in range(num_layers)],
        added=[sum(len(e["added"]) for e in events if e["layer"] == i) for i in range(num_layers)],
        steps=int(finals[-1]["step"]),
        wall_s=float(finals[-1].get("wall_s", math.nan)),
        load_cv=_layer_means([r["load_cv"] for r in steps if "load_cv" in r]),
    )


def removed_share(result: FinetuneResult) -> float:
    """Share of the experts gone at the end, net of added ones (the model is that much smaller)."""
    return 1.0 - sum(result.experts_end) / sum(result.experts_start)


# ----------------------------------------------------------------------------------------------------
# Over seeds


@dataclass(frozen=True)
class Spread:
    """Mean, sample std (ddof 1) and the 95 % t interval of the mean over seeds (NaN bounds with one seed)."""

    mean: float
    std: float
    ci_low: float
    ci_high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
        if v.size == 0:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        if v.size == 1:
            return cls(float(v[0]), 0.0, math.nan, math.nan, 1)
        std = float(v.std(ddof=1))
        half = t_quantile(0.5 + CONFIDENCE / 2, v.size - 1) * std / math.sqrt(v.size)
        return cls(float(v.mean()), std, float(v.mean()) - half, float(v.mean()) + half, int(v.size))

    def cell(self, digits: int = 3) -> str:
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

    def interval(self, digits: int = 3) -> str:
        return "-" if self.n < 2 else f"[{self.ci_low:.{digits}f}, {self.ci_high:.{digits}f}]"


@dataclass
class VariantRow:
    variant: str
    label: str
    seeds: List[int]
    test_loss: Spread
    step0_loss: Spread
    train_k: Spread
    """Mean over layers of the per-layer training k."""
    end_k: Spread
    eval_k: Spread
    experts_end: List[float]
    """Per layer, mean over seeds."""
    removed: Spread
    """Experts removed, summed over layers."""
    added: Spread
    removed_share: Spread
    flops_mflop: Spread
    """Expert MFLOP per token at the eval k."""
    flops_ratio: Spread
    """At the eval k, relative to native top-k."""
    per_token_ms: Spread
    base_per_token_ms: Spread
    peak_mib: Spread
    load_cv: Spread
    """Mean over layers of the per-layer load coefficient of variation over training (FinetuneResult.load_cv)."""
    runs: List[FinetuneResult] = field(default_factory=list, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["runs"] = [r.to_dict() for r in self.runs]
        return out


def aggregate_variant(
    variant: str,
    label: str,
    runs: Sequence[FinetuneResult],
    dim: int,
    ffn_dim: int,
    native_k: int,
    matmuls: int = GATED_MATMULS,
) -> VariantRow:
    if not runs:
        raise ValueError(f"variant {variant!r} has no runs to aggregate")
    return VariantRow(
        variant=variant,
        label=label,
        seeds=[r.seed for r in runs],
        test_loss=Spread.of([r.test_loss for r in runs]),
        step0_loss=Spread.of([r.step0_loss for r in runs]),
        train_k=Spread.of([float(np.mean(r.train_k)) for r in runs]),
        end_k=Spread.of([float(np.mean(r.end_k)) for r in runs]),
        eval_k=Spread.of([float(np.mean(r.eval_k)) for r in runs]),
        experts_end=_layer_means([r.experts_end for r in runs]),
        removed=Spread.of([float(sum(r.removed)) for r in runs]),
        added=Spread.of([float(sum(r.added)) for r in runs]),
        removed_share=Spread.of([removed_share(r) for r in runs]),
        flops_mflop=Spread.of([expert_flops(r.eval_k, dim, ffn_dim, matmuls) / 1e6 for r in runs]),
        flops_ratio=Spread.of([flops_ratio(r.eval_k, native_k) for r in runs]),
        per_token_ms=Spread.of([r.per_token_ms for r in runs]),
        base_per_token_ms=Spread.of([r.base_per_token_ms for r in runs]),
        peak_mib=Spread.of([r.peak_mib for r in runs]),
        load_cv=Spread.of([float(np.mean(r.load_cv)) if r.load_cv else math.nan for r in runs]),
        runs=list(runs),
    )


def paired_loss(row: VariantRow, reference: VariantRow) -> Optional[PairedResult]:
    """row - reference in held-out loss, paired by seed (None with fewer than 2 shared seeds)."""
    mine = {r.seed: r.test_loss for r in row.runs}
    theirs = {r.seed: r.test_loss for r in reference.runs}
    seeds = [s for s in mine if s in theirs]
    return paired_test([mine[s] for s in seeds], [theirs[s] for s in seeds])


def goal_check(native: VariantRow, pruned: VariantRow) -> Dict[str, Any]:
    """The issue's goal, each part on its own: the pruned model's held-out loss within the native finetune's
    seed spread (LOSS_GOAL), its expert FLOPs at most FLOPS_GOAL of native's, at least REMOVED_GOAL of the
    experts gone. With one seed the spread is 0: the loss must be no higher."""
    loss_ok = pruned.test_loss.mean <= native.test_loss.mean + native.test_loss.std
    flops_ok = pruned.flops_ratio.mean <= FLOPS_GOAL
    removed_ok = pruned.removed_share.mean >= REMOVED_GOAL
    return {
        "loss_within_native_spread": bool(loss_ok),
        "flops_at_most_85_percent": bool(flops_ok),
        "at_least_20_percent_removed": bool(removed_ok),
        "met": bool(loss_ok and flops_ok and removed_ok),
        "loss_diff": pruned.test_loss.mean - native.test_loss.mean,
        "native_loss_std": native.test_loss.std,
        "flops_ratio": pruned.flops_ratio.mean,
        "removed_share": pruned.removed_share.mean,
    }

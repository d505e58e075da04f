"""Statistics of a comparison: paired t-test over seeds, convergence epoch, expert FLOPs per token.

Pure (math and numpy). scipy is used for the t distribution when installed (it comes with the 'data'
extra through scikit-learn); without it the same numbers come from a numerical integral of the t
density, which the tests check against scipy's to 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedResult:
    """A - B over paired seeds: mean difference, its 95% confidence interval and the two-sided p-value."""

    num_pairs: int
    mean_diff: float
    ci_low: float
    ci_high: float
    p_value: float

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _t_pdf(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_tail(t: float, df: int, num_intervals: int = 4000) -> float:
    """P(T > |t|) for Student's t with df degrees of freedom: 1/2 minus Simpson's integral over [0, |t|]
    (after x = tan(u), so that the integrand is smooth and the interval finite even for large t)."""
    upper = math.atan(abs(t))
    h = upper / num_intervals
    total = 0.0
    for i in range(num_intervals + 1):
        u = i * h
        weight = 1 if i in (0, num_intervals) else (4 if i % 2 else 2)
        total += weight * _t_pdf(math.tan(u), df) / math.cos(u) ** 2
    return max(0.0, 0.5 - total * h / 3)


def t_two_sided_p(t: float, df: int) -> float:
    try:
        from scipy import stats
    except ImportError:
        return 2 * _t_tail(t, df)
    return float(2 * stats.t.sf(abs(t), df))


def t_quantile(q: float, df: int) -> float:
    """The q-quantile (q > 0.5) of Student's t: scipy's, else bisection on the tail above."""
    try:
        from scipy import stats
    except ImportError:
        low, high = 0.0, 1e3
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if _t_tail(mid, df) > 1 - q else (low, mid)
        return (low + high) / 2
    return float(stats.t.ppf(q, df))


def paired_test(a: Sequence[float], b: Sequence[float]) -> Optional[PairedResult]:
    """Paired t over seeds (a[i] and b[i] share seed i). None with fewer than 2 pairs (no spread)."""
    if len(a) != len(b):
        raise ValueError(f"paired test needs one value per seed on both sides (got {len(a)} and {len(b)})")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(diff)
    if n < 2:
        return None
    mean, sd = float(diff.mean()), float(diff.std(ddof=1))
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)
    if sd == 0:  # every seed moved by the same amount: certain up to the seeds we have
        p = 1.0 if mean == 0 else 0.0
    else:
        p = t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)
    return PairedResult(n, mean, mean - half, mean + half, p)


def convergence_epoch(curve: Sequence[float], target: float) -> Optional[int]:
    """First epoch (1-based) at which curve reaches target; None if it never does."""
    for epoch, value in enumerate(curve, start=1):
        if value >= target:
            return epoch
    return None


def expert_flops_per_token(k_per_layer: Sequence[float], dim: int, ffn_dim: int) -> float:
    """FLOPs of the expert FFNs per token, summed over the MoE layers: each selected expert runs two
    matmuls, D x F in and F x D out, that is 2 * D * F multiply-adds = 4 * D * F FLOPs; so a layer costs
    k * 4 * D * F. Router, attention and the dispatch are left out (the same for every model or small)."""
    return float(sum(k_per_layer)) * 4 * dim * ffn_dim

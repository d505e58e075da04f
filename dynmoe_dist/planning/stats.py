"""Window statistics of one MoE layer: plain sums, so merging ranks, windows or nodes is addition.

Shape legend: E experts, D model dim, K = max_experts + 1 histogram bins (k = 0..max_experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import Tensor


@dataclass
class WindowStats:
    counts_E: Tensor
    """Tokens that selected each expert (before any k = 0 fallback), float64."""
    unrouted_sum_D: Tensor
    """Sum of the raw hidden states of tokens with k = 0, float64."""
    num_unrouted: float
    """Number of tokens with k = 0."""
    k_hist_K: Tensor
    """Tokens per selected count k, float64."""

    @classmethod
    def empty(cls, num_experts: int, dim: int, max_experts: int) -> "WindowStats":
        return cls(torch.zeros(num_experts, dtype=torch.float64), torch.zeros(dim, dtype=torch.float64), 0.0,
                   torch.zeros(max_experts + 1, dtype=torch.float64))

    @property
    def num_tokens(self) -> float:
        return float(self.k_hist_K.sum())

    def add_tokens(self, selected_TE: Tensor, x_TD: Tensor) -> None:
        """Record a batch: selected_TE is the bool selection before any fallback."""
        selected_TE = selected_TE.detach().cpu()
        k_T = selected_TE.sum(dim=-1)
        unrouted_T = k_T == 0
        self.counts_E += selected_TE.sum(dim=0).double()
        self.unrouted_sum_D += x_TD.detach().double().cpu()[unrouted_T].sum(dim=0)
        self.num_unrouted += float(unrouted_T.sum())
        self.k_hist_K += torch.bincount(k_T.clamp(max=self.k_hist_K.numel() - 1),
                                        minlength=self.k_hist_K.numel()).double()

    def merge(self, other: "WindowStats") -> "WindowStats":
        return WindowStats(self.counts_E + other.counts_E, self.unrouted_sum_D + other.unrouted_sum_D,
                           self.num_unrouted + other.num_unrouted, self.k_hist_K + other.k_hist_K)

    # -- flat form for one all-reduce / one message per layer ---------------------------------------
    def to_flat(self) -> Tensor:
        return torch.cat([self.counts_E, self.unrouted_sum_D, torch.tensor([self.num_unrouted], dtype=torch.float64),
                          self.k_hist_K])

    @classmethod
    def from_flat(cls, flat: Tensor, num_experts: int, dim: int) -> "WindowStats":
        flat = flat.double().cpu()
        e, d = num_experts, dim
        return cls(flat[:e].clone(), flat[e:e + d].clone(), float(flat[e + d]), flat[e + d + 1:].clone())

    def to_lists(self) -> dict:
        return {"counts": self.counts_E.tolist(), "unrouted_sum": self.unrouted_sum_D.tolist(),
                "num_unrouted": self.num_unrouted, "k_hist": self.k_hist_K.tolist()}

    @classmethod
    def from_lists(cls, data: dict) -> "WindowStats":
        return cls(torch.tensor(data["counts"], dtype=torch.float64),
                   torch.tensor(data["unrouted_sum"], dtype=torch.float64), float(data["num_unrouted"]),
                   torch.tensor(data["k_hist"], dtype=torch.float64))


def merge_all(stats: List[WindowStats]) -> WindowStats:
    total = stats[0]
    for s in stats[1:]:
        total = total.merge(s)
    return total

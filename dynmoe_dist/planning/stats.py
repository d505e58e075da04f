"""Window statistics of one MoE layer: plain sums, so merging ranks, windows or nodes is addition.

Shape legend: E experts, D model dim, K = max_experts + 1 histogram bins (k = 0..max_experts).

Tokens with k = 0 are summed per *nearest* expert (argmax of the gate score): the total over experts
is the reference's single unrouted sum, and the per-expert parts let one event add several distinct
experts (one per crowded neighbourhood) instead of several copies of the same gate vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor


@dataclass
class WindowStats:
    counts_E: Tensor
    """Tokens that selected each expert (before any k = 0 fallback), float64."""
    unrouted_sum_ED: Tensor
    """Sum of the raw hidden states of tokens with k = 0, by nearest expert, float64."""
    num_unrouted_E: Tensor
    """Number of tokens with k = 0, by nearest expert, float64."""
    k_hist_K: Tensor
    """Tokens per selected count k, float64."""

    @classmethod
    def empty(
        cls, num_experts: int, dim: int, max_experts: int, device: Union[str, torch.device] = "cpu"
    ) -> "WindowStats":
        """Zeros on `device`: recording on the layer's device needs no host sync per forward."""

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        return cls(zeros(num_experts), zeros(num_experts, dim), zeros(num_experts), zeros(max_experts + 1))

    @property
    def num_tokens(self) -> float:
        return float(self.k_hist_K.sum())  # NOTE: device-to-host sync (planning time, not the hot path)

    @property
    def num_unrouted(self) -> float:
        return float(self.num_unrouted_E.sum())  # NOTE: device-to-host sync (planning time)

    @property
    def unrouted_sum_D(self) -> Tensor:
        return self.unrouted_sum_ED.sum(dim=0)

    def add_tokens(self, selected_TE: Tensor, scores_TE: Tensor, x_TD: Tensor) -> None:
        """Record a batch: selected_TE is the bool selection before any k = 0 fallback."""
        device = self.counts_E.device
        selected_TE, scores_TE, x_TD = (t.detach().to(device) for t in (selected_TE, scores_TE, x_TD))
        k_T = selected_TE.sum(dim=-1)
        # Every token is added with weight 1 if unrouted, else 0: selecting the unrouted tokens by a
        # boolean mask (or bincount) would read their number back to the host once per forward.
        unrouted_T = (k_T == 0).double()
        nearest_T = scores_TE.argmax(dim=-1)
        self.counts_E += selected_TE.sum(dim=0).double()
        self.unrouted_sum_ED.index_add_(0, nearest_T, x_TD.double() * unrouted_T.unsqueeze(-1))
        self.num_unrouted_E.index_add_(0, nearest_T, unrouted_T)
        k_bin_T = k_T.clamp(max=self.k_hist_K.numel() - 1)
        self.k_hist_K.index_add_(0, k_bin_T, torch.ones_like(unrouted_T))

    def merge(self, other: "WindowStats") -> "WindowStats":
        return WindowStats(
            self.counts_E + other.counts_E,
            self.unrouted_sum_ED + other.unrouted_sum_ED,
            self.num_unrouted_E + other.num_unrouted_E,
            self.k_hist_K + other.k_hist_K,
        )

    # -- flat form for one all-reduce / one message per layer ---------------------------------------
    def to_flat(self) -> Tensor:
        return torch.cat([self.counts_E, self.unrouted_sum_ED.reshape(-1), self.num_unrouted_E, self.k_hist_K])

    def to(self, device: Union[str, torch.device]) -> "WindowStats":
        return WindowStats(
            *(t.to(device) for t in (self.counts_E, self.unrouted_sum_ED, self.num_unrouted_E, self.k_hist_K))
        )

    @classmethod
    def from_flat(cls, flat: Tensor, num_experts: int, dim: int) -> "WindowStats":
        flat = flat.double().cpu()  # NOTE: device-to-host sync (planning time, once per event)
        e, d = num_experts, dim
        parts = torch.split(flat, [e, e * d, e, flat.numel() - e - e * d - e])
        return cls(parts[0].clone(), parts[1].reshape(e, d).clone(), parts[2].clone(), parts[3].clone())

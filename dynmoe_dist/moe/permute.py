"""Sort-based permutation of routed (token, expert) pairs: no T x E x C tensor is ever built.

Shape legend: T tokens, D model dim, E experts, R routed pairs (= sum_t k_t), S destination slots.
  token_R   source token of each routed row      expert_R   its expert
  weight_R  its combine weight                   slot_R     its destination slot (rank-major order)

``routed_pairs`` lists the selected pairs in expert-major order straight from the mask (nonzero of
the transposed mask is already sorted by expert, then token), so the single-process path needs no
sort at all. Expert parallelism maps experts (and replicas) to destination slots and sorts by slot.

Host syncs: ``routed_pairs`` reads the per-expert counts once (the number of routed rows is data
dependent under top-any, so one read per layer forward is the floor); everything after it takes its
sizes from that read (``nonzero_static``, ``repeat_interleave(output_size=...)``) or from tensors of
known size (counts by ``index_add_``, not ``bincount``, which reads the maximum back on CUDA).
Gather and combine run fused Triton kernels on CUDA when available (dynmoe_dist.kernels.select).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import select as kernel_select
from .routing import Routing


@dataclass(frozen=True)
class RoutedPairs:
    token_R: Tensor
    expert_R: Tensor
    weight_R: Tensor
    counts_E: Tensor
    """Rows per expert (long, E)."""
    sizes_E: Tuple[int, ...] = ()
    """The same counts as Python ints (read once): segment sizes for the per-expert loop."""


def routed_pairs(
    routing: Routing, counts_E: Optional[Tensor] = None, sizes_E: Optional[Tuple[int, ...]] = None
) -> RoutedPairs:
    """All selected (token, expert) pairs, grouped by expert, tokens ascending within an expert.
    A caller that has read the counts already (with other sizes, in one read) passes them in."""
    if sizes_E is None:
        counts_E = routing.mask.sum(dim=0)
        sizes_E = tuple(counts_E.tolist())  # NOTE: device-to-host sync (the routed-row count, once per layer)
    elif counts_E is None:
        raise ValueError("routed_pairs: sizes_E given without counts_E")
    # nonzero_static with the size just read: plain nonzero would read the count back a second time.
    index_R2 = torch.nonzero_static(routing.mask.t(), size=sum(sizes_E))
    expert_R, token_R = index_R2[:, 0], index_R2[:, 1]
    weight_R = routing.weights[token_R, expert_R]
    return RoutedPairs(token_R, expert_R, weight_R, counts_E, sizes_E)


def gather_rows(x_TD: Tensor, token_R: Tensor) -> Tensor:
    """rows_RD[r] = x_TD[token_R[r]] (the gradient is scattered back with an index-add)."""
    kernels = kernel_select.permute_kernels(x_TD)
    if kernels is not None:
        gathered: Tensor = kernels.gather_rows(x_TD, token_R)
        return gathered
    return x_TD.index_select(0, token_R)


def combine_rows(rows_RD: Tensor, token_R: Tensor, weight_R: Tensor, num_tokens: int) -> Tensor:
    """out_TD[t] = sum over rows r of token t of weight_R[r] * rows_RD[r]; tokens with no row get 0."""
    kernels = kernel_select.permute_kernels(rows_RD)
    if kernels is not None:
        combined: Tensor = kernels.combine_rows(rows_RD, token_R, weight_R, num_tokens)
        return combined
    out: Tensor = _WeightedIndexAdd.apply(rows_RD, token_R, weight_R, num_tokens)  # type: ignore[no-untyped-call]
    return out


class _WeightedIndexAdd(torch.autograd.Function):
    """The combine as one autograd node, because composing ``mul`` and ``index_add`` makes the
    backward allocate three (R, D) tensors (the gathered gradient, the row gradient, and a product
    that is only summed for the weight gradient). Here the gathered gradient is scaled in place into
    the row gradient and the weight gradient is a batched row dot product: one (R, D) allocation, at
    the moment the layer's memory peaks, and two fewer passes over (R, D)."""

    @staticmethod
    def forward(ctx: Any, rows_RD: Tensor, token_R: Tensor, weight_R: Tensor, num_tokens: int) -> Tensor:
        ctx.save_for_backward(rows_RD, token_R, weight_R)
        weighted_RD = rows_RD * weight_R.to(rows_RD.dtype).unsqueeze(-1)
        return rows_RD.new_zeros(num_tokens, rows_RD.shape[-1]).index_add_(0, token_R, weighted_RD)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_TD: Tensor) -> Tuple[Optional[Tensor], ...]:
        rows_RD, token_R, weight_R = ctx.saved_tensors
        grad_rows_RD = grad_TD.index_select(0, token_R)
        grad_weight_R = None
        if ctx.needs_input_grad[2]:
            # bmm of (R, 1, D) by (R, D, 1): a row dot product without an (R, D) product tensor.
            grad_weight_R = torch.bmm(grad_rows_RD.unsqueeze(1), rows_RD.unsqueeze(2)).reshape(-1)
            grad_weight_R = grad_weight_R.to(weight_R.dtype)
        if not ctx.needs_input_grad[0]:
            return None, None, grad_weight_R, None
        grad_rows_RD.mul_(weight_R.to(grad_rows_RD.dtype).unsqueeze(-1))
        return grad_rows_RD, None, grad_weight_R, None


def replica_index(counts_E: Tensor, expert_R: Tensor, num_replicas_E: Tensor) -> Tensor:
    """Split each expert's rows (expert-major order) into contiguous, near-equal chunks, one per replica.

    Row j of expert e (0-based within e's segment) goes to replica floor(j * n_e / count_e), so every
    replica of every source rank gets within one row of the same share: deterministic and balanced.
    """
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    position_R = torch.arange(expert_R.numel(), device=expert_R.device) - starts_E[expert_R]
    count_R = counts_E[expert_R].clamp(min=1)
    return torch.div(position_R * num_replicas_E[expert_R], count_R, rounding_mode="floor")


def replica_row_counts(counts_E: Tensor, num_replicas_E: Tensor, max_replicas: int) -> Tensor:
    """(E, max_replicas) rows that replica_index gives each replica, from the counts alone (on the
    device, no per-row data): replica r of expert e takes the rows j with floor(j n / c) = r, i.e.
    j in [ceil(r c / n), ceil((r + 1) c / n)); 0 for r >= n."""
    r_1M = torch.arange(max_replicas, device=counts_E.device).unsqueeze(0)
    c_E1, n_E1 = counts_E.unsqueeze(-1), num_replicas_E.unsqueeze(-1)

    def ceil(a: Tensor) -> Tensor:
        return torch.div(a + n_E1 - 1, n_E1, rounding_mode="floor")

    return (ceil((r_1M + 1) * c_E1) - ceil(r_1M * c_E1)) * (r_1M < n_E1)


def sort_by_slot(slot_R: Tensor, num_slots: int) -> Tuple[Tensor, Tensor]:
    """Stable argsort of rows by destination slot, plus rows per slot.

    Returns (order_R, counts_S): rows_sorted = rows[order_R]; stability keeps each slot's rows in
    expert-major, token-ascending order, which makes the layout deterministic.
    """
    order_R = torch.argsort(slot_R, stable=True)
    return order_R, count_values(slot_R, num_slots)


def count_values(index_R: Tensor, num_bins: int) -> Tensor:
    """bincount with a known number of bins (long): an index_add_, which never reads back to the host
    (CUDA bincount reads the maximum to size its output)."""
    ones_R = torch.ones_like(index_R)
    return torch.zeros(num_bins, dtype=index_R.dtype, device=index_R.device).index_add_(0, index_R, ones_R)


def inverse_permutation(order_R: Tensor) -> Tensor:
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return inverse_R

"""Plain torch references of the fused permute kernels (permute_triton.py), for tests and gpu-check.

Shape legend: T tokens, D model dim, R routed rows. Autograd differentiates these directly, so the
references of the backward kernels are their autograd gradients. They match moe.permute's torch
path (index_select, and the weighted index-add of _WeightedIndexAdd), kept here because kernels/
must not import moe/ (the dependency runs kernels -> moe).
"""

from __future__ import annotations

from torch import Tensor


def gather_rows(x_TD: Tensor, token_R: Tensor) -> Tensor:
    return x_TD.index_select(0, token_R)


def combine_rows(rows_RD: Tensor, token_R: Tensor, weight_R: Tensor, num_tokens: int) -> Tensor:
    weighted_RD = rows_RD * weight_R.to(rows_RD.dtype).unsqueeze(-1)
    return rows_RD.new_zeros(num_tokens, rows_RD.shape[-1]).index_add(0, token_R, weighted_RD)

"""Grouped GEMM over expert-contiguous row segments, and the torch reference it must match.

Shape legend: R rows (segments back to back), K in features, N out features, e segments (experts);
``offs_e`` are the cumulative segment ends (int32), as torch._grouped_mm takes them.

``grouped_mm`` runs ``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM on Hopper, a native kernel on
CPU) where it supports the operands, and ``grouped_mm_reference`` — one matmul per segment — elsewhere
(float64, unaligned shapes). Tests compare the two.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supports(a_RK: Tensor, b_eKN: Tensor) -> bool:
    """The kernel takes fp32/bf16/fp16 only, with row strides that are multiples of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or a_RK.dtype not in GROUPED_MM_DTYPES:
        return False
    size = a_RK.element_size()
    return (a_RK.shape[-1] * size) % 16 == 0 and (b_eKN.shape[-1] * size) % 16 == 0


def grouped_mm_reference(a_RK: Tensor, b_eKN: Tensor, offs_e: Tensor) -> Tensor:
    starts = [0] + offs_e.tolist()[:-1]  # NOTE: device-to-host sync
    outs = [a_RK[s:e] @ b_eKN[i] for i, (s, e) in enumerate(zip(starts, offs_e.tolist()))]  # NOTE: device-to-host sync
    return torch.cat(outs) if outs else a_RK.new_zeros(0, b_eKN.shape[-1])


def grouped_mm(a_RK: Tensor, b_eKN: Tensor, offs_e: Tensor) -> Tensor:
    if not grouped_mm_supports(a_RK, b_eKN):
        return grouped_mm_reference(a_RK, b_eKN, offs_e)
    out_RN = torch._grouped_mm(a_RK, b_eKN, offs=offs_e)
    if out_RN.requires_grad:
        # The CPU backward of _grouped_mm rejects non-contiguous (e.g. expanded) gradients.
        out_RN.register_hook(lambda grad: grad.contiguous())
    return out_RN

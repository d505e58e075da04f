"""LoRA adapters of routed experts: one rank-r adapter per projection of every expert, held as parameters of
the expert module itself, beside its frozen weights.

Shape legend: R rows, D model dim, F expert hidden dim, r rank, N an adapted projection's output rows, e local
experts.

The layout is PEFT 0.21's ``ParamWrapper`` on transformers' fused expert tensors (and NeMo Automodel's
``GroupedExpertsLoRA``) cut per expert: the input side (gate and up together where the expert is gated) is
one adapter A_in (r, D), B_in (N, r) with N = F, or 2F with the gate's rows first then the up's (Qwen3-MoE's
gate_up_proj order); the output side A_out (r, F), B_out (D, r); the delta is (alpha / r) B A, added to the
projection's output as (alpha / r) (x A^T) B^T. Because the adapters are parameters of the expert module,
everything that enumerates an expert's parameters (``experts.expert_param_specs``: migration with its Adam
state, replication, pruning, checkpoints by logical id) carries them with their expert.
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..kernels.grouped_gemm import grouped_mm

# The two adapted sides of an expert: (A, B) parameter names.
SIDES = {"in": ("lora_a_in", "lora_b_in"), "out": ("lora_a_out", "lora_b_out")}
ADAPTER_PREFIX = "lora_"


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` (qualified or not) is a LoRA adapter's (experts' and dense ones alike)."""
    return name.rsplit(".", 1)[-1].startswith(ADAPTER_PREFIX)


def add_adapters(expert: nn.Module, rank: int, alpha: float, gated: bool) -> None:
    """Give ``expert`` (built with its weights) its adapters, zeros until models.lora.init_adapters draws A, and
    freeze its own weights: from here on only the adapters train."""
    for p in expert.parameters():
        p.requires_grad_(False)
    ffn_dim, dim = cast(Tensor, expert.w_in).shape
    rows_in = 2 * ffn_dim if gated else ffn_dim
    expert.lora_scaling = alpha / rank  # type: ignore[assignment]
    expert.lora_a_in = nn.Parameter(torch.zeros(rank, dim))
    expert.lora_b_in = nn.Parameter(torch.zeros(rows_in, rank))
    expert.lora_a_out = nn.Parameter(torch.zeros(rank, ffn_dim))
    expert.lora_b_out = nn.Parameter(torch.zeros(dim, rank))


def drawn_a(shape: torch.Size, generator: torch.Generator) -> Tensor:
    """PEFT's initialisation of A (r, in): kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B starts
    at zero. Drawn in float64 on the CPU from ``generator``, so the values depend on the seed alone (not the device,
    the dtype or which rank draws them)."""
    bound = 1.0 / shape[1] ** 0.5
    return torch.empty(shape, dtype=torch.float64).uniform_(-bound, bound, generator=generator)


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A generator that depends on ``seed`` and ``name`` alone (an adapter's module name, an expert's key, an added
    expert's event seed), so every rank and world size draws the same numbers."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def redraw_adapters(expert: nn.Module, seed: int) -> None:
    """PEFT's start for an expert an adaptive event adds: each side's A drawn (from ``seed``, the event's seed of
    this expert), B zero, so its delta starts at zero and A and B both get a gradient."""
    generator = seeded_generator(seed, "added expert adapters")
    with torch.no_grad():
        for a_name, b_name in SIDES.values():
            a_rK, b_Nr = getattr(expert, a_name), getattr(expert, b_name)
            a_rK.copy_(drawn_a(a_rK.shape, generator))
            b_Nr.zero_()


def scaling(module: nn.Module) -> float:
    """alpha / r of the adapters on ``module`` (an expert or a dense projection)."""
    return cast(float, module.lora_scaling)


def has_adapters(expert: nn.Module) -> bool:
    return hasattr(expert, "lora_a_in")


def lora_delta(rows_RK: Tensor, a_rK: Tensor, b_Nr: Tensor, scaling: float) -> Tensor:
    """(alpha / r) (x A^T) B^T, in the rows' dtype."""
    dtype = rows_RK.dtype
    return F.linear(F.linear(rows_RK, a_rK.to(dtype)), b_Nr.to(dtype)) * scaling


def side_deltas(expert: nn.Module, side: str, rows_RK: Tensor, parts: int = 1) -> List[Optional[Tensor]]:
    """The adapter's delta of one side of one expert, cut into ``parts`` equal column blocks (gate, up); Nones
    when the expert has no adapters."""
    if not has_adapters(expert):
        return [None] * parts
    a_name, b_name = SIDES[side]
    delta_RN = lora_delta(rows_RK, getattr(expert, a_name), getattr(expert, b_name), scaling(expert))
    return list(delta_RN.chunk(parts, dim=-1))


def grouped_side_deltas(
    experts: Sequence[nn.Module], side: str, rows_RK: Tensor, offs_e: Tensor, parts: int = 1
) -> List[Optional[Tensor]]:
    """``side_deltas`` of every segment at once: two grouped matmuls over the stacked adapters."""
    if not experts or not has_adapters(experts[0]):
        return [None] * parts
    a_name, b_name = SIDES[side]
    dtype = rows_RK.dtype
    a_eKr = torch.stack([getattr(e, a_name).t() for e in experts]).to(dtype)
    b_erN = torch.stack([getattr(e, b_name).t() for e in experts]).to(dtype)
    delta_RN = grouped_mm(grouped_mm(rows_RK, a_eKr, offs_e), b_erN, offs_e) * scaling(experts[0])
    return list(delta_RN.chunk(parts, dim=-1))


def plus(t: Tensor, delta: Optional[Tensor]) -> Tensor:
    return t if delta is None else t + delta

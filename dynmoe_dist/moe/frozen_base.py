"""How LoRA's frozen base is stored (``lora.base_dtype``): in the run's dtype, in bfloat16, or NF4 (QLoRA).

Shape legend: none (whole parameters).

A stored weight stays an ``nn.Parameter`` (frozen) where the weight was, so names, hooks, checkpoints and
everything that enumerates a module's parameters see it as before; only its storage changes:
  'bfloat16'  the weight rounded to bfloat16: 2 bytes a weight;
  'nf4'       a torchao NF4Tensor (moe/nf4.py): about 4.1 bits a weight.
Whoever computes with a stored weight casts it to its input's dtype per call (``w.to(x.dtype)``: an exact
upcast of the bf16 values, a dequantisation of NF4), so the activations and the adapters' gradients are
computed in the run's dtype against the rounded base; the experts' forwards already do, dense projections get
``upcast_forward``. The adapters, a trainable router and the optimizer stay in the run's dtype.

For an expert that moves between ranks (parallel/migrate.py) ``storage_tensors`` are the plain tensors that
hold a stored weight (an NF4 weight's codes, scales and constants), so a move sends its bits, not a float copy,
and the receiver's copy is the sender's bit for bit.
"""

from __future__ import annotations

from functools import reduce
from typing import Any, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import nf4

# The weights of every expert kind a low-precision base stores (biases stay in the run's dtype, as in QLoRA).
EXPERT_WEIGHTS = nf4.EXPERT_WEIGHTS


def stored(weight: Tensor, base_dtype: str) -> Tensor:
    """``weight`` (in the run's dtype) as ``base_dtype`` stores it."""
    if base_dtype == "bfloat16":
        return weight.detach().to(torch.bfloat16)
    if base_dtype == "nf4":
        return nf4.to_nf4(weight)
    return weight


def store(module: nn.Module, attr: str, base_dtype: str) -> None:
    """Replace the weight ``module.attr`` by a frozen parameter holding it as ``base_dtype`` stores it; the old
    tensor is dropped (nothing keeps a copy in the run's dtype)."""
    if base_dtype == "run":
        return
    weight = cast(Tensor, getattr(module, attr))
    if is_stored(weight):
        return
    setattr(module, attr, nn.Parameter(stored(weight, base_dtype), requires_grad=False))


def is_stored(t: Tensor) -> bool:
    """Whether ``t`` is a weight a low-precision base stores (bf16 or NF4)."""
    return t.dtype == torch.bfloat16 or nf4.is_nf4(t)


def store_expert(expert: nn.Module, base_dtype: str) -> nn.Module:
    """``expert`` with its frozen weights stored as ``base_dtype`` says (its adapters and biases unchanged; a
    weight that trains, in a full finetune, stays as it is)."""
    for attr in EXPERT_WEIGHTS:
        weight = getattr(expert, attr, None)
        if weight is not None and not weight.requires_grad:
            store(expert, attr, base_dtype)
    return expert


def storage_tensors(p: Tensor) -> List[Tensor]:
    """The plain tensors that hold ``p``: an NF4 weight's inner tensors, in torchao's flatten order; else ``p``."""
    if not nf4.is_nf4(p):
        return [p]
    names, _ = p.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(p, name) for name in names]


def run_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The run's dtype among an expert's parameters: the widest (adapters and biases keep it; a bf16 weight is
    narrower; an NF4 weight reports the dtype it was quantised from)."""
    return reduce(torch.promote_types, (p.dtype for p in params))


def upcast_forward(linear: nn.Linear) -> None:
    """Compute ``linear`` with its stored weight cast to the input's dtype per call (F.linear needs one dtype);
    the module, its parameters' names and its hooks stay."""
    linear.forward = _upcast_linear.__get__(linear)  # type: ignore[method-assign]


def _upcast_linear(linear: nn.Linear, x: Tensor) -> Tensor:
    return linear_of(x, linear.weight, linear.bias)


def linear_of(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias) in x's dtype. A frozen stored weight (bf16, NF4) is widened for the matmul and
    widened again in the backward, not kept wide for it: F.linear on ``weight.to(x.dtype)`` would keep every
    layer's widened copy alive until the backward, and so hold the whole base in the run's dtype during a step
    (what ``bench lora`` measured: a bf16 base's step peaked higher than a float32 one's)."""
    b = None if bias is None else bias.to(x.dtype)
    if weight.requires_grad or not is_stored(weight):
        return F.linear(x, weight.to(x.dtype), b)
    out = cast(Tensor, _FrozenStoredMatmul.apply(x, weight))  # type: ignore[no-untyped-call]
    return out if b is None else out + b


class _FrozenStoredMatmul(torch.autograd.Function):
    """x @ widen(W)^T for a frozen stored W: the backward needs W for x's gradient and widens it again (torchao's
    ``linear_nf4`` does the same for NF4); W gets no gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.weight = weight  # the stored tensor itself (frozen: nothing changes it before the backward)
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], None]:
        grad_x = grad_out @ ctx.weight.to(grad_out.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None


def upcast_output(embedding: nn.Embedding, dtype: torch.dtype) -> None:
    """An embedding whose table is stored bf16 hands on its rows in ``dtype`` (exact: a bf16 value is a float32)."""
    embedding.register_forward_hook(lambda _module, _args, out_BLD: out_BLD.to(dtype))


def stored_weights(params: Sequence[Tensor], names: Sequence[str], base_dtype: str) -> List[Tensor]:
    """An expert's parameters as loose tensors (a discarded expert remembered for a later event), its frozen
    weights (by ``names``, the parameters' names) stored as ``base_dtype`` says: no float copy of a low-precision
    base is kept for it. (A bf16 one is exact: its values came from bf16 weights.)"""
    if base_dtype == "run":
        return list(params)
    return [stored(p, base_dtype) if name in EXPERT_WEIGHTS else p for p, name in zip(params, names)]

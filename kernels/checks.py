"""Every fused permute kernel against its torch reference, forward and backward, on small cases.

Shape legend: T tokens, D model dim, R routed rows. Used by the CPU tests (under TRITON_INTERPRET=1,
in a subprocess) and by ``python -m dynmoe_dist.bench gpu`` on CUDA. The cases cover tokens with
k = 0 (no row), tokens with several rows, experts with no rows (a token list that skips them),
R = 0 and T = 0. The reference runs in float64 on the same device; the kernel in ``dtype``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from dynmoe_dist.kernels import permute_reference as reference
from torch import Tensor

# (name, T, D, token of each row): expert-major order, as routed_pairs produces it.
CASES: Tuple[Tuple[str, int, int, Tuple[int, ...]], ...] = (
    ("mixed k incl. k=0 tokens", 6, 5, (0, 2, 5, 0, 1, 2, 5, 5, 0)),  # token 3 and 4 have k = 0
    ("one row per token", 4, 33, (3, 2, 1, 0)),
    ("wide rows (several D blocks)", 3, 1500, (0, 1, 1, 2, 0)),
    ("no rows (R = 0)", 4, 8, ()),
    ("no tokens (T = 0)", 0, 8, ()),
)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(num_tokens: int, dim: int, tokens: Tuple[int, ...], device, seed: int):
    g = torch.Generator().manual_seed(seed)
    # A strided column, like the token column of routed_pairs' nonzero_static result.
    token_R = torch.tensor(tokens, dtype=torch.long).repeat_interleave(2).view(-1, 2)[:, 0].to(device)
    x_TD = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64).to(device)
    rows_RD = torch.randn(len(tokens), dim, generator=g, dtype=torch.float64).to(device)
    weight_R = torch.rand(len(tokens), generator=g, dtype=torch.float64).to(device)
    grad_RD = torch.randn(len(tokens), dim, generator=g, dtype=torch.float64).to(device)
    grad_TD = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64).to(device)
    return token_R, x_TD, rows_RD, weight_R, grad_RD, grad_TD


def _grads(fn, inputs: List[Tensor], grad_out: Tensor):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach().double()] + [
        leaf.grad.double() if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
    ]


def _max_err(mine: List[Tensor], theirs: List[Tensor]) -> float:
    errs = [float((a - b).abs().max()) for a, b in zip(mine, theirs) if a.numel()]  # NOTE: device-to-host sync
    return max(errs, default=0.0)


def check_case(kernels, name: str, num_tokens: int, dim: int, tokens, device, dtype, seed: int = 0) -> List[Dict]:
    """Two results (gather, combine): max abs error of output and input gradients vs the reference."""
    token_R, x_TD, rows_RD, weight_R, grad_RD, grad_TD = _inputs(num_tokens, dim, tokens, device, seed)
    tol = TOLERANCE[dtype]
    lowered = [t.to(dtype) for t in (x_TD, rows_RD)]
    gather_mine = _grads(lambda x: kernels.gather_rows(x, token_R), [lowered[0]], grad_RD)
    gather_ref = _grads(lambda x: reference.gather_rows(x, token_R), [lowered[0].double()], grad_RD)
    combine_mine = _grads(
        lambda r, w: kernels.combine_rows(r, token_R, w, num_tokens),
        [lowered[1], weight_R.float() if dtype != torch.float64 else weight_R],
        grad_TD,
    )
    combine_ref = _grads(
        lambda r, w: reference.combine_rows(r, token_R, w, num_tokens), [lowered[1].double(), weight_R], grad_TD
    )
    out = []
    for kernel, mine, ref in (("gather_rows", gather_mine, gather_ref), ("combine_rows", combine_mine, combine_ref)):
        err = _max_err(mine, ref)
        # Low-precision errors grow with the magnitude of the values: bound relative to the scale.
        scale = max([float(t.abs().max()) for t in ref if t.numel()], default=1.0)  # NOTE: device-to-host sync
        bound = tol * max(1.0, scale)
        out.append(
            {
                "kernel": kernel,
                "case": name,
                "dtype": str(dtype).replace("torch.", ""),
                "max_abs_err": err,
                "bound": bound,
                "passed": err <= bound,
            }
        )
    return out


def check_all(kernels, device, dtypes) -> List[Dict]:
    results = []
    for dtype in dtypes:
        for seed, (name, num_tokens, dim, tokens) in enumerate(CASES):
            results += check_case(kernels, name, num_tokens, dim, tokens, device, dtype, seed)
    return results

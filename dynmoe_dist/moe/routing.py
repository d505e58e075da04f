"""Routers: DynMoE top-any gating and the top-k / top-p baselines.

Shape legend: T tokens, D model dim, E experts.
  x_TD      tokens            gate_ED   gate vectors (rows)     threshold_E  per-expert thresholds
  mask_TE   bool selections   weights_TE combine weights         num_selected_T  k per token

Every router returns a ``Routing``. ``weights_TE`` is zero wherever ``mask_TE`` is False and carries
exactly the gradient docs/algorithm.md section 1 prescribes; ``gates_TE`` is the differentiable 0/1 selection
that the efficiency and load-balance losses need (for top-k/top-p it is the mask as float).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

COSINE_EPS = 1e-12


@dataclass(frozen=True)
class Routing:
    mask: Tensor
    """bool (T, E): token t selected expert e."""
    weights: Tensor
    """(T, E) combine weights, zero where unselected."""
    num_selected: Tensor
    """long (T,): number of selected experts per token (k_t); may be 0 in top-any training."""
    gates: Tensor
    """(T, E) differentiable 0/1 selection (straight-through for top-any)."""
    probs: Optional[Tensor] = None
    """(T, E) router scores: sigmoid scores for top-any, softmax probabilities for top-k/top-p."""

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[0]

    @property
    def num_experts(self) -> int:
        return self.mask.shape[1]


def gate_dtype(t: Tensor) -> torch.dtype:
    """Gate math never runs below fp32 (bf16/fp16 inputs are upcast; float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def cosine_scores(x_TD: Tensor, gate_ED: Tensor) -> Tensor:
    """cos(x_t, W_e), computed in at least fp32.

    The same value as F.normalize on both sides (norms clamped at eps), but the token norms divide
    the small (T, E) product: normalising the tokens first would build a (T, D) copy that autograd
    keeps alive until the backward, 4 MB per 4096 x 256 fp32 tokens, for nothing."""
    dtype = torch.promote_types(gate_dtype(x_TD), gate_dtype(gate_ED))
    x_TD = x_TD.to(dtype)
    gate_ED = F.normalize(gate_ED.to(dtype), dim=-1, eps=COSINE_EPS)
    norm_T1 = torch.linalg.vector_norm(x_TD, dim=-1, keepdim=True).clamp_min(COSINE_EPS)
    cosine_TE: Tensor = (x_TD @ gate_ED.t()) / norm_T1
    return cosine_TE


def straight_through_sign(r_TE: Tensor) -> Tensor:
    """Forward: sign(r) (r >= 0 so this is 0/1); backward: identity.

    Because r = relu(p - th), the identity backward still gives zero gradient to every pair that
    was not selected: the ReLU sits before the estimator.
    """
    return r_TE + (torch.sign(r_TE) - r_TE).detach()


def top_any(
    x_TD: Tensor,
    weight: Tensor,
    threshold: Tensor,
    *,
    training: bool,
    scale: float = 1.0,
    train_k0: str = "zero",
    eval_k0: str = "top1",
) -> Routing:
    """DynMoE top-any gating: token t selects every expert e with sigmoid(s cos) > sigmoid(s G_e).

    Combine weights are 1/k (k = selected count, an integer: no gradient flows through it).
    Tokens with k = 0 get output 0 in training (``train_k0='zero'``, the reference) or the top-1
    fallback (``'top1'``); at evaluation they fall back to top-1 (``eval_k0='top1'``, the reference)
    or skip the layer (``'skip'``).
    """
    probs_TE = torch.sigmoid(scale * cosine_scores(x_TD, weight))
    threshold_E = torch.sigmoid(scale * threshold.to(probs_TE.dtype))
    gates_TE = straight_through_sign(F.relu(probs_TE - threshold_E))
    mask_TE = gates_TE.detach() > 0
    num_selected_T = mask_TE.sum(dim=-1)
    weights_TE = gates_TE / num_selected_T.clamp(min=1).unsqueeze(-1).to(gates_TE.dtype)
    k0_mode = train_k0 if training else eval_k0
    if k0_mode == "top1":
        mask_TE, weights_TE = _top1_fallback(probs_TE, mask_TE, weights_TE, num_selected_T)
        num_selected_T = mask_TE.sum(dim=-1)
    return Routing(mask_TE, weights_TE, num_selected_T, gates_TE, probs_TE)


def _top1_fallback(
    probs_TE: Tensor, mask_TE: Tensor, weights_TE: Tensor, num_selected_T: Tensor
) -> Tuple[Tensor, Tensor]:
    """Give every token with k = 0 its argmax expert with weight 1 (a constant: no gate gradient)."""
    empty_T = num_selected_T == 0
    best_T = probs_TE.detach().argmax(dim=-1)
    fallback_TE = F.one_hot(best_T, probs_TE.shape[-1]).bool() & empty_T.unsqueeze(-1)
    return mask_TE | fallback_TE, weights_TE + fallback_TE.to(weights_TE.dtype)


def top_k(logits_TE: Tensor, k: int) -> Routing:
    """GShard/Switch: softmax, keep the k largest, renormalise the kept probabilities."""
    num_experts = logits_TE.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k ({k}) must be in [1, num_experts ({num_experts})]")
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    _, index_TK = probs_TE.topk(k, dim=-1)
    mask_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(-1, index_TK, True)
    kept_TE = probs_TE * mask_TE
    weights_TE = kept_TE / kept_TE.sum(dim=-1, keepdim=True)
    return Routing(mask_TE, weights_TE, mask_TE.sum(dim=-1), mask_TE.to(probs_TE.dtype), probs_TE)


def top_p(logits_TE: Tensor, p: float) -> Routing:
    """Huang et al.: softmax, sort descending, keep the smallest prefix whose mass exceeds p.

    The expert whose probability makes the cumulative mass cross p is kept (strictly greater), so
    at least one expert is always kept. Weights are the raw probabilities (not renormalised).
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p ({p}) must be in (0, 1]")
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    sorted_TE, order_TE = probs_TE.detach().sort(dim=-1, descending=True)
    mass_before_TE = sorted_TE.cumsum(dim=-1) - sorted_TE
    # Keep rank i while the mass of the ranks before it has not yet exceeded p.
    keep_sorted_TE = mass_before_TE <= p
    mask_TE = torch.zeros_like(keep_sorted_TE).scatter_(-1, order_TE, keep_sorted_TE)
    weights_TE = probs_TE * mask_TE
    return Routing(mask_TE, weights_TE, mask_TE.sum(dim=-1), mask_TE.to(probs_TE.dtype), probs_TE)

"""Auxiliary losses of DynMoE (DYNMOE.md section 2) and the Switch load-balance baseline.

Token statistics are formed as sums and divided by counts only after ``reduce_sum``: with the
identity (one process) this is the plain mean; under data parallelism ``reduce_sum`` adds the sums of
all ranks, so every rank computes the loss of the *global* batch and the result does not depend on
how the batch was split.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .routing import COSINE_EPS, Routing, gate_dtype

ReduceSum = Callable[[Tensor], Tensor]


def identity_sum(t: Tensor) -> Tensor:
    return t


def diverse_loss(weight_ED: Tensor) -> Tensor:
    """|| Wn Wn^T - I ||_F with Wn the row-normalised gate vectors (Frobenius norm, not squared)."""
    wn_ED = F.normalize(weight_ED.to(gate_dtype(weight_ED)), dim=-1, eps=COSINE_EPS)
    gram_EE = wn_ED @ wn_ED.t()
    eye_EE = torch.eye(gram_EE.shape[0], dtype=gram_EE.dtype, device=gram_EE.device)
    return torch.linalg.matrix_norm(gram_EE - eye_EE, ord="fro")


def simple_loss(weight_ED: Tensor) -> Tensor:
    """mean_e ||W_e||_2."""
    return weight_ED.to(gate_dtype(weight_ED)).norm(dim=-1).mean()


def load_balance_loss(routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """E^2 * mean_e(me_e * ce_e) over tokens with k > 0.

    me_e = mean_t g/k (differentiable: the combine weights), ce_e = mean_t g (no gradient).
    """
    num_experts = routing.num_experts
    routed_T = routing.num_selected > 0
    weights_TE = routing.weights * routed_T.unsqueeze(-1)
    selected_TE = (routing.mask & routed_T.unsqueeze(-1)).to(weights_TE.dtype)
    num_routed = reduce_sum(routed_T.sum().to(weights_TE.dtype).reshape(1)).clamp(min=1)
    me_E = reduce_sum(weights_TE.sum(dim=0)) / num_routed
    ce_E = reduce_sum(selected_TE.sum(dim=0)).detach() / num_routed
    return num_experts**2 * (me_E * ce_E).mean()


def efficiency_loss(routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """mean_{t,e} g[t,e] = mean k / E (straight-through gradient on selected pairs)."""
    num_tokens, num_experts = routing.gates.shape
    total = reduce_sum(routing.gates.sum().reshape(1))
    count = reduce_sum(torch.tensor([float(num_tokens * num_experts)], device=routing.gates.device))
    return (total / count.clamp(min=1)).squeeze(0)


def switch_loss(probs_TE: Tensor, routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """E * sum_e f_e * Pbar_e: f_e = share of routed (token, expert) pairs sent to e (no gradient),
    Pbar_e = mean router probability of e. Equals 1 under perfectly uniform routing."""
    num_tokens, num_experts = probs_TE.shape
    assigned_E = reduce_sum(routing.mask.to(probs_TE.dtype).sum(dim=0)).detach()
    f_E = assigned_E / assigned_E.sum().clamp(min=1)
    count = reduce_sum(torch.tensor([float(num_tokens)], device=probs_TE.device))
    pbar_E = reduce_sum(probs_TE.sum(dim=0)) / count.clamp(min=1)
    return num_experts * (f_E * pbar_E).sum()

"""Auxiliary losses of DynMoE (docs/algorithm.md section 2), the Switch load-balance baseline, the
router-entropy loss of the top-p baseline (Huang et al. 2024), and the joint load-balance loss of the
transformers MoE families (their ``load_balancing_loss_func``).

Shape legend: T tokens, E experts, L MoE layers.

Token statistics are formed as sums and divided by counts only after ``reduce_sum``: with the
identity (one process) this is the plain mean; under data parallelism ``reduce_sum`` adds the sums of
all ranks, so every rank computes the loss of the *global* batch and the result does not depend on
how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

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
    norm: Tensor = torch.linalg.matrix_norm(gram_EE - eye_EE, ord="fro")
    return norm


def simple_loss(weight_ED: Tensor) -> Tensor:
    """mean_e ||W_e||_2."""
    norms_E: Tensor = torch.linalg.vector_norm(weight_ED.to(gate_dtype(weight_ED)), dim=-1)
    return norms_E.mean()


# -- token-statistic losses: local sums -> one reduction -> the loss of the global batch -------------
TOKEN_LOSSES = ("load_balance", "efficiency", "switch", "entropy")

# Huang et al. weight their entropy ("dynamic") loss 1e-4 against 1e-2 for load balance. The layer
# multiplies every aux term by moe.aux_loss_weight (0.01), so the entropy term carries the ratio itself.
ENTROPY_RELATIVE_WEIGHT = 0.01


def entropy_loss(probs_TE: Tensor) -> Tensor:
    """mean_t ( -sum_e P_te log P_te ): the router entropy, unweighted. Pushes each token's softmax mass
    onto few experts, so top-p keeps a short prefix (0 * log 0 counts as 0)."""
    return -_p_log_p(probs_TE).sum(dim=-1).mean()


def _p_log_p(probs_TE: Tensor) -> Tensor:
    # The clamp keeps 0 * log 0 = 0 with a finite gradient where P underflows to 0 (xlogy's is -inf).
    return probs_TE * torch.log(probs_TE.clamp_min(torch.finfo(probs_TE.dtype).tiny))


def token_sums(name: str, routing: Routing) -> List[Tensor]:
    """The local (this batch's) sums a token-statistic loss needs, as 1-D tensors in a fixed order."""
    dtype = routing.weights.dtype
    num_tokens, num_experts = routing.mask.shape
    if name == "load_balance":
        routed_T = routing.num_selected > 0
        weights_TE = routing.weights * routed_T.unsqueeze(-1)
        selected_TE = (routing.mask & routed_T.unsqueeze(-1)).to(dtype)
        return [routed_T.sum().to(dtype).reshape(1), weights_TE.sum(dim=0), selected_TE.sum(dim=0)]
    if name == "efficiency":
        count = torch.full((1,), float(num_tokens * num_experts), dtype=dtype, device=routing.mask.device)
        return [routing.gates.sum().to(dtype).reshape(1), count]
    if name == "switch":
        count = torch.full((1,), float(num_tokens), dtype=dtype, device=routing.mask.device)
        assert routing.probs is not None, "the switch loss needs the router's softmax probabilities"
        return [routing.mask.to(dtype).sum(dim=0), count, routing.probs.to(dtype).sum(dim=0)]
    if name == "entropy":
        count = torch.full((1,), float(num_tokens), dtype=dtype, device=routing.mask.device)
        assert routing.probs is not None, "the entropy loss needs the router's softmax probabilities"
        probs_TE = routing.probs.to(dtype)
        return [-_p_log_p(probs_TE).sum().reshape(1), count]
    raise ValueError(f"aux loss ({name!r}) has no token statistics; token losses are {TOKEN_LOSSES}")


def loss_from_sums(name: str, sums: Sequence[Tensor], num_experts: int) -> Tensor:
    """The loss from sums over the whole (global) batch."""
    if name == "load_balance":
        # E^2 * mean_e(me_e * ce_e) over tokens with k > 0: me_e = mean_t g/k (differentiable: the
        # combine weights), ce_e = mean_t g (no gradient).
        num_routed, weight_E, select_E = sums
        num_routed = num_routed.clamp(min=1)
        return num_experts**2 * ((weight_E / num_routed) * (select_E.detach() / num_routed)).mean()
    if name == "efficiency":
        # mean_{t,e} g[t,e] = mean k / E (straight-through gradient on selected pairs)
        gates, count = sums
        return (gates / count.clamp(min=1)).squeeze(0)
    if name == "entropy":
        entropy_sum, count = sums
        return ENTROPY_RELATIVE_WEIGHT * (entropy_sum / count.clamp(min=1)).squeeze(0)
    # switch: E * sum_e f_e * Pbar_e; f_e = share of routed pairs sent to e (no gradient), Pbar_e = mean
    # router probability of e. Equals 1 under perfectly uniform routing.
    assigned_E, count, probs_E = sums
    f_E = assigned_E.detach() / assigned_E.detach().sum().clamp(min=1)
    return num_experts * (f_E * (probs_E / count.clamp(min=1))).sum()


def reduce_together(groups: Sequence[Sequence[Tensor]], reduce_sum: ReduceSum) -> List[List[Tensor]]:
    """Reduce every sum of every group with ONE call of reduce_sum (one collective under data parallelism)."""
    flat = [t.reshape(-1) for group in groups for t in group]
    if not flat:
        return [[] for _ in groups]
    reduced = torch.split(reduce_sum(torch.cat(flat)), [t.numel() for t in flat])
    out, index = [], 0
    for group in groups:
        out.append([r.reshape(t.shape) for r, t in zip(reduced[index : index + len(group)], group)])
        index += len(group)
    return out


def token_losses(names: Sequence[str], routing: Routing, reduce_sum: ReduceSum = identity_sum) -> List[Tensor]:
    sums = reduce_together([token_sums(n, routing) for n in names], reduce_sum)
    return [loss_from_sums(n, s, routing.num_experts) for n, s in zip(names, sums)]


def load_balance_loss(routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """E^2 * mean_e(me_e * ce_e) over tokens with k > 0 (see loss_from_sums)."""
    return token_losses(["load_balance"], routing, reduce_sum)[0]


def efficiency_loss(routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """mean_{t,e} g[t,e] = mean k / E."""
    return token_losses(["efficiency"], routing, reduce_sum)[0]


def switch_loss(probs_TE: Tensor, routing: Routing, reduce_sum: ReduceSum = identity_sum) -> Tensor:
    """E * sum_e f_e * Pbar_e with the probabilities probs_TE."""
    routing = Routing(routing.mask, routing.weights, routing.num_selected, routing.gates, probs_TE)
    return token_losses(["switch"], routing, reduce_sum)[0]


# -- the transformers families' joint load-balance loss ------------------------------------------------
# transformers' load_balancing_loss_func concatenates the router logits of ALL layers and computes ONE
# Switch loss over them: E * sum_e f_e P_e with f_e = (top-k picks of e, all layers) / rows and P_e =
# (softmax mass of e, all layers) / rows, rows = tokens x layers. That is not a sum of per-layer losses (the
# products mix layers), but both factors are sums over (layer, token): each layer hands its per-token
# statistics to the aux collection of the forward (moe/aux_collector.py), whose owner sums them over the
# layers (and over the data ranks, with one reduction) and forms the loss once. Per token, not summed in the
# layer, so that the owner can drop padding by the attention mask as transformers does.


@dataclass(frozen=True)
class BalanceTerm:
    """One MoE layer's share of the joint load-balance loss of a transformers MoE family."""

    selected_TE: Tensor
    """float32 0/1: e is among the top-k of softmax(logits) (no gradient; transformers' histc counts)."""
    probs_TE: Tensor
    """float32 softmax(logits), the softmax taken in the logits' dtype as transformers does."""
    coef: float
    """router_aux_loss_coef."""
    reduce_sum: ReduceSum
    """The layer's reduction of token statistics over the data ranks (identity in one process)."""
    loss_scale: float
    """The reducer's loss scale (1/world under data parallelism: the ranks' losses sum to the global one)."""


def balance_term(
    logits_TE: Tensor, top_k: int, coef: float, reduce_sum: ReduceSum = identity_sum, loss_scale: float = 1.0
) -> BalanceTerm:
    """A layer's statistics from its router logits, exactly as load_balancing_loss_func forms them (softmax in
    the logits' dtype, top-k of that softmax, then float32)."""
    probs_TE = torch.softmax(logits_TE, dim=-1)
    index_TK = torch.topk(probs_TE, top_k, dim=-1)[1]
    selected_TE = torch.zeros(probs_TE.shape, dtype=torch.float32, device=probs_TE.device).scatter_(-1, index_TK, 1.0)
    return BalanceTerm(selected_TE, probs_TE.float(), coef, reduce_sum, loss_scale)


def joint_balance_sums(terms: Sequence[BalanceTerm], token_weight_T: Optional[Tensor] = None) -> List[Tensor]:
    """[picks_E, probs_E, rows (1,)] summed over the layers, in transformers' order (a running sum from zero,
    layer by layer). ``token_weight_T``: the attention mask (0 for padding), the same for every layer.
    Layers with fewer experts (after an adaptive event) count as zeros in the missing expert positions."""
    num_experts = max(t.selected_TE.shape[-1] for t in terms)
    like = terms[0].probs_TE
    picks_E = like.new_zeros(num_experts)
    probs_E = like.new_zeros(num_experts)
    rows = like.new_zeros(1)
    weight_T1 = None if token_weight_T is None else token_weight_T.reshape(-1, 1).to(like)
    for term in terms:
        selected_TE, term_probs_TE = term.selected_TE, term.probs_TE
        if weight_T1 is not None:
            selected_TE, term_probs_TE = selected_TE * weight_T1, term_probs_TE * weight_T1
        pad = num_experts - selected_TE.shape[-1]
        picks_E = picks_E + F.pad(selected_TE.sum(dim=0), (0, pad))
        probs_E = probs_E + F.pad(term_probs_TE.sum(dim=0), (0, pad))
        rows = rows + (weight_T1.sum() if weight_T1 is not None else selected_TE.shape[0])
    return [picks_E, probs_E, rows]


def joint_balance_from_sums(sums: Sequence[Tensor]) -> Tensor:
    """E * sum_e (picks_e / rows) (probs_e / rows), from sums over the whole (global) batch and all layers."""
    picks_E, probs_E, rows_1 = sums
    # A 0-d divisor, as transformers' running total is: torch divides by a CPU scalar through another kernel
    # path (a reciprocal product) than by a 1-element tensor, and the two differ in the last bit.
    rows = rows_1.reshape(())
    loss: Tensor = torch.sum((picks_E.detach() / rows) * (probs_E / rows)) * picks_E.shape[0]
    return loss


def joint_balance_loss(terms: Sequence[BalanceTerm], token_weight_T: Optional[Tensor] = None) -> Tensor:
    """coef * the family's load-balance loss over all ``terms`` (every layer of one forward), the statistics
    summed over the data ranks in one reduction (the first term's reducer: every layer has the same one)."""
    first = terms[0]
    if any(t.coef != first.coef or t.loss_scale != first.loss_scale for t in terms):
        raise ValueError(
            "joint load-balance terms disagree on router_aux_loss_coef or loss scale: "
            f"{sorted({(t.coef, t.loss_scale) for t in terms})}"
        )
    sums = reduce_together([joint_balance_sums(terms, token_weight_T)], first.reduce_sum)[0]
    return first.coef * joint_balance_from_sums(sums) * first.loss_scale

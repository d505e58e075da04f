"""Routers: DynMoE top-any gating, the top-k / top-p baselines, and the native rules of the transformers MoE
families a checkpoint can be imported from (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss).

Shape legend: T tokens, D model dim, E experts, K experts chosen per token, G expert groups.
  x_TD      tokens            gate_ED   gate vectors (rows)     threshold_E  per-expert thresholds
  mask_TE   bool selections   weights_TE combine weights         num_selected_T  k per token
  logits_TE router logits     index_TK  chosen experts           correction_E DeepSeek's e_score_correction_bias

Every router returns a ``Routing``. ``weights_TE`` is zero wherever ``mask_TE`` is False and carries
exactly the gradient docs/algorithm.md section 1 prescribes; ``gates_TE`` is the differentiable 0/1 selection
that the efficiency and load-balance losses need (for top-k/top-p it is the mask as float).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

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
    """(T, E) router scores: sigmoid scores for top-any, softmax probabilities for top-k/top-p and the native
    softmax rules, sigmoid scores for DeepSeek's rule, softmax(logits) for gpt-oss's."""
    logits: Optional[Tensor] = None
    """(T, E) raw router logits (native rules only): transformers' load-balance loss recomputes its softmax
    from them, in their dtype, and the joint loss must do the same to equal it."""

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
    unit_ED = F.normalize(gate_ED.to(dtype), dim=-1, eps=COSINE_EPS)
    cosine_TE: Tensor = _TokenCosine.apply(x_TD.to(dtype), unit_ED)  # type: ignore[no-untyped-call]
    return cosine_TE


class _TokenCosine(torch.autograd.Function):
    """(x_t . u_e) / max(|x_t|, eps) for unit rows u, with the backward written out.

    Autograd's backward of the token norm (linalg.vector_norm) makes five (T, D) passes (x / norm, a
    masked_fill for zero norms, products and sums) and was half of the top-any router's time at T 4096,
    D 256: more than top-k's whole router. By hand, with c = cos and n = the clamped norm:
      d c_te / d x_t = u_e / n_t - c_te x_t / n_t^2      (the second term 0 where the norm was clamped)
    so grad_x = (G / n) @ U - x * (sum_e (G / n)_te c_te) / n: one matmul and one fused (T, D) pass.
    The forward is the same expression as before, so the scores are bit for bit the same."""

    @staticmethod
    def forward(ctx: Any, x_TD: Tensor, unit_ED: Tensor) -> Tensor:
        norm_T1 = torch.linalg.vector_norm(x_TD, dim=-1, keepdim=True).clamp_min(COSINE_EPS)
        cosine_TE: Tensor = (x_TD @ unit_ED.t()) / norm_T1
        ctx.save_for_backward(x_TD, unit_ED, norm_T1, cosine_TE)
        return cosine_TE

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_TE: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        x_TD, unit_ED, norm_T1, cosine_TE = ctx.saved_tensors
        scaled_TE = grad_TE / norm_T1
        grad_x = grad_unit = None
        if ctx.needs_input_grad[0]:
            radial_T1 = (scaled_TE * cosine_TE).sum(dim=-1, keepdim=True) / norm_T1
            radial_T1 = radial_T1.masked_fill(norm_T1 <= COSINE_EPS, 0.0)  # a clamped norm is a constant
            grad_x = (scaled_TE @ unit_ED).addcmul_(x_TD, radial_T1, value=-1)
        if ctx.needs_input_grad[1]:
            grad_unit = scaled_TE.t() @ x_TD
        return grad_x, grad_unit


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
    combine: str = "equal",
) -> Routing:
    """DynMoE top-any gating: token t selects every expert e with sigmoid(s cos) > sigmoid(s G_e).

    Combine weights are 1/k (k = selected count, an integer: no gradient flows through it), or with
    ``combine='softmax'`` the softmax of the logits x . W_e over the chosen experts (a router converted
    from a transformers MoE: its own probabilities, renormalised over what top-any chose).
    Tokens with k = 0 get output 0 in training (``train_k0='zero'``, the reference) or the top-1
    fallback (``'top1'``); at evaluation they fall back to top-1 (``eval_k0='top1'``, the reference)
    or skip the layer (``'skip'``).
    """
    probs_TE = torch.sigmoid(scale * cosine_scores(x_TD, weight))
    threshold_E = torch.sigmoid(scale * threshold.to(probs_TE.dtype))
    gates_TE = straight_through_sign(F.relu(probs_TE - threshold_E))
    mask_TE = gates_TE.detach() > 0
    num_selected_T = mask_TE.sum(dim=-1)
    if combine == "softmax":
        weights_TE = gates_TE * chosen_softmax(x_TD, weight, mask_TE)
    else:
        weights_TE = gates_TE / num_selected_T.clamp(min=1).unsqueeze(-1).to(gates_TE.dtype)
    k0_mode = train_k0 if training else eval_k0
    if k0_mode == "top1":
        mask_TE, weights_TE = _top1_fallback(probs_TE, mask_TE, weights_TE, num_selected_T)
        num_selected_T = mask_TE.sum(dim=-1)
    return Routing(mask_TE, weights_TE, num_selected_T, gates_TE, probs_TE)


def chosen_softmax(x_TD: Tensor, weight: Tensor, mask_TE: Tensor) -> Tensor:
    """softmax of the router logits x . W_e over each token's chosen experts (0 elsewhere, and for a token
    that chose none): a converted router's native probabilities renormalised over the top-any choice."""
    dtype = torch.promote_types(gate_dtype(x_TD), gate_dtype(weight))
    logits_TE = x_TD.to(dtype) @ weight.to(dtype).t()
    masked_TE = logits_TE.masked_fill(~mask_TE, float("-inf"))
    any_T1 = mask_TE.any(dim=-1, keepdim=True)
    soft_TE = torch.softmax(masked_TE.masked_fill(~any_T1, 0.0), dim=-1)
    return soft_TE * mask_TE


def _top1_fallback(
    probs_TE: Tensor, mask_TE: Tensor, weights_TE: Tensor, num_selected_T: Tensor
) -> Tuple[Tensor, Tensor]:
    """Give every token with k = 0 its argmax expert with weight 1 (a constant: no gate gradient)."""
    empty_T = num_selected_T == 0
    best_T = probs_TE.detach().argmax(dim=-1)
    fallback_TE = F.one_hot(best_T, probs_TE.shape[-1]).bool() & empty_T.unsqueeze(-1)
    return mask_TE | fallback_TE, weights_TE + fallback_TE.to(weights_TE.dtype)


def top_k(logits_TE: Tensor, k: int, choice_bias_E: Optional[Tensor] = None) -> Routing:
    """GShard/Switch: softmax, keep the k largest, renormalise the kept probabilities.

    ``choice_bias_E`` (moe.balance = 'bias', DeepSeek-V3's rule on a softmax router) is added to the
    probabilities for choosing only: the weights stay the kept probabilities, renormalised."""
    num_experts = logits_TE.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k ({k}) must be in [1, num_experts ({num_experts})]")
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    choice_TE = probs_TE if choice_bias_E is None else probs_TE.detach() + choice_bias_E.to(probs_TE.dtype)
    _, index_TK = choice_TE.topk(k, dim=-1)
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


# -- the native rules of the transformers MoE families --------------------------------------------------
SCORE_FUNCTIONS = ("softmax", "sigmoid", "logits")
WEIGHT_MODES = ("scores", "renormalised", "softmax")
PRECISIONS = ("float32_scores", "float32", "model")
# DeepSeek-V3 adds this to the denominator when it renormalises its sigmoid scores (a softmax's chosen
# scores never sum to ~0, so the softmax families divide by the plain sum).
SIGMOID_RENORM_EPS = 1e-20


@dataclass(frozen=True)
class NativeRule:
    """How a transformers MoE family routes, read from its checkpoint's config (models/hf/families/).

    Not a run option: the checkpoint fixes it and every rank (and every resume) reads the same checkpoint. It
    travels on the router module (``NativeRouter.rule``), so it never enters [moe], --help, to_toml or the
    run config's digest.

      family       scores   chosen by                                   weights
      Mixtral      softmax  top-k scores                                renormalised
      Qwen2/3-MoE  softmax  top-k scores                                renormalised if norm_topk_prob
      OLMoE        softmax  top-k scores                                renormalised if norm_topk_prob
      DeepSeek-V3  sigmoid  top-k of scores + correction bias, within   renormalised if norm_topk_prob,
                            the top_groups groups of largest top-2 sum  times scaling_factor
      gpt-oss      logits   top-k logits (router with a bias)           softmax over the chosen logits
      Mistral 4    softmax  top-k scores within the top_groups groups   renormalised if norm_topk_prob,
                            of largest top-2 sum                        times scaling_factor
    """

    top_k: int
    """Experts per token (num_experts_per_tok)."""
    scores: str = "softmax"
    """Router logits -> scores: 'softmax' (over all experts), 'sigmoid' (per expert) or 'logits' (as they are)."""
    weights: str = "renormalised"
    """Combine weights of the chosen experts: 'scores' (their scores), 'renormalised' (divided by their sum) or
    'softmax' (a softmax over the chosen scores)."""
    num_groups: int = 1
    """Expert groups (DeepSeek's and Mistral 4's n_group): experts e*E/G .. (e+1)*E/G - 1 form group e."""
    top_groups: int = 1
    """Groups a token may choose from (DeepSeek's topk_group), those with the largest sum of their top-2 scores."""
    scaling_factor: float = 1.0
    """Multiplies the combine weights (DeepSeek's routed_scaling_factor)."""
    router_bias: bool = False
    """The router's linear layer has a bias (gpt-oss)."""
    correction_bias: bool = False
    """A per-expert bias added to the scores for choosing only, not for weighting (DeepSeek's
    e_score_correction_bias)."""
    precision: str = "float32_scores"
    """'float32_scores': logits in the model's dtype, scores and weights in float32 (Mixtral, Qwen, OLMoE);
    'float32': logits too (DeepSeek); 'model': all in the model's dtype (gpt-oss)."""
    output_router_logits: bool = False
    """The checkpoint's switch for its joint load-balance loss (transformers adds the loss when it is set)."""
    aux_loss_coef: float = 0.0
    """Weight of that loss (router_aux_loss_coef; 0 for a family without one, DeepSeek-V3)."""

    def __post_init__(self) -> None:
        for name, allowed in (("scores", SCORE_FUNCTIONS), ("weights", WEIGHT_MODES), ("precision", PRECISIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"NativeRule.{name} ({value!r}) must be one of {allowed}")
        if self.top_k < 1:
            raise ValueError(f"NativeRule.top_k ({self.top_k}) must be >= 1")
        if not 1 <= self.top_groups <= self.num_groups:
            raise ValueError(
                f"NativeRule.top_groups ({self.top_groups}) must be in [1, num_groups ({self.num_groups})]"
            )
        if self.num_groups > 1 and self.scores == "logits":
            raise ValueError(
                f"NativeRule.num_groups ({self.num_groups}) > 1 needs scores 'sigmoid' or 'softmax' (DeepSeek's, "
                "Mistral 4's rules)"
            )
        if self.correction_bias and self.scores != "sigmoid":
            raise ValueError("NativeRule.correction_bias needs scores 'sigmoid' (DeepSeek's rule)")
        if self.aux_loss_coef < 0:
            raise ValueError(f"NativeRule.aux_loss_coef ({self.aux_loss_coef}) must be >= 0")

    def check_experts(self, num_experts: int) -> None:
        """ValueError unless the rule can route over ``num_experts`` experts (checked at every resize too)."""
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts ({num_experts})]")
        if num_experts % self.num_groups:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_groups ({self.num_groups})")
        per_group = num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(f"num_experts ({num_experts}) gives groups of {per_group}: a group scores its top 2")
        if self.top_k > self.top_groups * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) > the {self.top_groups * per_group} experts of top_groups ({self.top_groups}) "
                f"groups of {per_group}"
            )


def native_logits(x_TD: Tensor, weight_ED: Tensor, bias_E: Optional[Tensor], precision: str) -> Tensor:
    """The router's logits in the family's dtype: float32 for DeepSeek (it casts both operands), else the model's."""
    dtype = torch.float32 if precision == "float32" else torch.promote_types(x_TD.dtype, weight_ED.dtype)
    bias = None if bias_E is None else bias_E.to(dtype)
    return F.linear(x_TD.to(dtype), weight_ED.to(dtype), bias)


def group_limited(choice_TE: Tensor, num_groups: int, top_groups: int) -> Tensor:
    """DeepSeek-V3: -inf outside the ``top_groups`` groups whose two best choice scores sum highest
    (transformers' DeepseekV3TopkRouter, step for step, so that ties fall the same way)."""
    num_experts = choice_TE.shape[-1]
    per_group = num_experts // num_groups
    group_scores_TG = choice_TE.view(-1, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_index_TJ = torch.topk(group_scores_TG, k=top_groups, dim=-1, sorted=False)[1]
    group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_index_TJ, 1)
    allowed_TE = group_mask_TG.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(-1, num_experts)
    return choice_TE.masked_fill(~allowed_TE.bool(), float("-inf"))


def _chosen(logits_TE: Tensor, rule: NativeRule, correction_E: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(scores_TE, chosen scores top_TK, chosen experts index_TK) in the family's order of operations."""
    if rule.scores == "logits":  # gpt-oss: top-k of the logits themselves
        top_TK, index_TK = torch.topk(logits_TE, rule.top_k, dim=-1)
        return logits_TE, top_TK, index_TK
    score_dtype = logits_TE.dtype if rule.precision == "model" else torch.float32
    if rule.scores == "softmax" and rule.num_groups == 1:
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=score_dtype)
        top_TK, index_TK = torch.topk(scores_TE, rule.top_k, dim=-1)
        return scores_TE, top_TK, index_TK
    # sigmoid (DeepSeek), or softmax within groups (Mistral 4): choose by scores + correction bias (within the
    # best groups), weigh by the scores
    if rule.scores == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=score_dtype)
    else:
        scores_TE = logits_TE.to(score_dtype).sigmoid()
    choice_TE = scores_TE if correction_E is None else scores_TE + correction_E
    if rule.num_groups > 1:
        choice_TE = group_limited(choice_TE, rule.num_groups, rule.top_groups)
    index_TK = torch.topk(choice_TE, k=rule.top_k, dim=-1, sorted=False)[1]
    return scores_TE, scores_TE.gather(1, index_TK), index_TK


def _chosen_weights(top_TK: Tensor, rule: NativeRule) -> Tensor:
    if rule.weights == "softmax":
        top_TK = torch.softmax(top_TK, dim=-1, dtype=top_TK.dtype)
    elif rule.weights == "renormalised":
        eps = SIGMOID_RENORM_EPS if rule.scores == "sigmoid" else 0.0
        total_TK = top_TK.sum(dim=-1, keepdim=True)
        top_TK = top_TK / (total_TK + eps if eps else total_TK)
    if rule.scaling_factor != 1.0:
        top_TK = top_TK * rule.scaling_factor
    return top_TK


def native(
    x_TD: Tensor,
    weight_ED: Tensor,
    rule: NativeRule,
    *,
    bias_E: Optional[Tensor] = None,
    correction_E: Optional[Tensor] = None,
) -> Routing:
    """A transformers MoE family's own routing (see NativeRule): exactly k experts per token.

    ``probs`` are the scores the losses read (softmax for 'logits' scores, as gpt-oss's load-balance loss
    takes it); ``logits`` the raw logits, from which the family's joint load-balance loss starts."""
    logits_TE = native_logits(x_TD, weight_ED, bias_E, rule.precision)
    scores_TE, top_TK, index_TK = _chosen(logits_TE, rule, correction_E)
    top_TK = _chosen_weights(top_TK, rule)
    mask_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter_(-1, index_TK, True)
    weights_TE = top_TK.new_zeros(logits_TE.shape).scatter(-1, index_TK, top_TK)
    probs_TE = torch.softmax(logits_TE, dim=-1) if rule.scores == "logits" else scores_TE
    gates_TE = mask_TE.to(weights_TE.dtype)
    return Routing(mask_TE, weights_TE, mask_TE.sum(dim=-1), gates_TE, probs_TE, logits_TE)

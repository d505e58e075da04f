"""The native routing rules of the transformers MoE families (moe/routing.py ``native``, ``NativeRule``).

Hand-worked cases first (logits chosen so the expected experts and weights can be read off; the router is
the identity, so the tokens ARE the logits), then every family's rule as read from its tiny config
(models/hf/families/) against transformers' own router module on the same random weights: same
logits, same experts, same weights and same gradients, bit for bit in float64, ties included.
"""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, randomize, tiny_model  # noqa: E402

from dynmoe_dist.models.hf.families import family_of  # noqa: E402
from dynmoe_dist.moe.routing import NativeRule, native  # noqa: E402


def route(logits, rule, **kwargs):
    """The rule on tokens that are their own logits (identity router weight)."""
    logits = torch.tensor(logits, dtype=torch.float64)
    return native(logits, torch.eye(logits.shape[1], dtype=torch.float64), rule, **kwargs)


def chosen(routing):
    return [sorted(row.nonzero().flatten().tolist()) for row in routing.mask]


def sigmoid(v):
    return 1 / (1 + math.exp(-v))


def test_softmax_top2_renormalised_mixtral():
    # token 0: logits 2 > 1 > 0 > -1 -> experts 0, 1; weights e^2, e^1 renormalised = sigmoid(1), 1 - sigmoid(1)
    # token 1: logits 3 > 1 > 0 = 0 -> experts 2, 3; weights sigmoid(2), 1 - sigmoid(2)
    r = route([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], NativeRule(top_k=2))
    assert chosen(r) == [[0, 1], [2, 3]] and r.num_selected.tolist() == [2, 2]
    want = [[sigmoid(1), 1 - sigmoid(1), 0, 0], [0, 0, sigmoid(2), 1 - sigmoid(2)]]
    torch.testing.assert_close(r.weights, torch.tensor(want, dtype=torch.float32))
    # scores are the full softmax, in float32 ('float32_scores'), the logits in the model's dtype
    assert r.probs.dtype == torch.float32 and r.logits.dtype == torch.float64
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(2))


def test_softmax_top2_without_renormalisation_keeps_the_probabilities():
    # Qwen with norm_topk_prob = False: token 0's weights are softmax([2, 1, 0, -1]) at experts 0 and 1
    r = route([[2.0, 1.0, 0.0, -1.0]], NativeRule(top_k=2, weights="scores"))
    total = math.e**2 + math.e + 1 + math.e**-1
    torch.testing.assert_close(r.weights, torch.tensor([[math.e**2 / total, math.e / total, 0, 0]]))


def test_deepseek_groups_choose_by_top2_sum_not_by_the_best_expert():
    # E 4 in 2 groups {0, 1}, {2, 3}; scores sigmoid([3, -3, 1, 1]) = [.953, .047, .731, .731].
    # group sums of the top-2: g0 = .953 + .047 = 1.0, g1 = .731 + .731 = 1.462 -> only group 1 (top_groups 1):
    # experts 2 and 3, although expert 0 scores highest. Weights: renormalised (.5, .5) times 2.5.
    rule = NativeRule(top_k=2, scores="sigmoid", num_groups=2, top_groups=1, scaling_factor=2.5, precision="float32")
    r = route([[3.0, -3.0, 1.0, 1.0]], rule)
    assert chosen(r) == [[2, 3]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.0, 0.0, 1.25, 1.25]]))
    assert r.logits.dtype == torch.float32  # DeepSeek casts both operands of its router to float32


def test_deepseek_correction_bias_moves_the_choice_but_not_the_weights():
    # correction [0, 0, -1, 0]: choice scores [.953, .047, -.269, .731]; group sums g0 = 1.0, g1 = .462 ->
    # group 0, experts 0 and 1. Weights from the scores WITHOUT the bias: [.953, .047] / 1.0 * 2.5.
    rule = NativeRule(top_k=2, scores="sigmoid", num_groups=2, top_groups=1, scaling_factor=2.5, correction_bias=True)
    r = route([[3.0, -3.0, 1.0, 1.0]], rule, correction_E=torch.tensor([0.0, 0.0, -1.0, 0.0]))
    assert chosen(r) == [[0, 1]]
    s0, s1 = sigmoid(3.0), sigmoid(-3.0)
    want = torch.tensor([[2.5 * s0 / (s0 + s1), 2.5 * s1 / (s0 + s1), 0.0, 0.0]])
    torch.testing.assert_close(r.weights, want)
    # the probabilities the losses read are the plain sigmoid scores
    torch.testing.assert_close(r.probs, torch.tensor([[s0, s1, sigmoid(1.0), sigmoid(1.0)]]))


def test_deepseek_renormalisation_of_vanishing_scores_gives_zeros_not_nan():
    # sigmoid(-200) is 0 in float32: every score is 0 (which two win the tie is torch.topk's call), the chosen
    # scores sum to 0 and DeepSeek's + 1e-20 keeps 0 / 0 = nan away.
    rule = NativeRule(top_k=2, scores="sigmoid", precision="float32")
    r = route([[-200.0, -200.0, -300.0, -300.0]], rule)
    assert r.num_selected.tolist() == [2] and r.weights.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_gpt_oss_top2_of_biased_logits_softmax_over_the_chosen():
    # x = [1, 2, 0, 0], bias [0, 0, 0, 1.5] -> logits [1, 2, 0, 1.5] -> experts 1 and 3;
    # weights softmax([2, 1.5]) = sigmoid(.5), 1 - sigmoid(.5); model dtype (float64) throughout.
    rule = NativeRule(top_k=2, scores="logits", weights="softmax", router_bias=True, precision="model")
    r = route([[1.0, 2.0, 0.0, 0.0]], rule, bias_E=torch.tensor([0.0, 0.0, 0.0, 1.5], dtype=torch.float64))
    assert chosen(r) == [[1, 3]] and r.weights.dtype == torch.float64
    torch.testing.assert_close(
        r.weights, torch.tensor([[0.0, sigmoid(0.5), 0.0, 1 - sigmoid(0.5)]], dtype=torch.float64)
    )
    torch.testing.assert_close(r.probs, torch.softmax(r.logits, -1))  # what its load-balance loss reads


def test_weights_carry_gradient_to_the_router_only_through_the_chosen_scores():
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)  # logits too: experts 0 and 1 chosen
    w = torch.eye(4, dtype=torch.float64, requires_grad=True)
    native(x, w, NativeRule(top_k=2)).weights[0, 0].backward()
    # w00 = p0 / (p0 + p1) = sigmoid(l0 - l1) depends on logits 0 and 1 only (renormalisation cancels the
    # others; what is left of them is the float32 softmax's rounding); row e of the gradient is dl_e * x
    assert w.grad[2:].abs().max() < 1e-6 and w.grad[:2].abs().min() > 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=2, scores="relu"), r"NativeRule.scores \('relu'\) must be one of"),
        (dict(top_k=2, weights="sum"), r"NativeRule.weights \('sum'\) must be one of"),
        (dict(top_k=2, precision="bf16"), r"NativeRule.precision \('bf16'\) must be one of"),
        (dict(top_k=0), r"NativeRule.top_k \(0\) must be >= 1"),
        (dict(top_k=2, scores="sigmoid", num_groups=2, top_groups=3), r"top_groups \(3\) must be in \[1, num_groups"),
        (dict(top_k=2, scores="logits", num_groups=2), r"num_groups \(2\) > 1 needs scores 'sigmoid' or 'softmax'"),
        (dict(top_k=2, correction_bias=True), r"correction_bias needs scores 'sigmoid'"),
        (dict(top_k=2, aux_loss_coef=-1.0), r"aux_loss_coef \(-1.0\) must be >= 0"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NativeRule(**kwargs)


@pytest.mark.parametrize(
    "num_experts, message",
    [
        (1, r"top_k \(2\) must be in \[1, num_experts \(1\)\]"),
        (7, r"num_experts \(7\) must be a multiple of num_groups \(2\)"),
        (2, r"num_experts \(2\) gives groups of 1: a group scores its top 2"),
    ],
)
def test_expert_counts_the_rule_cannot_route_are_refused(num_experts, message):
    rule = NativeRule(top_k=2, scores="sigmoid", num_groups=2, top_groups=1)
    with pytest.raises(ValueError, match=message):
        rule.check_experts(num_experts)
    # top_k larger than what top_groups groups hold: 4 experts, groups of 2, one group -> at most 2
    with pytest.raises(ValueError, match=r"top_k \(3\) > the 2 experts of top_groups \(1\) groups of 2"):
        NativeRule(top_k=3, scores="sigmoid", num_groups=2, top_groups=1).check_experts(4)


# -- against transformers' own routers ----------------------------------------------------------------
CASES = [(f, {}) for f in MOE_FAMILIES] + [
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False, "n_group": 1, "topk_group": 1}),
]


def hf_router(family, overrides, zero=False):
    """(config, router module, its correction bias or None, the router's call on tokens)."""
    model = randomize(tiny_model(family, **overrides).double(), seed=3)
    mlp = model.model.layers[-1].mlp
    router = mlp.router if family == "gpt_oss" else mlp.gate
    if zero:  # every logit equal: the choice is all ties
        with torch.no_grad():
            router.weight.zero_()
            if family == "gpt_oss":
                router.bias.zero_()
    if family == "minimax_m2":  # the block holds the correction bias and hands it to its router
        return model.config, router, mlp.e_score_correction_bias, lambda x: router(x, mlp.e_score_correction_bias)
    return model.config, router, getattr(router, "e_score_correction_bias", None), router


def ours_and_theirs(family, overrides, zero=False, num_tokens=40):
    config, router, correction, call = hf_router(family, overrides, zero)
    x = torch.randn(num_tokens, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x.requires_grad_(True)
    logits, weights_TK, index_TK = call(x)
    rule = family_of(config).rule()
    bias = getattr(router, "bias", None) if rule.router_bias else None
    ours = native(x, router.weight, rule, bias_E=bias, correction_E=correction)
    return router, x, (logits, weights_TK, index_TK), ours


@pytest.mark.parametrize("family, overrides", CASES, ids=lambda c: str(c))
def test_native_rule_equals_the_family_router_bit_for_bit(family, overrides):
    router, x, (logits, weights_TK, index_TK), ours = ours_and_theirs(family, overrides)
    assert torch.equal(ours.logits, logits)
    mask = torch.zeros_like(ours.mask).scatter_(-1, index_TK, True)
    assert torch.equal(ours.mask, mask)
    theirs_TE = torch.zeros_like(ours.weights).scatter_(-1, index_TK, weights_TK.to(ours.weights.dtype))
    assert torch.equal(ours.weights, theirs_TE)
    # gradients of the same function of the weights, to the router weight and to the tokens
    g_TE = torch.randn(theirs_TE.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    theirs_loss = (weights_TK.double() * g_TE.gather(1, index_TK)).sum()
    want = torch.autograd.grad(theirs_loss, [router.weight, x])
    got = torch.autograd.grad((ours.weights.double() * g_TE).sum(), [router.weight, x])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_ties_fall_as_in_transformers(family):
    # All-equal logits (a zero router, Qwen's own initialisation): which experts win is torch.topk's call,
    # and the rule makes the same call on the same tensor.
    _, _, (_, weights_TK, index_TK), ours = ours_and_theirs(family, {}, zero=True, num_tokens=8)
    assert torch.equal(ours.mask, torch.zeros_like(ours.mask).scatter_(-1, index_TK, True))
    theirs_TE = torch.zeros_like(ours.weights).scatter_(-1, index_TK, weights_TK.to(ours.weights.dtype))
    assert torch.equal(ours.weights, theirs_TE)

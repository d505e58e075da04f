"""Hand-worked routing cases: expected masks and weights are written out in each test."""

import math

import pytest
import torch

from dynmoe_dist.moe.routing import top_any, top_k, top_p

# Gate vectors: e0 points along +x, e1 along +y, e2 along -x.
GATE = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
TOKENS = torch.tensor(
    [
        [1.0, 1.0],  # cos = [.707, .707, -.707]  -> selects e0, e1 (k=2)
        [-1.0, 0.0],  # cos = [-1, 0, 1]           -> e1 has p == th exactly: not selected; e2 only (k=1)
        [0.0, -1.0],  # cos = [0, -1, 0]           -> nothing (k=0)
    ]
)


def test_top_any_masks_and_equal_weights():
    r = top_any(TOKENS, GATE, torch.zeros(3), training=True)
    assert r.mask.tolist() == [[True, True, False], [False, False, True], [False, False, False]]
    assert r.num_selected.tolist() == [2, 1, 0]
    torch.testing.assert_close(r.weights, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


def test_top_any_threshold_moves_selection():
    # G = [1, -1, 0]: th = sigmoid(G); token 0 has cos .707 < 1 for e0 -> dropped; token 2 has cos -1 > -1? no.
    r = top_any(TOKENS, GATE, torch.tensor([1.0, -1.0, 0.0]), training=True)
    # token 0: e0 .707 < 1 (no), e1 .707 > -1 (yes), e2 -.707 < 0 (no)
    # token 1: e0 -1 < 1, e1 0 > -1 (yes), e2 1 > 0 (yes)
    # token 2: e0 0 < 1, e1 -1 == -1 (no: strict), e2 0 == 0 (no)
    assert r.mask.tolist() == [[False, True, False], [False, True, True], [False, False, False]]
    torch.testing.assert_close(r.weights[1], torch.tensor([0.0, 0.5, 0.5]))


def test_top_any_eval_falls_back_to_top1_and_skip_option():
    r = top_any(TOKENS, GATE, torch.zeros(3), training=False)
    # token 2: p = sigmoid([0, -1, 0]) -> argmax picks the first maximum, e0, with weight 1.
    assert r.mask[2].tolist() == [True, False, False]
    assert r.weights[2].tolist() == [1.0, 0.0, 0.0]
    assert r.num_selected.tolist() == [2, 1, 1]
    skipped = top_any(TOKENS, GATE, torch.zeros(3), training=False, eval_k0="skip")
    assert skipped.mask[2].tolist() == [False, False, False]
    assert skipped.weights[2].abs().sum() == 0
    trained = top_any(TOKENS, GATE, torch.zeros(3), training=True, train_k0="top1")
    assert trained.mask[2].tolist() == [True, False, False]


def test_only_selected_pairs_get_gradient():
    gate = GATE.clone().requires_grad_()
    threshold = torch.zeros(3, requires_grad=True)
    x = TOKENS[:1].clone().requires_grad_()  # token 0 selects e0, e1
    r = top_any(x, gate, threshold, training=True)
    coeff = torch.tensor([[2.0, 3.0, 5.0]])
    (r.weights * coeff).sum().backward()
    assert gate.grad[2].abs().sum() == 0 and threshold.grad[2] == 0
    assert gate.grad[0].abs().sum() > 0 and gate.grad[1].abs().sum() > 0
    # dL/dG_e = -(c_e / k) * th (1 - th) with th = sigmoid(0) = 0.5, k = 2 (no gradient through k).
    torch.testing.assert_close(threshold.grad, torch.tensor([-2.0 / 2 * 0.25, -3.0 / 2 * 0.25, 0.0]))


def test_no_gradient_through_k():
    # Two selected experts with equal coefficients: if k carried gradient the threshold grads would differ.
    gate = GATE.clone().requires_grad_()
    threshold = torch.zeros(3, requires_grad=True)
    r = top_any(TOKENS[:1], gate, threshold, training=True)
    r.weights.sum().backward()
    torch.testing.assert_close(threshold.grad, torch.tensor([-0.125, -0.125, 0.0]))


def test_gate_math_runs_in_fp32():
    r = top_any(TOKENS.bfloat16(), GATE.bfloat16(), torch.zeros(3, dtype=torch.bfloat16), training=True)
    assert r.probs.dtype == torch.float32 and r.weights.dtype == torch.float32


def test_bf16_threshold_is_compared_in_fp32():
    # A bf16 threshold G = 0.1 is stored as 0.10009765625; its sigmoid in fp32 is 0.52500, but rounded to
    # bf16 (spacing 2^-8 on [.5, 1)) it would be 134 / 256 = 0.5234375 = sigmoid(0.0938). A token with
    # cos = 0.097 lies between the two: sigmoid(0.097) = 0.5242 < 0.5250, so the fp32 gate math (the
    # threshold upcast before its sigmoid) does not select it; cos = 0.103 > 0.1001 is selected either way.
    gate = torch.tensor([[1.0, 0.0]])
    tokens = torch.tensor([[c, math.sqrt(1.0 - c * c)] for c in (0.097, 0.103)])
    r = top_any(tokens, gate, torch.tensor([0.1], dtype=torch.bfloat16), training=True)
    assert r.mask.tolist() == [[False], [True]]


def test_top_k_renormalises_kept_probabilities():
    r = top_k(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 2)
    assert r.mask.tolist() == [[True, True, False, False]]
    p0, p1 = math.exp(2), math.exp(1)
    torch.testing.assert_close(r.weights, torch.tensor([[p0 / (p0 + p1), p1 / (p0 + p1), 0.0, 0.0]]))


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.4, [True, False, False, False]),  # 0.5 alone already exceeds 0.4
        (0.6, [True, True, False, False]),  # 0.5 does not exceed 0.6; 0.5 + 0.3 does: keep the crossing one
        (0.85, [True, True, True, False]),  # 0.8 <= 0.85 < 0.95
        (1.0, [True, True, True, True]),
    ],
)
def test_top_p_keeps_crossing_expert_with_raw_probs(p, expected):
    probs = torch.tensor([[0.3, 0.5, 0.05, 0.15]])
    r = top_p(probs.log(), p)
    order = [1, 0, 3, 2]  # experts by descending probability
    want = [False] * 4
    for rank, keep in enumerate(expected):
        want[order[rank]] = keep
    assert r.mask[0].tolist() == want
    torch.testing.assert_close(r.weights, probs * r.mask)


# Ties on exact binary boundaries. softmax(zeros(4)) is exactly 0.25 each; the mass BEFORE each sorted
# rank is then exactly [0, 0.25, 0.5, 0.75], so "mass before <= p" and "mass before < p" differ exactly
# when p is one of those values. (Random logits never hit a boundary, so only these cases pin the rule.)
@pytest.mark.parametrize(
    "p, num_kept",
    [
        (0.25, 2),  # 0.25 does not exceed 0.25; 0.25 + 0.25 = 0.5 does -> 2 kept (a strict '<' keeps 1)
        (0.5, 3),  # 0.5 does not exceed 0.5; 0.75 does                 -> 3 kept (a strict '<' keeps 2)
        (0.75, 4),  # 0.75 does not exceed 0.75; 1.0 does                -> 4 kept (a strict '<' keeps 3)
        (1.0, 4),  # nothing exceeds 1.0: all 4 kept
        (1e-9, 1),  # the first expert already exceeds p: at least one is always kept
    ],
)
def test_top_p_uniform_ties_keep_the_crossing_expert_on_exact_boundaries(p, num_kept):
    logits = torch.zeros(3, 4, dtype=torch.float64)
    r = top_p(logits, p)
    assert r.num_selected.tolist() == [num_kept] * 3
    assert r.mask.sum(-1).tolist() == [num_kept] * 3
    # Raw probabilities as weights: 0.25 on every kept expert, 0 elsewhere (ties make WHICH experts
    # are kept an arbitrary choice of the sort; how many is fixed by the rule).
    assert r.weights.tolist() == [[0.25 if m else 0.0 for m in row] for row in r.mask.tolist()]


def test_top_p_two_way_tie_at_p_one_half_keeps_both():
    # logits [0, 0, -inf, -inf] -> probs exactly [0.5, 0.5, 0, 0]; sorted mass before = [0, 0.5, 1, 1].
    # p = 0.5: rank 0 (mass before 0) kept; rank 1 (mass before 0.5, not above 0.5) kept; ranks 2, 3 not.
    # Expected mask [T, T, F, F] whatever the sort does with the tie (a strict '<' keeps only one).
    r = top_p(torch.tensor([[0.0, 0.0, -math.inf, -math.inf]]), 0.5)
    assert r.mask.tolist() == [[True, True, False, False]]
    assert r.weights.tolist() == [[0.5, 0.5, 0.0, 0.0]]


def _top_p_reference(probs, p):
    mask = torch.zeros_like(probs, dtype=torch.bool)
    for t in range(probs.shape[0]):
        mass = 0.0
        for e in probs[t].argsort(descending=True).tolist():
            mask[t, e] = True
            mass += probs[t, e].item()
            if mass > p:
                break
    return mask


def _top_k_reference(probs, k):
    mask = torch.zeros_like(probs, dtype=torch.bool)
    for t in range(probs.shape[0]):
        for e in probs[t].argsort(descending=True)[:k].tolist():
            mask[t, e] = True
    return mask


def test_top_p_and_top_k_match_simple_references():
    torch.manual_seed(0)
    logits = torch.randn(200, 8, dtype=torch.float64) * 2
    probs = torch.softmax(logits, -1)
    for p in (0.1, 0.4, 0.7, 0.95):
        assert torch.equal(top_p(logits, p).mask, _top_p_reference(probs, p))
    for k in (1, 2, 5, 8):
        r = top_k(logits, k)
        assert torch.equal(r.mask, _top_k_reference(probs, k))
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(200, dtype=torch.float64))


def test_bad_router_arguments():
    with pytest.raises(ValueError, match=r"top_k \(5\)"):
        top_k(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match=r"top_p \(0\.0\)"):
        top_p(torch.zeros(2, 4), 0.0)


def test_top_k_and_top_p_gates_are_the_mask_and_k_is_per_token():
    # 2 tokens, 4 experts. probs row 0 = [.5, .3, .15, .05], row 1 = [.05, .15, .3, .5].
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], dtype=torch.float64)
    r = top_k(probs.log(), 2)
    assert r.mask.tolist() == [[True, True, False, False], [False, False, True, True]]
    assert r.num_selected.tolist() == [2, 2]
    assert r.gates.dtype == torch.float64 and r.gates.tolist() == r.mask.double().tolist()
    # top-p 0.6: 0.5 does not exceed 0.6, 0.8 does -> 2 experts on both rows; p 0.4 -> 1 expert.
    r = top_p(probs.log(), 0.6)
    assert r.num_selected.tolist() == [2, 2]
    assert r.gates.dtype == torch.float64 and r.gates.tolist() == r.mask.double().tolist()
    assert top_p(probs.log(), 0.4).num_selected.tolist() == [1, 1]


def test_top_k_and_top_p_softmax_in_fp32_for_bf16_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.bfloat16)
    for r in (top_k(logits, 2), top_p(logits, 0.5)):
        assert r.probs.dtype == torch.float32 and r.weights.dtype == torch.float32
        assert r.gates.dtype == torch.float32


def test_top_p_above_one_is_refused():
    with pytest.raises(ValueError, match=r"top_p \(1\.5\) must be in \(0, 1\]"):
        top_p(torch.zeros(2, 4), 1.5)
    assert top_p(torch.zeros(2, 4), 1.0).num_selected.tolist() == [4, 4]


def test_top_any_scores_are_sigmoid_of_per_token_cosines():
    # Gate rows of different lengths (row normalisation removes them) and tokens of different norms.
    gate = torch.tensor([[2.0, 0.0], [0.0, 0.5], [-3.0, 0.0]])
    tokens = torch.tensor([[1.0, 1.0], [-3.0, 0.0], [0.0, -0.5]])
    s = 1 / math.sqrt(2)
    cos = torch.tensor([[s, s, -s], [-1.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    r = top_any(tokens, gate, torch.zeros(3), training=True)
    torch.testing.assert_close(r.probs, torch.sigmoid(cos))


def test_top_any_softmax_combine_renormalises_the_router_logits_over_the_chosen():
    # 3 tokens, 3 experts with gate rows e0 = (1, 0), e1 = (0, 1), e2 = (1, 1); thresholds pick
    # token 0 = (2, 1): cos (0.89, 0.45, 0.95) > 0.5 -> experts 0, 2; logits x.W = (2, 1, 3)
    # token 1 = (-1, 0): cos (-1, 0, -0.71) -> none (weights stay 0, the top-1 fallback adds weight 1 at eval)
    # token 2 = (0, 3): cos (0, 1, 0.71) -> experts 1, 2; logits (0, 3, 3)
    x_TD = torch.tensor([[2.0, 1.0], [-1.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    gate_ED = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    threshold_E = torch.full((3,), 0.5, dtype=torch.float64)
    r = top_any(x_TD, gate_ED, threshold_E, training=True, combine="softmax")
    assert r.mask.tolist() == [[True, False, True], [False, False, False], [False, True, True]]
    e = math.e
    want = torch.tensor([[1 / (1 + e), 0, e / (1 + e)], [0, 0, 0], [0, 0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(r.weights, want, rtol=0, atol=1e-12)
    assert top_any(x_TD, gate_ED, threshold_E, training=True).weights[0].tolist() == [0.5, 0, 0.5]  # equal
    # the gradient reaches the gate rows through the logits, not only through the straight-through gates
    gate = gate_ED.clone().requires_grad_(True)
    top_any(x_TD, gate, threshold_E, training=True, combine="softmax").weights[0, 0].backward()
    assert gate.grad[0].abs().sum() > 0 and gate.grad[2].abs().sum() > 0


def test_the_cosines_written_out_backward_equals_autograds():
    """cosine_scores' hand-written backward (routing._TokenCosine) against autograd through the plain
    expression, float64, on tokens of every size (one of norm 0: its norm is clamped, a constant)."""
    from dynmoe_dist.moe.routing import COSINE_EPS, cosine_scores

    generator = torch.Generator().manual_seed(0)
    x_TD = torch.randn(7, 5, generator=generator, dtype=torch.float64) * torch.tensor(
        [[3.0], [0.1], [1], [1], [1], [1], [0]]
    )
    gate_ED = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    grad_TE = torch.randn(7, 4, generator=generator, dtype=torch.float64)

    def plain(x, gate):
        unit = torch.nn.functional.normalize(gate, dim=-1, eps=COSINE_EPS)
        return (x @ unit.t()) / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(COSINE_EPS)

    results = []
    for scores in (cosine_scores, plain):
        x, gate = x_TD.clone().requires_grad_(True), gate_ED.clone().requires_grad_(True)
        out = scores(x, gate)
        out.backward(grad_TE)
        results.append((out.detach(), x.grad, gate.grad))
    (mine, x_grad, gate_grad), (want, x_want, gate_want) = results
    assert torch.equal(mine, want)  # the same forward expression: the same bits
    torch.testing.assert_close(x_grad, x_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gate_grad, gate_want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        cosine_scores, (x_TD[:6].clone().requires_grad_(True), gate_ED.clone().requires_grad_(True))
    )

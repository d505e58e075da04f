"""Each auxiliary loss on a hand-computed value."""

import math

import pytest
import torch

from dynmoe_dist.moe import losses
from dynmoe_dist.moe.routing import Routing


def _routing(mask, weights, probs=None):
    mask = torch.tensor(mask, dtype=torch.bool)
    return Routing(mask, torch.tensor(weights), mask.sum(-1), mask.float(), probs)


def test_diverse_loss_is_frobenius_norm_not_squared():
    # Values where norm and square differ (0 and 1 are their own squares, so they cannot tell).
    # W = [[3, 0], [0, 2], [1, 1]] -> Wn = [[1, 0], [0, 1], [s, s]] with s = 1/sqrt(2).
    # Wn Wn^T - I = [[0, 0, s], [0, 0, s], [s, s, 0]]: four entries s, sum of squares 4 * 0.5 = 2
    # -> ||.||_F = sqrt(2) = 1.4142 (the square would be 2).
    w = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    torch.testing.assert_close(losses.diverse_loss(w), torch.tensor(math.sqrt(2.0)))
    # Three parallel gate vectors (different lengths): Wn = three copies of [1, 0], Wn Wn^T = all ones,
    # minus I leaves six off-diagonal ones -> sqrt(6) = 2.449 (the square would be 6).
    parallel = torch.tensor([[1.0, 0.0], [2.0, 0.0], [5.0, 0.0]])
    torch.testing.assert_close(losses.diverse_loss(parallel), torch.tensor(math.sqrt(6.0)))
    torch.testing.assert_close(losses.diverse_loss(torch.eye(3)), torch.tensor(0.0))


def test_simple_loss_is_mean_row_norm():
    torch.testing.assert_close(losses.simple_loss(torch.tensor([[3.0, 4.0], [0.0, 1.0]])), torch.tensor(3.0))


def test_load_balance_over_routed_tokens_only():
    # k = [2, 1, 0, 1]; routed tokens 0, 1, 3.  me = [(.5 + 1)/3, (.5 + 1)/3], ce = [2/3, 2/3]
    # loss = E^2 * mean(me * ce) = 4 * (.5 * 2/3) = 4/3
    r = _routing([[1, 1], [1, 0], [0, 0], [0, 1]], [[0.5, 0.5], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(losses.load_balance_loss(r), torch.tensor(4.0 / 3.0))


def test_load_balance_gradient_flows_through_weights_only():
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    r = Routing(mask, weights, mask.sum(-1), mask.float(), None)
    losses.load_balance_loss(r).backward()
    # d/dw[t,e] = E^2/E * ce_e / N = 2 * ce_e / 2 with ce = [1, .5]
    torch.testing.assert_close(weights.grad, torch.tensor([[1.0, 0.5], [1.0, 0.5]]))


def test_efficiency_loss_is_mean_gate():
    r = _routing([[1, 1], [1, 0], [0, 0], [0, 1]], [[0.5, 0.5], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(losses.efficiency_loss(r), torch.tensor(0.5))


def test_switch_loss():
    # top-1 picks e0 twice: f = [1, 0]; Pbar = [.625, .375]; loss = E * sum f * Pbar = 2 * .625
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    r = _routing([[1, 0], [1, 0]], [[1.0, 0.0], [1.0, 0.0]], probs)
    torch.testing.assert_close(losses.switch_loss(probs, r), torch.tensor(1.25))
    uniform = torch.full((4, 4), 0.25)
    ru = _routing(torch.eye(4).tolist(), torch.eye(4).tolist(), uniform)
    torch.testing.assert_close(losses.switch_loss(uniform, ru), torch.tensor(1.0))


def test_reduce_sum_makes_split_batches_agree():
    # Loss of the whole batch == loss computed from per-half sums added together (what ranks do).
    torch.manual_seed(0)
    mask = torch.rand(10, 4) > 0.5
    weights = mask / mask.sum(-1, keepdim=True).clamp(min=1)
    full = Routing(mask, weights, mask.sum(-1), mask.float(), None)
    halves = [Routing(mask[s], weights[s], mask[s].sum(-1), mask[s].float(), None) for s in (slice(0, 3), slice(3, 10))]
    for loss in (losses.load_balance_loss, losses.efficiency_loss):
        # A fake two-rank reduction: the other half's statistic is added as a constant.
        stats = {}

        def record(t, _stats=stats):
            _stats.setdefault("order", []).append(t.detach().clone())
            return t

        loss(halves[1], record)
        other = iter(stats["order"])
        combined = loss(halves[0], lambda t, rest=other: t + next(rest))
        assert math.isclose(combined.item(), loss(full).item(), rel_tol=1e-6)


def test_diverse_and_simple_losses_run_in_fp32_for_bf16_gates():
    w = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.bfloat16)
    assert losses.diverse_loss(w).dtype == torch.float32
    assert losses.simple_loss(w).dtype == torch.float32
    torch.testing.assert_close(losses.simple_loss(w), torch.tensor((3.0 + 2.0 + math.sqrt(2.0)) / 3))


def test_load_balance_with_one_routed_token_and_three_experts():
    # E = 3; token 0 selects e0, e1 (weights .5, .5); token 1 has k = 0 and is left out: N = 1 routed.
    # me = [.5, .5, 0], ce = [1, 1, 0] -> mean(me * ce) = 1/3 -> loss = E^2 / 3 = 3.
    r = _routing([[1, 1, 0], [0, 0, 0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(losses.load_balance_loss(r), torch.tensor(3.0))


def test_efficiency_of_a_single_pair():
    # T = 1, E = 1, the token selects its only expert: mean_{t,e} g = 1.
    torch.testing.assert_close(losses.efficiency_loss(_routing([[1]], [[1.0]])), torch.tensor(1.0))


def test_switch_of_a_single_token():
    # T = 1, E = 2: f = [1, 0] (its one pair went to e0), Pbar = [.75, .25] -> E * .75 = 1.5.
    probs = torch.tensor([[0.75, 0.25]])
    r = _routing([[1, 0]], [[1.0, 0.0]], probs)
    torch.testing.assert_close(losses.switch_loss(probs, r), torch.tensor(1.5))


def test_switch_loss_uses_the_reduced_sums_of_all_ranks():
    # This rank: one token to e0 with probs [.75, .25]. The other rank: one token to e1, probs [.5, .5].
    # Global: f = [.5, .5], Pbar = [.625, .375] -> 2 * (.5 * .625 + .5 * .375) = 1.0 (this rank alone: 1.5).
    here_probs, there_probs = torch.tensor([[0.75, 0.25]]), torch.tensor([[0.5, 0.5]])
    here = _routing([[1, 0]], [[1.0, 0.0]], here_probs)
    there = _routing([[0, 1]], [[0.0, 1.0]], there_probs)
    there_flat = torch.cat([t.reshape(-1) for t in losses.token_sums("switch", there)])
    loss = losses.switch_loss(here_probs, here, reduce_sum=lambda flat: flat + there_flat)
    torch.testing.assert_close(loss, torch.tensor(1.0))


def test_three_token_losses_in_one_reduction_match_each_alone():
    # The sums of load_balance (3 tensors), efficiency (2) and switch (3) share one flat reduction;
    # each loss must get back exactly its own slices.
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]])
    r = _routing([[1, 1, 0], [0, 0, 1], [0, 0, 0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], probs)
    calls = []

    def reduce_sum(flat):
        calls.append(flat.numel())
        return flat

    together = losses.token_losses(["load_balance", "efficiency", "switch"], r, reduce_sum)
    assert calls == [(1 + 3 + 3) + (1 + 1) + (3 + 1 + 3)]  # one reduction for all three
    alone = [losses.load_balance_loss(r), losses.efficiency_loss(r), losses.switch_loss(probs, r)]
    for got, want in zip(together, alone):
        torch.testing.assert_close(got, want)
    # efficiency: 3 selected pairs / (3 tokens x 3 experts) = 1/3
    torch.testing.assert_close(together[1], torch.tensor(1.0 / 3.0))


def test_token_sums_of_a_parameter_loss_is_refused_with_its_name():
    r = _routing([[1, 0]], [[1.0, 0.0]])
    with pytest.raises(ValueError, match=r"aux loss \('diverse'\) has no token statistics"):
        losses.token_sums("diverse", r)


def test_token_sums_are_one_dimensional_in_the_routing_weights_dtype():
    # float64 weights, float32 gates and probs, bool mask: every sum comes back 1-D in float64 (the
    # weights' dtype), so the one flat buffer that reduce_together hands to the collective has the
    # routing's dtype whatever dtypes the mask, gates and probabilities carry.
    # mask [[1, 0], [1, 1]], weights [[1, 0], [.5, .5]], probs [[.75, .25], [.5, .5]]; T = 2, E = 2.
    mask = torch.tensor([[True, False], [True, True]])
    weights = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    r = Routing(mask, weights, mask.sum(-1), mask.float(), probs)
    # entropy: token 0 has -(.75 ln .75 + .25 ln .25), token 1 two halves: ln 2
    h0 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    want = {
        # routed tokens 2; weights per expert [1 + .5, .5]; selections per expert [2, 1]
        "load_balance": [[2.0], [1.5, 0.5], [2.0, 1.0]],
        # gate sum 3 selected pairs; T * E = 4
        "efficiency": [[3.0], [4.0]],
        # pairs per expert [2, 1]; T = 2; probability mass per expert [.75 + .5, .25 + .5]
        "switch": [[2.0, 1.0], [2.0], [1.25, 0.75]],
        "entropy": [[h0 + math.log(2.0)], [2.0]],
    }
    for name, expected in want.items():
        got = losses.token_sums(name, r)
        assert len(got) == len(expected), name
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, torch.tensor(e, dtype=torch.float64), msg=name)  # checks dtype too


def test_entropy_of_a_single_token_is_not_divided_below_one():
    # T = 1: probs [.5, .5] -> entropy ln 2, mean over the one token ln 2; the token term carries
    # ENTROPY_RELATIVE_WEIGHT (0.01): 0.01 * ln 2 = 0.006931.
    probs = torch.tensor([[0.5, 0.5]])
    r = Routing(
        torch.tensor([[True, False]]), torch.tensor([[1.0, 0.0]]), torch.tensor([1]), torch.tensor([[1.0, 0.0]]), probs
    )
    (term,) = losses.token_losses(["entropy"], r)
    torch.testing.assert_close(term, torch.tensor(0.01 * math.log(2.0)))

"""Each auxiliary loss on a hand-computed value."""

import math

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
    halves = [Routing(mask[s], weights[s], mask[s].sum(-1), mask[s].float(), None)
              for s in (slice(0, 3), slice(3, 10))]
    for loss in (losses.load_balance_loss, losses.efficiency_loss):
        # A fake two-rank reduction: the other half's statistic is added as a constant.
        stats = {}

        def record(t, _stats=stats):
            _stats.setdefault("order", []).append(t.detach().clone())
            return t

        loss(halves[1], record)
        other = iter(stats["order"])
        combined = loss(halves[0], lambda t: t + next(other))
        assert math.isclose(combined.item(), loss(full).item(), rel_tol=1e-6)

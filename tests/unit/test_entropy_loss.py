"""The top-p baseline's router-entropy loss (Huang et al. 2024) on hand-worked probabilities."""

import math

import pytest
import torch

from dynmoe_dist.moe import losses
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.layer import MoELayer
from dynmoe_dist.moe.routing import top_p


def test_entropy_loss_hand_worked():
    # token 0: two experts at 1/2 -> entropy log 2; token 1: one expert at 1 -> 0 (0 log 0 = 0, no NaN).
    probs_TE = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    loss = losses.entropy_loss(probs_TE)
    assert loss.item() == pytest.approx(math.log(2) / 2)
    loss.backward()
    assert torch.isfinite(probs_TE.grad).all()
    # d/dP (-P log P) / T = -(log P + 1) / 2: at P = 1/2, (log 2 - 1) / 2
    assert probs_TE.grad[0, 0].item() == pytest.approx((math.log(2) - 1) / 2)


def test_entropy_token_loss_carries_huang_et_al_weight_ratio():
    routing = top_p(torch.randn(6, 4), 0.4)
    (term,) = losses.token_losses(["entropy"], routing)
    assert term.item() == pytest.approx(losses.ENTROPY_RELATIVE_WEIGHT * losses.entropy_loss(routing.probs).item())
    assert losses.ENTROPY_RELATIVE_WEIGHT * 0.01 == pytest.approx(1e-4)  # their beta, at aux_loss_weight 0.01


def test_top_p_layer_adds_the_entropy_term():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, router="top_p", aux_losses=("switch", "entropy")))
    x = torch.randn(5, 8)
    with_entropy = layer(x).aux_loss
    layer.config.aux_losses = ("switch",)
    routing = layer.router(x, True)
    expected = 0.01 * losses.ENTROPY_RELATIVE_WEIGHT * losses.entropy_loss(routing.probs)
    assert (with_entropy - layer(x).aux_loss).item() == pytest.approx(expected.item(), rel=1e-5)


def test_entropy_needs_a_softmax_router():
    with pytest.raises(ValueError, match=r"aux_losses entry \('entropy'\) needs a softmax router.*'top_any'"):
        MoEConfig(router="top_any", aux_losses=("diverse", "entropy"))

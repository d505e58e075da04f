"""Upcycling (moe/upcycle.py): which blocks are found, which settings win, and that experts are copies."""

import pytest
import torch
import torch.nn as nn

from dynmoe_dist import FeedForward, MoEConfig, MoELayer, upcycle
from dynmoe_dist.moe.upcycle import dense_blocks


class Block(nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.ffn = ffn


def _nested_model():
    # blocks.0.ffn: 8 -> 16 gelu with bias;  blocks.1.ffn: 8 -> 12 relu without bias
    return nn.ModuleDict(
        {"blocks": nn.ModuleList([Block(FeedForward(8, 16)), Block(FeedForward(8, 12, bias=False, activation="relu"))])}
    )


def test_nested_blocks_are_replaced_in_place_with_their_own_dims():
    model = _nested_model()
    upcycle(model, MoEConfig(num_experts=2))
    first, second = model.get_submodule("blocks.0.ffn"), model.get_submodule("blocks.1.ffn")
    assert isinstance(first, MoELayer) and isinstance(second, MoELayer)
    assert (first.config.dim, first.config.ffn_dim, first.config.activation, first.config.expert_bias) == (
        8,
        16,
        "gelu",
        True,
    )
    assert (second.config.dim, second.config.ffn_dim, second.config.activation, second.config.expert_bias) == (
        8,
        12,
        "relu",
        False,
    )
    assert second.experts.experts[0].b_in is None


def test_overrides_without_a_config_and_on_top_of_one():
    model = _nested_model()
    upcycle(model, num_experts=3, router="top_k", top_k=1, dim=999, ffn_dim=999)  # dims come from the block
    layer = model.get_submodule("blocks.0.ffn")
    assert (layer.config.num_experts, layer.config.router, layer.config.top_k) == (3, "top_k", 1)
    assert (layer.config.dim, layer.config.ffn_dim) == (8, 16) and len(layer.experts) == 3
    model = _nested_model()
    upcycle(model, MoEConfig(num_experts=2, router="top_p"), num_experts=3, top_p=0.7)  # max_experts stays 4
    layer = model.get_submodule("blocks.1.ffn")
    assert (layer.config.num_experts, layer.config.router, layer.config.top_p, len(layer.experts)) == (
        3,
        "top_p",
        0.7,
        3,
    )


def test_experts_are_independent_copies_of_the_dense_block():
    model = _nested_model()
    dense = model.get_submodule("blocks.0.ffn")
    upcycle(model, MoEConfig(num_experts=2), layers=[0])
    a, b = model.get_submodule("blocks.0.ffn").experts.experts
    assert torch.equal(a.w_in, dense.w_in) and torch.equal(b.w_out, dense.w_out)
    with torch.no_grad():
        a.w_in.add_(1.0)
    assert not torch.equal(a.w_in, b.w_in) and not torch.equal(a.w_in, dense.w_in)


def test_experts_of_an_existing_moe_layer_are_not_dense_blocks():
    model = _nested_model()
    upcycle(model, MoEConfig(num_experts=2), layers=[0])
    assert [name for name, _ in dense_blocks(model)] == ["blocks.1.ffn"]
    upcycle(model, MoEConfig(num_experts=2))  # the remaining dense block only
    assert isinstance(model.get_submodule("blocks.1.ffn"), MoELayer)
    assert len(model.get_submodule("blocks.0.ffn").experts) == 2


def test_layer_index_equal_to_the_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match=r"layers entry \(2\) out of range: the model has 2 dense FFN blocks"):
        upcycle(_nested_model(), MoEConfig(num_experts=2), layers=[2])


def test_dim_overrides_that_are_no_valid_dims_are_ignored_not_validated():
    # dim and ffn_dim always come from the dense block, so override values are dropped before any
    # MoEConfig is built: 0 (which MoEConfig refuses: dim must be >= 1) must not reach it.
    model = _nested_model()
    upcycle(model, num_experts=2, dim=0, ffn_dim=0)
    layer = model.get_submodule("blocks.0.ffn")
    assert (layer.config.dim, layer.config.ffn_dim, len(layer.experts)) == (8, 16, 2)


def test_a_gated_block_gives_a_gated_layer_whatever_the_config_says():
    from dynmoe_dist.moe import GatedFeedForward

    model = nn.ModuleDict({"mlp": GatedFeedForward(8, 12, activation="silu")})
    upcycle(model, MoEConfig(num_experts=2, expert_kind="ffn"))
    layer = model["mlp"]
    assert (layer.config.expert_kind, layer.config.activation, layer.config.expert_bias) == ("gated", "silu", False)
    assert all(isinstance(e, GatedFeedForward) for e in layer.experts.experts)

"""The remote MoE layer's fast expert paths (models/hf/remote/dynmoe_layers.py) against its reference, the
loop over the experts in float64: the grouped matmul over the expert-sorted rows (float32 and bfloat16, no
gradient: generation) and the single-token path (a batch-1 decode step), on tokens that
select no expert, one and several, for every expert kind and both k = 0 rules; the weights the grouped path
stacks follow a load and a dtype change; without a gradient the router's gate is bitwise its mask."""

import copy

import pytest
import torch

from dynmoe_dist.models.hf.remote import dynmoe_layers as remote

T, D, F, E = 24, 8, 16, 4  # D and F rows: multiples of 16 bytes in bfloat16, as the kernels want
SPECS = {
    "gated": dict(expert_kind="gated", ffn_dim=F, activation="silu", expert_bias=False),
    "ffn": dict(expert_kind="ffn", ffn_dim=F, activation="gelu_tanh", expert_bias=True),
    "gpt_oss": dict(expert_kind="gpt_oss", ffn_dim=F, activation="silu", swiglu_alpha=1.3, swiglu_limit=0.4),
}
# the grouped path's stacked tensors: one per projection (gate and in apart: a fused matmul rounds otherwise)
STACKED = {
    "gated": {"w_gate", "w_in", "w_out"},
    "ffn": {"w_in", "w_out", "b_in", "b_out"},
    "gpt_oss": {"w_gate", "w_in", "w_out", "b_gate", "b_in", "b_out"},
}
ROUTERS = {
    "equal-skip": dict(router="top_any", train_k0="zero", eval_k0="skip", combine="equal"),
    "softmax-top1": dict(router="top_any", train_k0="top1", eval_k0="top1", combine="softmax"),
}
pytestmark = pytest.mark.skipif(
    not remote.grouped_mm_runs(torch.device("cpu"), torch.float32), reason="this torch has no grouped matmul on CPU"
)


def layer(spec, options, seed=0):
    """A float64 eval-mode layer with random experts and thresholds that give 0, 1 and several experts."""
    g = torch.Generator().manual_seed(seed)
    moe = remote.DynMoELayer(E, D, spec, options).double().eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        moe.router.weight.copy_(torch.randn(E, D, generator=g, dtype=torch.float64))
        moe.router.threshold.copy_(torch.tensor([-0.2, 0.0, 0.2, 0.4], dtype=torch.float64))
    return moe


def tokens(seed=1):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def reference(moe, x_TD):
    """The loop over the experts, float64, with autograd on (never grouped)."""
    assert not moe.experts.groupable(x_TD)
    return moe(x_TD)


def test_the_tokens_select_zero_one_and_several_experts():
    moe = layer(SPECS["gated"], ROUTERS["equal-skip"])
    k_T = moe.router(tokens())[0].sum(dim=-1)
    assert {0, 1} <= set(k_T.tolist()) and k_T.max() >= 3


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("kind", SPECS)
def test_grouped_matmul_equals_the_float64_loop(kind, router):
    moe = layer(SPECS[kind], ROUTERS[router])
    want_TD = reference(moe, tokens()).detach()
    fast = copy.deepcopy(moe).float()
    with torch.no_grad():
        mask_TE = fast.router(tokens().float())[0]
        assert torch.equal(mask_TE, moe.router(tokens())[0])  # the same choices: the experts' math is compared
        got_TD = fast(tokens().float())
    assert set(fast.experts._stacked) == STACKED[kind], "the grouped matmul did not run, or not gate and in as one"
    torch.testing.assert_close(got_TD.double(), want_TD, rtol=1e-6, atol=1e-6)
    assert want_TD.abs().max() > 0.1
    with torch.enable_grad():  # float32 with gradients: the loop, the same numbers up to float32 rounding
        looped_TD = fast(tokens().float())
    torch.testing.assert_close(got_TD, looped_TD.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", SPECS)
def test_grouped_matmul_in_bfloat16_equals_the_bfloat16_loop(kind):
    moe = layer(SPECS[kind], ROUTERS["softmax-top1"]).bfloat16()
    x_TD = tokens().bfloat16()
    looped_TD = moe(x_TD).detach()
    with torch.no_grad():
        got_TD = moe(x_TD)
    assert moe.experts._stacked
    torch.testing.assert_close(got_TD.float(), looped_TD.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("kind", SPECS)
def test_a_single_token_equals_its_row_of_the_loop(kind, router):
    moe = layer(SPECS[kind], ROUTERS[router])
    x_TD = tokens()
    want_TD = reference(moe, x_TD)
    for t in range(T):  # a batch-1 decode step, gradients and all
        torch.testing.assert_close(moe(x_TD[t : t + 1]), want_TD[t : t + 1], rtol=0, atol=1e-12)
    want_TD.square().sum().backward()
    loop_grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    sum(moe(x_TD[t : t + 1]).square().sum() for t in range(T)).backward()
    for got, want in zip((p.grad for p in moe.parameters()), loop_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_a_gradient_the_gate_is_its_mask_exactly(dtype):
    """Generation skips the straight-through gate: r + (sign(r) - r) is exactly 1 for every r in (0, 1), and the
    routing (mask and weights, both combine rules, both k = 0 rules) is bitwise the one with gradients."""
    g = torch.Generator().manual_seed(3)
    probs_TE = torch.rand(4096, 8, generator=g, dtype=dtype)
    threshold_E = torch.rand(8, generator=g, dtype=dtype) * torch.tensor([1e-7, 1e-3, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
    mask_TE, gates_TE = remote.threshold_gates(probs_TE.requires_grad_(), threshold_E)
    assert gates_TE is not None and torch.equal(gates_TE.detach(), mask_TE.to(dtype))
    no_grad_mask_TE, no_gates = remote.threshold_gates(probs_TE.detach(), threshold_E)
    assert no_gates is None and torch.equal(no_grad_mask_TE, mask_TE)
    for options in ROUTERS.values():
        moe = layer(SPECS["gated"], options).to(dtype)
        x_TD = tokens().to(dtype)
        with_grad = moe.router(x_TD)
        with torch.no_grad():
            without = moe.router(x_TD)
        assert with_grad[0].requires_grad is False and with_grad[1].requires_grad
        assert torch.equal(without[0], with_grad[0]) and torch.equal(without[1], with_grad[1].detach())


def test_the_stacked_weights_follow_a_load_and_a_dtype_change():
    moe = layer(SPECS["ffn"], ROUTERS["softmax-top1"]).float()
    x_TD = tokens().float()
    with torch.no_grad():
        moe(x_TD)
        keys = set(moe.state_dict())
        other = layer(SPECS["ffn"], ROUTERS["softmax-top1"], seed=5).float()
        moe.load_state_dict(other.state_dict())  # copied into the parameters, which the stacked weights view
        assert set(moe.state_dict()) == keys
        with torch.enable_grad():
            want_TD = other(x_TD).detach()  # the loop
        torch.testing.assert_close(moe(x_TD), want_TD, rtol=0, atol=1e-6)
        moe.bfloat16()  # new storage: the stacked weights are built again from it
        assert not moe.experts._stacked
        got_TD = moe(x_TD.bfloat16())
    assert moe.experts._stacked["w_in"].dtype == torch.bfloat16
    torch.testing.assert_close(got_TD.float(), moe(x_TD.bfloat16()).detach().float(), rtol=0.02, atol=0.02)


def test_offloaded_experts_run_their_own_forward():
    moe = layer(SPECS["gated"], ROUTERS["softmax-top1"]).float()
    x_TD = tokens().float()
    assert not moe.experts.groupable(x_TD)  # autograd on and parameters that want gradients: the loop
    with torch.no_grad():
        assert moe.experts.groupable(x_TD)
        moe.experts.experts[-1].to("meta")  # as accelerate leaves an offloaded expert between its hook's calls
        assert not moe.experts.groupable(x_TD)

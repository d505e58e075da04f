"""Gated (LLaMA-style) experts and the tanh GELU: formulas, grouped vs loop, specs, migration helpers."""

import math

import pytest
import torch
import torch.nn.functional as F

from dynmoe_dist.moe import ExpertBank, GatedFeedForward, MoEConfig, MoELayer, upcycle
from dynmoe_dist.moe.experts import ACTIVATION_FNS, expert_param_specs, expert_with, new_expert, reference_forward


def test_gelu_tanh_is_gpt2_gelu_new():
    x = torch.linspace(-4, 4, 41, dtype=torch.float64)
    want = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(ACTIVATION_FNS["gelu_tanh"](x), want, rtol=0, atol=1e-12)
    # and it is not the erf GELU (differs by ~1e-3 near |x| = 2)
    assert (ACTIVATION_FNS["gelu"](x) - want).abs().max() > 1e-4


@pytest.mark.parametrize("bias", [False, True])
def test_gated_expert_formula(bias):
    torch.manual_seed(0)
    e = GatedFeedForward(4, 6, bias=bias, activation="silu").double()
    if bias:
        for b in (e.b_gate, e.b_in, e.b_out):
            torch.nn.init.normal_(b)
    x = torch.randn(5, 4, dtype=torch.float64)
    gate = x @ e.w_gate.t() + (e.b_gate if bias else 0)
    up = x @ e.w_in.t() + (e.b_in if bias else 0)
    want = (gate * torch.sigmoid(gate) * up) @ e.w_out.t() + (e.b_out if bias else 0)
    torch.testing.assert_close(e(x), want, rtol=0, atol=1e-12)


def test_gated_param_specs_follow_the_config():
    cfg = MoEConfig(dim=8, ffn_dim=12, expert_kind="gated", expert_bias=False, activation="silu")
    assert expert_param_specs(cfg) == [("w_gate", (12, 8)), ("w_in", (12, 8)), ("w_out", (8, 12))]
    cfg_b = MoEConfig(dim=8, ffn_dim=12, expert_kind="gated", expert_bias=True)
    assert [n for n, _ in expert_param_specs(cfg_b)] == ["w_gate", "w_in", "w_out", "b_gate", "b_in", "b_out"]
    assert isinstance(new_expert(cfg), GatedFeedForward)
    # migration rebuilds an expert from a flat parameter list in spec order
    torch.manual_seed(1)
    src = new_expert(cfg_b)
    rebuilt = expert_with([p.detach().clone() for p in src.parameters()], cfg_b)
    x = torch.randn(3, 8)
    torch.testing.assert_close(rebuilt(x), src(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_bank_grouped_matches_loop_and_reference(bias, activation):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=16, ffn_dim=32, num_experts=3, expert_kind="gated", expert_bias=bias, activation=activation)
    bank = ExpertBank.fresh(cfg, 3)
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts_e = torch.tensor([4, 0, 5])  # expert 1 receives no rows
    rows = torch.randn(9, 16)
    want = reference_forward(list(bank.experts), rows, counts_e)
    outs, grads = {}, {}
    for mode in ("loop", "grouped_mm"):
        bank.config.expert_compute = mode
        x = rows.clone().requires_grad_(True)
        outs[mode] = bank(x, counts_e)
        outs[mode].square().sum().backward()
        # the loop never touches expert 1 (no grad); the grouped path gives it zero gradients
        grads[mode] = [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in bank.parameters()]
        bank.zero_grad(set_to_none=True)
    torch.testing.assert_close(outs["loop"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs["grouped_mm"], want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads["loop"], grads["grouped_mm"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bank_rejects_wrong_expert_kind():
    cfg = MoEConfig(dim=4, ffn_dim=8, num_experts=1, expert_kind="gated")
    from dynmoe_dist.moe import FeedForward

    with pytest.raises(ValueError, match=r"expert_kind \('gated'\) needs GatedFeedForward experts, got FeedForward$"):
        ExpertBank(cfg, [FeedForward(4, 8)])


def test_bad_expert_kind_and_activation():
    with pytest.raises(ValueError, match=r"expert_kind \('swiglu'\)"):
        MoEConfig(expert_kind="swiglu")
    with pytest.raises(ValueError, match=r"activation \('gelu_new'\)"):
        MoEConfig(activation="gelu_new")


def test_upcycled_gated_block_computes_dense_and_trains():
    torch.manual_seed(0)
    dense = GatedFeedForward(16, 24, bias=False, activation="silu")
    model = torch.nn.Sequential(dense)
    x = torch.randn(40, 16)
    want = dense(x).detach()
    upcycle(model, MoEConfig(num_experts=4))  # kind, bias and activation come from the block
    layer = model[0]
    assert isinstance(layer, MoELayer) and layer.config.expert_kind == "gated"
    assert layer.config.activation == "silu" and not layer.config.expert_bias
    out = layer(x)
    k = out.routing.num_selected
    assert (k > 0).any()
    torch.testing.assert_close(out.output[k > 0], want[k > 0], rtol=1e-5, atol=1e-6)
    (out.output.sum() + out.aux_loss).backward()
    assert all(e.w_gate.grad is not None for e in layer.experts.experts)
    assert layer.router.threshold.grad is not None


def test_gated_defaults_are_llama_s_no_biases_silu_and_normal_init():
    # gate_proj / up_proj / down_proj without biases, SiLU, weights N(0, 0.02^2): over 64 x 128 = 8192
    # draws the sample mean is within 0.002 of 0 (its standard error is 0.02 / 90 = 0.0002) and the
    # sample standard deviation within 0.001 of 0.02 (standard error 0.02 / 128 = 0.00016).
    torch.manual_seed(0)
    block = GatedFeedForward(64, 128)
    assert (block.b_gate, block.b_in, block.b_out, block.activation) == (None, None, None, "silu")
    assert block.w_gate.shape == block.w_in.shape == (128, 64) and block.w_out.shape == (64, 128)
    for w in (block.w_gate, block.w_in, block.w_out):
        assert abs(w.mean().item()) < 0.002
        assert abs(w.std().item() - 0.02) < 0.001


def test_gated_expert_casts_fp32_weights_and_biases_to_bf16_rows():
    # fp32 master weights, bf16 rows (autocast): every weight and bias is cast to the rows' dtype, the
    # output is bf16 and equals w_out (silu(w_gate x + b_gate) * (w_in x + b_in)) + b_out within bf16.
    torch.manual_seed(0)
    block = GatedFeedForward(4, 8, bias=True)
    with torch.no_grad():
        for b in (block.b_gate, block.b_in, block.b_out):
            b.normal_()
    rows = torch.randn(3, 4).bfloat16()
    out = block(rows)
    assert out.dtype == torch.bfloat16 and block.w_gate.dtype == torch.float32
    x = rows.float()
    hidden = F.silu(x @ block.w_gate.t() + block.b_gate) * (x @ block.w_in.t() + block.b_in)
    want = hidden @ block.w_out.t() + block.b_out
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=0.05)

"""The MoE-side pieces of imported transformers MoE families: the native router (parameters, resize), the
gpt-oss expert kind (against transformers' own expert math, both bank paths), and the families' JOINT
load-balance loss (bit for bit against transformers' load_balancing_loss_func; the same loss and gradients
when the batch is split over two data ranks whose statistics are summed)."""

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from dynmoe_dist.moe import losses
from dynmoe_dist.moe.aux_collector import collect_aux_losses, report_balance_term
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.experts import ExpertBank, GptOssFeedForward, expert_param_specs, reference_forward
from dynmoe_dist.moe.layer import MoELayer, NativeRouter
from dynmoe_dist.moe.routing import NativeRule

DEEPSEEK = NativeRule(top_k=2, scores="sigmoid", num_groups=2, top_groups=1, correction_bias=True)
GPT_OSS = NativeRule(top_k=2, scores="logits", weights="softmax", router_bias=True, precision="model")


def native_config(**kw):
    return MoEConfig(**{"dim": 8, "ffn_dim": 6, "num_experts": 6, "router": "native", **kw})


# -- the native router ------------------------------------------------------------------------------
def test_native_router_holds_the_family_tensors_and_keeps_the_correction_bias_a_buffer():
    deepseek = NativeRouter(native_config(), DEEPSEEK)
    assert [n for n, _ in deepseek.named_parameters()] == ["weight"]
    assert [n for n, _ in deepseek.named_buffers()] == ["e_score_correction_bias"]
    assert set(deepseek.state_dict()) == {"weight", "e_score_correction_bias"}  # saved, but never trained
    gpt_oss = NativeRouter(native_config(), GPT_OSS)
    assert [n for n, _ in gpt_oss.named_parameters()] == ["weight", "bias"]


def test_resize_slices_every_per_expert_tensor_and_appends_zeros():
    router = NativeRouter(native_config(), DEEPSEEK)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.arange(6.0))
    weight = router.weight.detach().clone()
    new_ND = torch.ones(1, 8)
    router.resize([5, 0, 2], new_ND)  # 4 experts: 2 groups of 2
    torch.testing.assert_close(router.weight.detach(), torch.cat([weight[[5, 0, 2]], new_ND]))
    assert router.e_score_correction_bias.tolist() == [5.0, 0.0, 2.0, 0.0]
    gpt_oss = NativeRouter(native_config(), GPT_OSS)
    with torch.no_grad():
        gpt_oss.bias.copy_(torch.arange(6.0))
    gpt_oss.resize([1, 3], torch.zeros(0, 8))
    assert gpt_oss.bias.tolist() == [1.0, 3.0] and isinstance(gpt_oss.bias, torch.nn.Parameter)


def test_resize_to_a_count_the_groups_do_not_divide_is_refused_before_any_change():
    router = NativeRouter(native_config(), DEEPSEEK)
    with pytest.raises(ValueError, match=r"num_experts \(5\) must be a multiple of num_groups \(2\)"):
        router.resize([0, 1, 2, 3, 4], torch.zeros(0, 8))
    assert router.weight.shape == (6, 8) and router.e_score_correction_bias.shape == (6,)


def test_a_native_layer_needs_its_rule_and_only_it_reads_one():
    with pytest.raises(ValueError, match=r"router \('native'\) needs the checkpoint's routing rule"):
        MoELayer(native_config())
    with pytest.raises(ValueError, match=r"a NativeRule is read only by router 'native', router is 'top_k'"):
        MoELayer(native_config(router="top_k"), rule=GPT_OSS)
    assert MoEConfig(router="native").aux_losses == ()  # the family's own loss comes from its rule


def test_balance_term_only_in_training_and_only_when_the_checkpoint_asks():
    x = torch.randn(5, 8)
    gated = native_config(expert_kind="gated", expert_bias=False)
    on = MoELayer(gated, rule=NativeRule(top_k=2, output_router_logits=True, aux_loss_coef=0.1))
    term = on.train()(x).balance
    assert term is not None and term.coef == 0.1 and term.selected_TE.sum().item() == 10  # 5 tokens x top-2
    assert on.eval()(x).balance is None
    for rule in (NativeRule(top_k=2, aux_loss_coef=0.1), NativeRule(top_k=2, output_router_logits=True)):
        off = MoELayer(gated, rule=rule)
        assert off.train()(x).balance is None


# -- gpt-oss experts --------------------------------------------------------------------------------
def gpt_oss_config(**kw):
    return MoEConfig(**{"dim": 16, "ffn_dim": 12, "num_experts": 3, "expert_kind": "gpt_oss", "router": "native", **kw})


def test_gpt_oss_expert_equals_transformers_clamped_swiglu_with_interleaved_gate_up():
    torch.manual_seed(0)
    expert = GptOssFeedForward(16, 12, alpha=1.5, limit=2.0, init_std=1.0).double()
    with torch.no_grad():
        for b in (expert.b_gate, expert.b_in, expert.b_out):
            b.normal_()
    x = torch.randn(20, 16, dtype=torch.float64)

    class Cfg:  # the fields GptOssExperts reads
        intermediate_size, num_local_experts, hidden_size, swiglu_alpha, swiglu_limit = 12, 1, 16, 1.5, 2.0

    theirs = GptOssExperts(Cfg()).double()
    with torch.no_grad():  # gate_up_proj[0] (D, 2F): gate in columns 0::2, up in 1::2
        theirs.gate_up_proj[0, :, 0::2] = expert.w_gate.t()
        theirs.gate_up_proj[0, :, 1::2] = expert.w_in.t()
        theirs.gate_up_proj_bias[0, 0::2] = expert.b_gate
        theirs.gate_up_proj_bias[0, 1::2] = expert.b_in
        theirs.down_proj[0] = expert.w_out.t()
        theirs.down_proj_bias[0] = expert.b_out
    gate_up = x @ theirs.gate_up_proj[0] + theirs.gate_up_proj_bias[0]
    assert (gate_up[:, 0::2] > 2.0).any() and (gate_up[:, 1::2].abs() > 2.0).any()  # both clamps bite
    want = theirs._apply_gate(gate_up) @ theirs.down_proj[0] + theirs.down_proj_bias[0]
    torch.testing.assert_close(expert(x), want, rtol=0, atol=1e-12)


def test_gpt_oss_expert_parameters_are_the_gated_layout_with_biases():
    assert expert_param_specs(gpt_oss_config()) == [
        ("w_gate", (12, 16)),
        ("w_in", (12, 16)),
        ("w_out", (16, 12)),
        ("b_gate", (12,)),
        ("b_in", (12,)),
        ("b_out", (16,)),
    ]


@pytest.mark.parametrize("compute", ["loop", "grouped_mm"])
def test_gpt_oss_bank_paths_equal_the_per_row_reference(compute):
    config = gpt_oss_config(expert_compute=compute, swiglu_limit=1.0, init_std=0.5)
    torch.manual_seed(1)
    bank = ExpertBank.fresh(config, 3)
    with torch.no_grad():
        for p in bank.parameters():
            p.add_(torch.randn_like(p))
    rows = torch.randn(9, 16, requires_grad=True)
    counts = torch.tensor([4, 2, 3])
    got = bank(rows, counts)
    want = reference_forward(list(bank.experts), rows, counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), [rows, *bank.parameters()])
    ref_grads = torch.autograd.grad((want * g).sum(), [rows, *bank.parameters()])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gpt_oss_bank_refuses_experts_clamped_otherwise_than_its_config():
    with pytest.raises(ValueError, match=r"alpha, limit \(1.702, 3.0\) != swiglu_alpha, swiglu_limit \(1.702, 7.0\)"):
        ExpertBank(gpt_oss_config(), [GptOssFeedForward(16, 12, limit=3.0)])


# -- the joint load-balance loss --------------------------------------------------------------------
def layer_logits(num_layers=3, num_tokens=14, num_experts=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_tokens, num_experts, generator=g, dtype=dtype).requires_grad_() for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_joint_loss_equals_transformers_bit_for_bit(dtype, masked):
    logits = layer_logits(dtype=dtype)
    mask = (torch.rand(2, 7, generator=torch.Generator().manual_seed(1)) > 0.3).long() if masked else None
    theirs = load_balancing_loss_func(tuple(logits), 6, 2, mask)
    ours = losses.joint_balance_loss([losses.balance_term(t, 2, 1.0) for t in logits], mask)
    assert torch.equal(ours, theirs)
    for a, b in zip(torch.autograd.grad(ours, logits), torch.autograd.grad(theirs, logits)):
        assert torch.equal(a, b)


def test_joint_loss_is_not_the_sum_of_per_layer_losses():
    # Two layers whose imbalances cancel jointly: layer 0 prefers experts 0, 1, layer 1 experts 2, 3.
    big = torch.tensor([[5.0, 5.0, 0.0, 0.0]])
    layers = [big, big.flip(-1)]
    joint = losses.joint_balance_loss([losses.balance_term(t, 2, 1.0) for t in layers])
    each = sum(losses.joint_balance_loss([losses.balance_term(t, 2, 1.0)]) for t in layers)
    # jointly (2 rows, 4 picks): f = [.5] * 4, P ~ [.25] * 4 -> 4 * 4 * .125 = 2, the balanced value (k);
    # each layer alone: f = [1, 1, 0, 0], P ~ [.5, .5, 0, 0] -> 4 * 1 = 4, so the sum is ~8
    assert joint.item() == pytest.approx(2.0, abs=0.03) and each.item() == pytest.approx(8.0, abs=0.06)


def test_joint_loss_over_two_data_ranks_is_the_global_batch_loss_with_its_gradients():
    logits = layer_logits(num_tokens=10)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1, 1])
    rank_rows = [slice(0, 4), slice(4, 10)]
    # each rank's own statistics, as its all-reduce receives them
    sums = [losses.joint_balance_sums([losses.balance_term(t[s], 2, 1.0) for t in logits], mask[s]) for s in rank_rows]
    flats = [torch.cat([t.reshape(-1) for t in rank]) for rank in sums]

    def rank_loss(r):
        # the all-reduce as autograd sees it: this rank's sums plus the other's (gradient flows to both)
        def all_reduce(flat, other=flats[1 - r]):
            return flat + other

        terms = [losses.balance_term(t[rank_rows[r]], 2, 0.5, all_reduce, loss_scale=0.5) for t in logits]
        return losses.joint_balance_loss(terms, mask[rank_rows[r]])

    total = rank_loss(0) + rank_loss(1)  # what the ranks' losses add up to
    want = 0.5 * load_balancing_loss_func(tuple(logits), 6, 2, mask)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(total, logits), torch.autograd.grad(want, logits)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_all_layers_statistics_travel_in_one_reduction():
    calls = []

    def reduce_sum(flat):
        calls.append(flat.numel())
        return flat

    terms = [losses.balance_term(t, 2, 1.0, reduce_sum) for t in layer_logits(num_layers=4)]
    losses.joint_balance_loss(terms)
    assert calls == [6 + 6 + 1]  # picks, probabilities, rows: summed over the layers before the one reduction


def test_layers_with_fewer_experts_count_zero_in_the_missing_positions():
    # After an adaptive event one layer holds 4 experts, the other 6: its picks and mass pad with zeros.
    six, four = layer_logits(num_layers=1)[0], layer_logits(num_layers=1, num_experts=4, seed=1)[0]
    got = losses.joint_balance_sums([losses.balance_term(six, 2, 1.0), losses.balance_term(four, 2, 1.0)])
    alone = losses.joint_balance_sums([losses.balance_term(six, 2, 1.0)])
    torch.testing.assert_close(got[0][4:], alone[0][4:]) and torch.testing.assert_close(got[2], 2 * alone[2])
    assert got[0].sum().item() == 2 * 14 * 2  # every token of both layers picked two


def test_terms_of_different_coefficients_are_refused():
    a, b = layer_logits(num_layers=2)
    with pytest.raises(ValueError, match=r"disagree on router_aux_loss_coef"):
        losses.joint_balance_loss([losses.balance_term(a, 2, 0.1), losses.balance_term(b, 2, 0.2)])


def test_the_collection_forms_the_joint_loss_from_reported_terms_with_the_mask():
    logits = layer_logits(num_layers=2)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    report_balance_term(losses.balance_term(logits[0], 2, 0.1))  # no open collection: dropped
    with collect_aux_losses() as aux:
        for t in logits:
            report_balance_term(losses.balance_term(t, 2, 0.1))
    assert len(aux.balance) == 2
    want = 0.1 * load_balancing_loss_func(tuple(logits), 6, 2, mask)
    assert torch.equal(aux.total(logits[0], mask), want)

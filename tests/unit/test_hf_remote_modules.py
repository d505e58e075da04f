"""The remote-code modules (models/hf/remote/dynmoe_layers.py) against dynmoe_dist's MoE math, directly:
the routers (masks, weights and gradients, training and eval, both k = 0 rules), and a whole MoE layer
for every router and both expert kinds, loaded from the training layer's state dict with strict keys."""

import pytest
import torch
from hf_tiny import tiny_model

from dynmoe_dist.models.hf.pretrained import base_model_type, expert_spec
from dynmoe_dist.models.hf.remote import dynmoe_layers as remote
from dynmoe_dist.moe import routing
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.layer import MoELayer

T, D, E = 24, 8, 4


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    gate_ED = torch.randn(E, D, generator=g, dtype=torch.float64, requires_grad=True)
    threshold_E = torch.tensor([0.0, 0.2, 0.4, 0.6], dtype=torch.float64, requires_grad=True)
    return x_TD, gate_ED, threshold_E


def grads(weights_TE, leaves):
    probe_TE = torch.randn(weights_TE.shape, generator=torch.Generator().manual_seed(9), dtype=weights_TE.dtype)
    return torch.autograd.grad((weights_TE * probe_TE).sum(), leaves, allow_unused=True)


@pytest.mark.parametrize("combine", ["equal", "softmax"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("k0", ["top1", "skip"])
def test_top_any_equals_the_training_router(training, k0, combine):
    x_TD, gate_ED, threshold_E = inputs()
    # the training router reads train_k0 ('zero' / 'top1') in training and eval_k0 ('top1' / 'skip') in eval
    train_k0 = "zero" if k0 == "skip" else "top1"
    want = routing.top_any(
        x_TD, gate_ED, threshold_E, training=training, train_k0=train_k0, eval_k0=k0, combine=combine
    )
    mask_TE, weights_TE = remote.top_any(x_TD, gate_ED, threshold_E, "top1" if k0 == "top1" else "skip", combine)
    assert (want.num_selected == 0).any() or k0 == "top1", "some token must select no expert"
    assert torch.equal(mask_TE, want.mask) and torch.equal(weights_TE, want.weights)
    for got, expected in zip(
        grads(weights_TE, (x_TD, gate_ED, threshold_E)), grads(want.weights, (x_TD, gate_ED, threshold_E))
    ):
        assert (got is None) == (expected is None)
        if got is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_top_any_inputs_select_zero_one_and_several_experts():
    x_TD, gate_ED, threshold_E = inputs()
    k_T = routing.top_any(x_TD, gate_ED, threshold_E, training=True).num_selected
    assert {0, 1} <= set(k_T.tolist()) and k_T.max() >= 2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_equals_the_training_router(k):
    logits_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    want = routing.top_k(logits_TE, k)
    mask_TE, weights_TE = remote.top_k(logits_TE, k)
    assert torch.equal(mask_TE, want.mask) and torch.equal(weights_TE, want.weights)


@pytest.mark.parametrize("p", [0.2, 0.5, 1.0])
def test_top_p_equals_the_training_router(p):
    logits_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    want = routing.top_p(logits_TE, p)
    mask_TE, weights_TE = remote.top_p(logits_TE, p)
    assert torch.equal(mask_TE, want.mask) and torch.equal(weights_TE, want.weights)


LAYERS = [
    dict(router="top_any", expert_kind="gated", activation="silu", expert_bias=False, threshold_init=0.3),
    dict(router="top_any", expert_kind="gated", activation="silu", expert_bias=False, combine="softmax"),
    # gpt-oss's clamp at a limit the rows reach, and an alpha of its own
    dict(router="top_any", expert_kind="gpt_oss", swiglu_alpha=1.3, swiglu_limit=0.4, combine="softmax"),
    dict(router="top_any", expert_kind="ffn", activation="gelu_tanh", expert_bias=True, eval_k0="skip"),
    dict(router="top_k", expert_kind="ffn", activation="gelu", expert_bias=True, top_k=2),
    # a run balanced by DeepSeek's rule: the choice bias it left travels and chooses in the export too
    dict(router="top_k", expert_kind="gated", activation="silu", expert_bias=False, top_k=2, balance="bias"),
    dict(router="top_p", expert_kind="gated", activation="relu", expert_bias=True, top_p=0.5),
]


def layer_pair(options):
    torch.manual_seed(0)
    config = MoEConfig(dim=D, ffn_dim=12, num_experts=E, expert_compute="loop", **options)
    layer = MoELayer(config).double()
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.normal_(0, 0.3)
        if getattr(layer.router, "choice_bias", None) is not None:
            layer.router.choice_bias.copy_(torch.linspace(0.1, -0.1, E))  # outweighs the probabilities' spread
    section_moe = {"router": config.router, "train_k0": config.train_k0, "eval_k0": config.eval_k0}
    section_moe.update(top_k=config.top_k, top_p=config.top_p, combine=config.combine, balance=config.balance)
    twin = remote.DynMoELayer(E, D, expert_spec(config), section_moe).double()
    twin.load_state_dict(layer.state_dict(), strict=True)  # the same keys, none missing or extra
    return layer, twin


@pytest.mark.parametrize(
    "options", LAYERS, ids=lambda o: f"{o['router']}-{o['expert_kind']}-{o.get('combine', 'equal')}"
)
@pytest.mark.parametrize("training", [False, True])
def test_remote_layer_equals_the_training_layer(options, training):
    layer, twin = layer_pair(options)
    layer.train(training), twin.train(training)
    x_BLD = torch.randn(2, T // 2, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want, got = layer(x_BLD).output, twin(x_BLD)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert want.abs().max() > 0
    if training:  # a fine-tune of the export trains the same parameters the same way (the LM-loss part)
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-10, msg=name)


def test_a_bad_section_is_a_one_line_value_error():
    good = {"format": 2, "moe_blocks": [0, 2], "num_experts": [2, 2], "experts": [{}, {}], "moe": {}}
    with pytest.raises(ValueError, match=r"config.dynmoe lacks \['moe'\]: not written by python -m dynmoe_dist"):
        remote.check_section({k: v for k, v in good.items() if k != "moe"}, 3)
    with pytest.raises(ValueError, match=r"section of format 2 or 3, got \{'format': 1"):
        remote.check_section({**good, "format": 1}, 3)
    with pytest.raises(ValueError, match=r"moe_blocks \(\[0, 2\]\), num_experts \(\[2\]\), experts differ"):
        remote.check_section({**good, "num_experts": [2]}, 3)
    with pytest.raises(ValueError, match=r"moe_blocks entry \(2\) out of range 0..1"):
        remote.check_section(good, 2)


def test_export_refuses_a_base_without_remote_classes():
    with pytest.raises(ValueError, match=r"base model type \('bert'\) has no remote-code class .*llama, qwen2"):
        base_model_type(tiny_model("bert", 16, num_hidden_layers=1))


def test_export_config_drops_the_gguf_base_quantization_config():
    """A model loaded from a .gguf file keeps quantization_config (gguf_file, quant_method) in its config;
    the export's weights are dequantised floats, and lm-eval's loader stopped on an export that carried it
    ('Loading a GGUF checkpoint needs the file named as from_pretrained(..., gguf_file=...)')."""
    from dynmoe_dist.models.hf.pretrained import exported_config

    model = tiny_model("llama", 16, num_hidden_layers=1)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "base.gguf", "dequantize": False}
    model.config._name_or_path = "/somewhere/base"
    saved = exported_config(model, {"base_model_type": "llama"}).to_dict()
    assert "quantization_config" not in saved and saved.get("_name_or_path", "") != "/somewhere/base"
    assert saved["model_type"] == "dynmoe_llama" and saved["num_hidden_layers"] == 1


def test_format_3_sections_are_read_and_a_dense_layer_is_no_moe_block():
    from hf_tiny import tiny_config

    from dynmoe_dist.models.hf.remote import configuration_dynmoe_moe, modeling_dynmoe_moe

    good = {"format": 3, "moe_blocks": [1], "num_experts": [2], "experts": [{}], "moe": {}}
    assert remote.check_section(good, 3) is good
    fields = tiny_config("qwen3_moe", 16).to_dict()  # mlp_only_layers = [0]: layer 0 is dense
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "transformers_version")}
    spec = {"expert_kind": "gated", "activation": "silu", "expert_bias": False, "ffn_dim": 12}
    section = {**good, "moe_blocks": [0], "experts": [spec], "moe": {"router": "top_any"}, "block": "routed"}
    config = configuration_dynmoe_moe.DynMoEQwen3MoeConfig(**fields)
    config.dynmoe = section
    with pytest.raises(ValueError, match=r"moe_blocks entry \(0\) is no sparse MoE block \(Qwen3MoeMLP\)"):
        modeling_dynmoe_moe.DynMoEQwen3MoeForCausalLM(config)
    config.dynmoe = {**section, "moe_blocks": [1], "block": "tied"}
    with pytest.raises(ValueError, match=r"config.dynmoe: block \('tied'\) must be one of \['routed', "):
        modeling_dynmoe_moe.DynMoEQwen3MoeForCausalLM(config)


def test_the_remote_classes_are_made_once_per_stock_class_and_only_for_transformers_classes():
    from dynmoe_dist.models.hf.remote import configuration_dynmoe_moe, modeling_dynmoe_moe

    model_class = modeling_dynmoe_moe.DynMoEMixtralForCausalLM
    assert model_class is modeling_dynmoe_moe.DynMoEMixtralForCausalLM  # one class: AutoConfig maps to it
    assert model_class.config_class is configuration_dynmoe_moe.DynMoEMixtralConfig
    assert model_class.config_class.model_type == "dynmoe_mixtral"
    assert modeling_dynmoe_moe.DynMoEDeepseekV3ForCausalLM._keep_in_fp32_modules_strict[-1] == "moe.router.weight"
    for module, name in ((modeling_dynmoe_moe, "DynMoENoSuchForCausalLM"), (configuration_dynmoe_moe, "Mixtral")):
        with pytest.raises(AttributeError, match=name):
            getattr(module, name)

"""upcycle_hf on tiny random transformers models of every supported family (built offline, float64).

At initialisation every expert is a copy of the dense MLP and every token's combine weights sum to 1
(eval mode, eval_k0='top1': k >= 1, weights 1/k), so the upcycled model's logits must equal the dense
model's; a wrong weight layout (GPT-2's transposed Conv1D), activation (gelu_new vs erf GELU) or a
LayerNorm pulled inside the MoE (BERT) would break the equality by far more than 1e-6.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import HIDDEN, MLP, NUM_LAYERS, tiny_model  # noqa: E402

from dynmoe_dist.hf import HFCausalLM, MoEBlock, find_mlps, moe_blocks, upcycle_hf  # noqa: E402
from dynmoe_dist.moe import MoEConfig  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers  # noqa: E402

D, F, V, N_LAYERS = HIDDEN, MLP, 64, NUM_LAYERS
FAMILIES = ("llama", "llama_bias", "qwen2", "mistral", "gpt2", "bert", "vit")


# What the adapter must read off each family: expert kind and activation.
EXPECTED = {
    "llama": ("gated", "silu"),
    "llama_bias": ("gated", "silu"),
    "qwen2": ("gated", "silu"),
    "mistral": ("gated", "silu"),
    "gpt2": ("ffn", "gelu_tanh"),
    "bert": ("ffn", "gelu"),
    "vit": ("ffn", "gelu"),
}


def inputs_for(family, batch=2, length=5):
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 8, 8, generator=g, dtype=torch.float64)}
    return {"input_ids": torch.randint(0, V, (batch, length), generator=g)}


def built(family):
    model = tiny_model(family, V).double()
    # Random non-zero biases: a bias dropped or mis-assigned in the conversion must show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_upcycled_model_computes_the_dense_function(family):
    model = built(family).eval()
    x = inputs_for(family)
    with torch.no_grad():
        want = model(**x).logits
    upcycle_hf(model, MoEConfig(num_experts=4), layers=[0, 2])
    layers = find_moe_layers(model)
    assert len(layers) == 2 and all(isinstance(b, MoEBlock) for b in moe_blocks(model))
    kind, act = EXPECTED[family]
    assert all(m.config.expert_kind == kind and m.config.activation == act for _, m in layers)
    assert all(m.config.dim == D and m.config.ffn_dim == F and len(m.experts) == 4 for _, m in layers)
    assert all(m.router.weight.dtype == torch.float64 for _, m in layers)
    assert len(find_mlps(model)) == N_LAYERS - 2  # the dense MLP of block 1 is still there
    with torch.no_grad():
        got = model(**x).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # ...and not trivially: more than one expert was selected by some token
    k = [m.router(torch.randn(7, D, dtype=torch.float64), False).num_selected for _, m in layers]
    assert max(int(t.max()) for t in k) > 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_reach_experts_and_routers(family):
    model = built(family).train()
    upcycle_hf(model, MoEConfig(num_experts=3), layers=[1])
    with collect_aux_losses() as collected:
        logits = model(**inputs_for(family, batch=3, length=6)).logits
    aux = collected.total(logits)
    assert len(collected.losses) == 1  # the one MoE block reported once
    assert aux.dim() == 0 and aux > 0  # top_any's diverse/simple terms
    with collect_aux_losses() as outer:
        with collect_aux_losses() as inner:
            model(**inputs_for(family))
    assert len(inner.losses) == 1 and not outer.losses  # the innermost collection only
    model(**inputs_for(family))  # no collection open: nothing is kept anywhere
    assert not any(hasattr(block, "aux_loss") for block in moe_blocks(model))
    (logits.square().mean() + aux).backward()
    ((_, layer),) = find_moe_layers(model)
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.router.threshold.grad.abs().sum() > 0
    with_grad = [e for e in layer.experts.experts if e.w_in.grad is not None and e.w_in.grad.abs().sum() > 0]
    assert with_grad, "no expert received a gradient"


def test_bert_keeps_layernorm_and_residual_outside_the_moe():
    model = built("bert")
    upcycle_hf(model, MoEConfig(num_experts=2), layers=[0])
    layer = model.bert.encoder.layer[0]
    assert isinstance(layer.intermediate, MoEBlock)
    assert isinstance(layer.output.dense, torch.nn.Identity)
    assert isinstance(layer.output.LayerNorm, torch.nn.LayerNorm)


def test_gpt2_keeps_its_mlp_dropout():
    model = tiny_model("gpt2", V, n_layer=1, resid_pdrop=0.25)
    upcycle_hf(model, MoEConfig(num_experts=2))
    block = model.transformer.h[0].mlp
    assert isinstance(block, MoEBlock) and block.dropout.p == 0.25


def test_causal_lm_wrapper_returns_model_output():
    model = built("llama")
    upcycle_hf(model, MoEConfig(num_experts=2), layers=[2])
    out = HFCausalLM(model)(torch.randint(0, V, (2, 4)))
    assert out.logits.shape == (2, 4, V) and out.aux_loss.dim() == 0 and out.aux_loss > 0


def test_unsupported_architecture_names_its_class():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"Sequential: no dense MLP.*supported: LLaMA / Qwen2 / Mistral.*GPT-2"):
        upcycle_hf(model, MoEConfig(num_experts=2))


def test_layer_index_beyond_the_model():
    with pytest.raises(ValueError, match=r"MoE layer index \(3\) out of range: LlamaForCausalLM has 3 MLP blocks"):
        upcycle_hf(tiny_model("llama", V), MoEConfig(num_experts=2), layers=[3])


def test_unknown_activation_is_refused():
    model = tiny_model("llama", V, num_hidden_layers=1, hidden_act="gelu_fast")
    with pytest.raises(ValueError, match=r"activation module FastGELUActivation has no DynMoE equivalent"):
        upcycle_hf(model, MoEConfig(num_experts=2))

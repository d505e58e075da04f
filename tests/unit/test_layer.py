"""MoELayer API, upcycling, bad input, and the models built on the layer."""

import pytest
import torch

from dynmoe_dist import FeedForward, MoEConfig, MoELayer, upcycle
from dynmoe_dist.config import ModelConfig
from dynmoe_dist.models.transformer import CausalLM, EncoderClassifier, ViTClassifier


def test_layer_returns_output_aux_and_routing():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=16, ffn_dim=32, num_experts=4))
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = layer(x)
    assert out.output.shape == x.shape and out.aux_loss.dim() == 0 and out.aux_loss > 0
    assert out.routing.mask.shape == (15, 4)
    (out.output.sum() + out.aux_loss).backward()
    assert layer.router.weight.grad is not None and layer.router.threshold.grad is not None
    assert layer.router.weight.shape == (4, 16)
    # orthogonal init: rows are orthonormal
    torch.testing.assert_close(layer.router.weight @ layer.router.weight.t(), torch.eye(4), atol=1e-5, rtol=0)


def test_aux_loss_is_weighted_sum_of_selected_losses():
    torch.manual_seed(0)
    from dynmoe_dist.moe import losses

    cfg = MoEConfig(dim=8, ffn_dim=8, num_experts=3, aux_losses=("diverse", "efficiency"), aux_loss_weight=0.5)
    layer = MoELayer(cfg)
    out = layer(torch.randn(10, 8))
    want = 0.5 * (losses.diverse_loss(layer.router.weight) + losses.efficiency_loss(out.routing))
    torch.testing.assert_close(out.aux_loss, want)
    assert MoEConfig(router="top_k").aux_losses == ("switch",)
    # a bare top-any layer takes its preset's losses: the project preset's two, the paper preset's four
    assert MoEConfig().aux_losses == ("diverse", "simple")
    assert MoEConfig(preset="paper").aux_losses == ("diverse", "simple", "load_balance", "efficiency")


@pytest.mark.parametrize("router", ["top_any", "top_k"])
def test_upcycled_identical_experts_compute_dense_block(router):
    torch.manual_seed(0)
    dense = FeedForward(16, 32)
    model = torch.nn.Sequential(dense)
    x = torch.randn(50, 16)
    want = dense(x)
    upcycle(model, MoEConfig(num_experts=4, router=router, top_k=2))
    layer = model[0]
    assert isinstance(layer, MoELayer) and len(layer.experts) == 4
    out = layer(x)
    k = out.routing.num_selected
    assert (k > 0).any()
    # wherever combine weights sum to 1 (every routed token), the layer equals the dense block
    torch.testing.assert_close(out.output[k > 0], want[k > 0], rtol=1e-5, atol=1e-6)
    assert out.output[k == 0].abs().sum() == 0  # training: k = 0 rides the residual


def test_upcycle_keeps_eval_mode():
    model = torch.nn.Sequential(FeedForward(8, 16), FeedForward(8, 16)).eval()
    upcycle(model, MoEConfig(num_experts=2), layers=[1])
    assert not model[1].training and not any(m.training for m in model[1].modules())


def test_upcycle_chooses_layers_and_rejects_bad_index():
    model = torch.nn.Sequential(FeedForward(8, 16), FeedForward(8, 16), FeedForward(8, 16))
    upcycle(model, MoEConfig(num_experts=2), layers=[2])
    assert isinstance(model[2], MoELayer) and isinstance(model[0], FeedForward)
    with pytest.raises(ValueError, match=r"layers entry \(7\)"):
        upcycle(model, MoEConfig(num_experts=2), layers=[7])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=0), r"num_experts \(0\)"),
        (dict(num_experts=4, max_experts=3), r"max_experts \(3\) < num_experts \(4\)"),
        (dict(router="top_k", top_k=0), r"top_k \(0\)"),
        (dict(router="top_k", num_experts=4, top_k=5), r"top_k \(5\)"),
        (dict(top_p=1.5), r"top_p \(1.5\)"),
        (dict(top_p=0.0), r"top_p \(0.0\)"),
        (dict(router="top_q"), r"router \('top_q'\)"),
        (dict(min_experts=5, num_experts=4), r"min_experts \(5\) > num_experts \(4\)"),
        (dict(aux_losses=("nope",)), r"aux_losses entry \('nope'\)"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


def test_wrong_last_dimension():
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=2))
    with pytest.raises(ValueError, match=r"input last dimension \(7\) != dim \(8\)"):
        layer(torch.randn(3, 7))


def test_eval_k0_falls_back_and_skip_option():
    torch.manual_seed(0)
    cfg = MoEConfig(dim=8, ffn_dim=8, num_experts=2)
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.threshold.fill_(5.0)  # sigmoid(cos) never beats sigmoid(5): every token has k = 0
    x = torch.randn(6, 8)
    assert layer(x).output.abs().sum() == 0  # training: output 0
    layer.eval()
    out = layer(x)
    assert out.routing.num_selected.tolist() == [1] * 6 and out.output.abs().sum() > 0
    layer.config.eval_k0 = "skip"
    assert layer(x).output.abs().sum() == 0


def _moe(router="top_any"):
    return MoEConfig(num_experts=4, router=router, top_k=2)


@pytest.mark.parametrize("router", ["top_any", "top_k", "top_p"])
def test_models_forward_backward(router):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, num_heads=4, num_layers=2, ffn_dim=64, moe_layers=[0, 1], patch_size=4)
    moe = _moe(router)
    enc = EncoderClassifier(cfg, moe, vocab_size=50, max_len=12, num_classes=3)
    tokens = torch.randint(0, 50, (4, 12))
    valid = torch.ones(4, 12, dtype=torch.bool)
    valid[0, 6:] = False
    out = enc(tokens, valid)
    assert out.logits.shape == (4, 3) and out.aux_loss > 0
    (out.logits.sum() + out.aux_loss).backward()
    vit = ViTClassifier(cfg, moe, image_size=8, channels=1, num_classes=10)
    assert vit(torch.randn(2, 1, 8, 8)).logits.shape == (2, 10)
    lm = CausalLM(cfg, moe, vocab_size=40, max_len=10)
    assert lm(torch.randint(0, 40, (2, 10))).logits.shape == (2, 10, 40)


def test_causal_lm_does_not_look_ahead():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, num_heads=2, num_layers=2, ffn_dim=32, moe_layers=[1])
    lm = CausalLM(cfg, MoEConfig(num_experts=2, router="top_k", top_k=1), vocab_size=20, max_len=8).eval()
    a = torch.randint(0, 20, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 20
    torch.testing.assert_close(lm(a).logits[0, :5], lm(b).logits[0, :5])


def test_padding_does_not_change_encoder_output():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, num_heads=2, num_layers=1, ffn_dim=32, moe_layers=[0])
    enc = EncoderClassifier(
        cfg, MoEConfig(num_experts=2, router="top_k", top_k=1), vocab_size=20, max_len=8, num_classes=2
    ).eval()
    tokens = torch.randint(0, 20, (1, 5))
    padded = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], 1)
    valid = torch.tensor([[True] * 5 + [False] * 3])
    torch.testing.assert_close(enc(tokens).logits, enc(padded, valid).logits, rtol=1e-5, atol=1e-6)


def test_models_read_only_fields_the_run_config_has():
    import dataclasses

    from dynmoe_dist.models.transformer import ModelShape

    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    assert set(ModelShape.__annotations__) <= set(fields), set(ModelShape.__annotations__) - set(fields)

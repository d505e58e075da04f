"""MoELayer options and router details on small cases: train_k0, aux-loss switches, the reducer
protocol, routing observers, softmax-router init / dtype / resize."""

import pytest
import torch

from dynmoe_dist import MoEConfig, MoELayer
from dynmoe_dist.moe.layer import LocalDispatcher, LocalMeta, SoftmaxRouter, is_recomputing, recomputing


def _all_k0_layer(**kwargs):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3, **kwargs))
    with torch.no_grad():
        layer.router.threshold.fill_(5.0)  # cos <= 1 < 5: no token selects anything
    return layer


def test_train_k0_top1_reaches_the_router():
    x = torch.randn(5, 4)
    layer = _all_k0_layer(train_k0="top1")
    out = layer(x)  # training mode: with 'top1' every k = 0 token gets its argmax expert
    assert layer.training and out.routing.num_selected.tolist() == [1] * 5
    assert out.output.abs().sum() > 0
    assert _all_k0_layer(train_k0="zero")(x).routing.num_selected.tolist() == [0] * 5


def test_no_aux_loss_in_eval_without_losses_or_with_weight_zero():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3))
    assert layer(x).aux_loss > 0
    assert layer.eval()(x).aux_loss == 0
    assert MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3, aux_losses=()))(x).aux_loss == 0
    assert MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3, aux_loss_weight=0.0))(x).aux_loss == 0


def test_aux_loss_is_weight_times_loss_scale_times_the_sum_and_uses_the_reducer():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    cfg = dict(dim=4, ffn_dim=6, num_experts=3, aux_losses=("efficiency",))
    layer = MoELayer(MoEConfig(aux_loss_weight=1.0, **cfg))
    efficiency = layer(x).routing.mask.float().mean()  # mean k / E of this batch
    torch.testing.assert_close(layer(x).aux_loss, efficiency)  # weight 1 x scale 1 x loss

    class HalfScaleReducer:  # what data parallelism injects: a sum over ranks and a 1/world scale
        loss_scale = 0.5
        calls = 0

        def sum(self, t):
            HalfScaleReducer.calls += 1
            return t

    layer.reducer = HalfScaleReducer()
    torch.testing.assert_close(layer(x).aux_loss, 0.5 * efficiency)
    assert HalfScaleReducer.calls == 1  # the token statistics went through the injected reducer, once


def test_routing_observers_see_the_layer_the_flat_tokens_and_the_routing():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3))
    seen = []
    layer.routing_observers.append(lambda lyr, x_TD, routing: seen.append((lyr, x_TD, routing)))
    x = torch.randn(2, 5, 4)
    out = layer(x)
    assert len(seen) == 1
    lyr, x_TD, routing = seen[0]
    assert lyr is layer and routing is out.routing
    assert x_TD.shape == (10, 4) and torch.equal(x_TD, x.reshape(10, 4))


def test_observers_skip_a_forward_that_activation_checkpointing_replays():
    # The replayed forward (inside recomputing()) was observed once already; one level of nesting is
    # enough to count as replaying, and leaving the context ends it.
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3))
    seen = []
    layer.routing_observers.append(lambda lyr, x_TD, routing: seen.append(x_TD.shape[0]))
    x = torch.randn(5, 4)
    layer(x)
    assert not is_recomputing() and seen == [5]
    with recomputing():
        assert is_recomputing()
        layer(x)
    assert not is_recomputing() and seen == [5]
    layer(x[:2])
    assert seen == [5, 2]


def test_layer_on_the_grouped_mm_path_hands_the_expert_counts_to_the_bank():
    # The grouped path takes its segments from the counts tensor (the loop from the Python sizes):
    # forced grouped_mm on CPU must give the loop's output for the same layer and tokens.
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=16, num_experts=3, threshold_init=-0.2, expert_compute="grouped_mm"))
    x = torch.randn(7, 8)
    grouped = layer(x)
    assert grouped.routing.num_selected.sum() > 3  # several rows over several experts
    layer.config.expert_compute = "loop"  # the bank shares the layer's config
    torch.testing.assert_close(grouped.output, layer(x).output)


class _MetaWithoutSizes:
    """A dispatcher of its own whose metadata is a plain tuple: no sizes_e, so the bank reads the counts."""

    def __init__(self):
        self.local = LocalDispatcher()

    def dispatch(self, x_TD, routing):
        rows_RD, counts_e, meta = self.local.dispatch(x_TD, routing)
        return rows_RD, counts_e, (meta.token_R, meta.weight_R, meta.num_tokens)

    def combine(self, rows_RD, meta):
        return self.local.combine(rows_RD, LocalMeta(*meta))


def test_a_dispatcher_whose_metadata_has_no_sizes_gives_the_same_output():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=6, num_experts=3, threshold_init=-0.2))
    x = torch.randn(6, 4)
    want = layer(x).output
    layer.dispatcher = _MetaWithoutSizes()
    torch.testing.assert_close(layer(x).output, want)


def test_wrong_last_dimension_of_a_3d_input_names_that_dimension():
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=2))
    with pytest.raises(ValueError, match=r"input last dimension \(7\) != dim \(8\)"):
        layer(torch.randn(2, 3, 7))


def test_softmax_router_init_is_normal_zero_mean_init_std():
    torch.manual_seed(0)
    router = SoftmaxRouter(MoEConfig(dim=64, ffn_dim=8, num_experts=64, router="top_k", init_std=0.02))
    w = router.weight.detach()
    # 4096 samples: the sample mean's std is 0.02 / 64 = 3e-4, the sample std's relative error ~1%.
    assert abs(float(w.mean())) < 2e-3
    assert 0.018 < float(w.std()) < 0.022


@pytest.mark.parametrize("router", ["top_k", "top_p"])
def test_softmax_router_computes_in_fp32_for_bf16_tokens(router):
    torch.manual_seed(0)
    r = SoftmaxRouter(MoEConfig(dim=4, ffn_dim=8, num_experts=3, router=router))
    routing = r(torch.randn(5, 4).bfloat16(), True)
    assert routing.probs.dtype == torch.float32 and routing.weights.dtype == torch.float32


def test_softmax_router_resize_keeps_rows_in_order_and_appends_new_ones():
    torch.manual_seed(0)
    r = SoftmaxRouter(MoEConfig(dim=2, ffn_dim=8, num_experts=3, router="top_k", top_k=1))
    old = r.weight.detach().clone()
    r.resize([2, 0], torch.tensor([[1.0, -1.0]], dtype=torch.float64))
    assert isinstance(r.weight, torch.nn.Parameter) and r.weight.requires_grad
    assert r.weight.dtype == torch.float32 and r.weight.shape == (3, 2)
    assert torch.equal(r.weight.detach(), torch.stack([old[2], old[0], torch.tensor([1.0, -1.0])]))


def test_top_any_router_resize_keeps_the_parameter_dtype_and_zero_thresholds_for_new_experts():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=2, ffn_dim=4, num_experts=3))
    with torch.no_grad():
        layer.router.threshold.copy_(torch.tensor([0.1, 0.2, 0.3]))
    old = layer.router.weight.detach().clone()
    layer.router.resize([2, 0], torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert layer.router.weight.dtype == torch.float32 and layer.router.threshold.dtype == torch.float32
    assert torch.equal(layer.router.weight.detach(), torch.stack([old[2], old[0], torch.tensor([0.0, 1.0])]))
    torch.testing.assert_close(layer.router.threshold.detach(), torch.tensor([0.3, 0.1, 0.0]))


def test_softmax_router_upcasts_bf16_weights_too():
    # train.precision = bf16 casts the whole model, router included: the logits still come out in fp32.
    torch.manual_seed(0)
    r = SoftmaxRouter(MoEConfig(dim=4, ffn_dim=8, num_experts=3, router="top_k", top_k=1)).bfloat16()
    routing = r(torch.randn(5, 4).bfloat16(), True)
    assert r.weight.dtype == torch.bfloat16 and routing.probs.dtype == torch.float32


def test_layer_output_keeps_the_input_dtype_under_autocast():
    # Under bf16 autocast the routed rows are computed in bf16; the layer hands back the input's dtype.
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=8, num_experts=3))
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.output.dtype == torch.float32 and out.output.shape == (6, 4)


@pytest.mark.parametrize(
    "router, kind", [("top_any", "TopAnyRouter"), ("top_k", "SoftmaxRouter"), ("top_p", "SoftmaxRouter")]
)
def test_layer_builds_the_router_its_config_names(router, kind):
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=8, num_experts=3, router=router))
    assert type(layer.router).__name__ == kind

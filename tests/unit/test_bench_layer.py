"""The layer benchmark's building blocks at tiny sizes: correctness only, no timing assertions."""

import json

import pytest
import torch

from dynmoe_dist.bench import layer, measure
from dynmoe_dist.bench.dense_dispatch import dense_dispatch_forward, dense_dispatch_tensors
from dynmoe_dist.bench.layer_cases import (
    CaseSpec,
    build_case,
    build_layer,
    calibrate_top_any,
    check_reference,
    make_tokens,
    peak_memory_mb,
)
from dynmoe_dist.bench.layer_split import PHASES, parse_sizes, phase_steps
from dynmoe_dist.moe.routing import Routing

TINY = dict(dim=16, ffn_dim=32, num_experts=4, k=2)


def test_dense_dispatch_tensors_hand_worked():
    # token 0 -> e0; token 1 -> e0, e1 (weights 1/2); token 2 -> e1.
    # e0 buffer: [token 0, token 1]; e1 buffer: [token 1, token 2]; capacity C = 2.
    mask = torch.tensor([[1, 0], [1, 1], [0, 1]], dtype=torch.bool)
    weights = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    combine, dispatch, capacity = dense_dispatch_tensors(Routing(mask, weights, mask.sum(-1), mask.float()))
    assert capacity == 2 and combine.shape == (3, 2, 2)
    want = torch.zeros(3, 2, 2)
    want[0, 0, 0], want[1, 0, 1], want[1, 1, 0], want[2, 1, 1] = 1.0, 0.5, 0.5, 1.0
    torch.testing.assert_close(combine, want)
    assert torch.equal(dispatch, want > 0)


@pytest.mark.parametrize("training", [True, False])
def test_dense_dispatch_equals_moe_layer_output_and_gradients(training):
    spec = CaseSpec(case="dense_dispatch", tokens=40, **TINY)
    layer_module = build_layer(spec, "top_any").train(training)
    x, grad = make_tokens(spec)
    with torch.no_grad():
        # Spread the thresholds so that some tokens pick no expert and others pick several.
        layer_module.router.threshold.copy_(torch.tensor([-0.1, 0.0, 0.1, 0.3]))
    ours = layer_module(x)
    assert (ours.routing.num_selected == 0).any() == training  # evaluation falls back to top-1
    assert (ours.routing.num_selected > 1).any()
    ours_grads = torch.autograd.grad(ours.output, [x, *layer_module.parameters()], grad, allow_unused=True)
    out, _, capacity = dense_dispatch_forward(layer_module, x)
    ref_grads = torch.autograd.grad(out, [x, *layer_module.parameters()], grad, allow_unused=True)
    assert capacity == int(ours.routing.mask.sum(0).max())
    torch.testing.assert_close(out, ours.output, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(ours_grads, ref_grads):
        if theirs is None:
            assert mine is None or mine.abs().sum() == 0
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_check_reference_passes_at_tiny_size():
    report = check_reference(CaseSpec(case="dense_dispatch", tokens=64, **TINY))
    assert report["passed"] and report["output_max_abs_diff"] < 1e-5


@pytest.mark.parametrize("mean_k", [1, 2, 3])
def test_calibration_reaches_requested_mean_k(mean_k):
    spec = CaseSpec(case="top_any", tokens=256, **TINY)
    layer_module = build_layer(spec, "top_any")
    x, _ = make_tokens(spec)
    achieved = calibrate_top_any(layer_module, x, mean_k)
    assert achieved == pytest.approx(mean_k, abs=1 / 256)
    thresholds = layer_module.router.threshold
    assert torch.all(thresholds == thresholds[0])  # one value shared by all experts
    with torch.no_grad():
        assert layer_module(x).routing.num_selected.float().mean().item() == pytest.approx(achieved)


def test_every_case_builds_and_steps():
    for case in ("top_any", "top_k", "top_any_grouped_mm", "top_k_grouped_mm", "dense_dispatch"):
        step, info = build_case(CaseSpec(case=case, tokens=32, **TINY))
        step()
        assert info["mean_k"] == pytest.approx(2, abs=1 / 32)
    step, info = build_case(CaseSpec(case="dense_limit", tokens=32, **TINY), num_rows=61)
    step()
    assert info == {"rows": 61}
    with pytest.raises(ValueError, match=r"case \('top_q'\)"):
        build_case(CaseSpec(case="top_q", tokens=8, **TINY))


def test_json_has_figures_targets_and_scaling(capsys):
    args = [
        "--tokens",
        "64",
        "--dim",
        "16",
        "--ffn-dim",
        "32",
        "--experts",
        "4",
        "--k",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--scaling",
        "32,64",
        "--scaling-repeats",
        "1",
        "--no-memory",
        "--split-sizes",
        "32x16x32x4,48x8x16x6",
    ]
    result = layer.main(args)
    assert json.loads(capsys.readouterr().out) == result
    assert result["machine"]["threads"] == 1 and result["reference_check"]["passed"]
    for case in layer.HEADLINE_CASES:
        assert result["cases"][case]["ms_min"] > 0
    assert result["cases"]["dense_limit"]["rows"] == round(64 * result["cases"]["top_any"]["mean_k"])
    assert set(result["targets"]) == set(layer.TARGETS)
    assert result["targets"]["memory_vs_dense_dispatch"]["met"] is None  # --no-memory
    assert isinstance(result["targets"]["top_any_vs_top_k"]["met"], bool)
    assert set(result["expert_compute"]) == {"top_any", "top_k"}
    assert [row["tokens"] for row in result["scaling"]["rows"]] == [32, 64]
    assert set(result["scaling"]["growth_exponent_last_doubling"]) == set(layer.SCALING_CASES)
    rows = result["split"]["rows"]
    assert [row["shape"]["tokens"] for row in rows] == [32, 48] and rows[1]["shape"]["num_experts"] == 6
    for row in rows:
        for router in ("top_any", "top_k"):
            assert all(row[router][phase] > 0 for phase in PHASES), row
        assert row["mean_k"]["top_k"] == 2 and row["mean_k"]["top_any"] == pytest.approx(2, abs=1 / 32)
    assert result["split"]["worst_whole_ratio"] == max(row["top_any_over_top_k"]["whole"] for row in rows)
    assert isinstance(result["targets"]["top_any_vs_top_k_every_size"]["met"], bool)


def test_dispatch_cap_skips_large_tokens(capsys):
    args = [
        "--tokens",
        "32",
        "--dim",
        "16",
        "--ffn-dim",
        "32",
        "--experts",
        "4",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--scaling",
        "32,64",
        "--scaling-repeats",
        "1",
        "--no-memory",
        "--dispatch-max-tokens",
        "32",
        "--split-sizes",
        "",
    ]
    rows = layer.main(args)["scaling"]["rows"]
    assert "ms_min" in rows[0]["dense_dispatch"]
    assert "dispatch-max-tokens" in rows[1]["dense_dispatch"]["skipped"]


@pytest.mark.skipif(not measure.memory_supported(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_in_fresh_process_sees_the_step():
    # 8192 x 256 fp32 rows through a 256 -> 512 block: the hidden activations alone are 16 MiB
    # twice (pre- and post-GELU), and their gradients as much again; about 57 MiB in all.
    peak = peak_memory_mb(CaseSpec(case="dense_limit", tokens=4096, dim=256, ffn_dim=512), num_rows=8192)
    assert 32 < peak < 160


@pytest.mark.parametrize("router", ["top_any", "top_k"])
def test_each_phase_trains_what_it_names(router):
    """router: the gate's parameters and the tokens; losses: the gate vectors (top-any's diverse and simple
    losses) or the router's weights through the probabilities (Switch); dispatch: the tokens; experts: the
    expert weights. Each phase alone fills exactly those gradients."""
    spec = CaseSpec(case=router, tokens=40, **TINY)
    layer_module = build_layer(spec, router)
    x, grad = make_tokens(spec)
    steps = phase_steps(layer_module, x, grad)
    assert tuple(steps) == PHASES
    expert_params = list(layer_module.experts.parameters())
    for phase, filled_x, filled_router, filled_experts in (
        ("router", True, True, False),
        ("losses", False, router == "top_any", False),
        ("dispatch", True, False, False),
        ("experts", False, False, True),
        ("whole", True, True, True),
    ):
        for p in [x, layer_module.router.weight, *expert_params]:
            p.grad = None
        steps[phase]()
        assert (x.grad is not None) == filled_x, phase
        assert (layer_module.router.weight.grad is not None) == filled_router, phase
        assert all((p.grad is not None) == filled_experts for p in expert_params), phase


def test_split_sizes_are_four_positive_integers():
    assert parse_sizes("4096x256x512x8, 8x4x4x2") == [(4096, 256, 512, 8), (8, 4, 4, 2)] and parse_sizes("") == []
    with pytest.raises(ValueError, match=r"--split-sizes entry \('4096x256x512'\) must be TxDxFxE"):
        parse_sizes("4096x256x512")

"""bench hf: the summary against its target and the active-parameter count (hand-worked), the option
checks, and one tiny real run (slow)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dynmoe_dist.bench.hf import check, summarize


def _rank(dense_s, moe_s, rank=0):
    return {
        "rank": rank,
        "active_parameters": {"dense": 1000, "moe": 1004},
        "step_s": {"dense": dense_s, "moe": moe_s},
        "step_peak_rss_mib": {"dense": 100.0 + rank, "moe": 120.0},
        "state_mib": {"dense": 50.0, "moe": 60.0 + rank},
    }


def test_summary_takes_the_slowest_rank_per_step_and_checks_the_target():
    # slowest per step: dense [2.0, 2.2, 1.8] -> median 2.0; moe [2.4, 3.0, 2.6] -> median 2.6 = 1.3x: met
    per_rank = [_rank([2.0, 2.1, 1.8], [2.4, 3.0, 2.5]), _rank([1.9, 2.2, 1.7], [2.3, 2.8, 2.6], rank=1)]
    out = summarize(per_rank)
    assert out["cases"]["dense"]["step_s_median"] == 2.0 and out["cases"]["moe"]["step_s_median"] == 2.6
    assert out["cases"]["dense"]["step_s_min"] == 1.8
    assert out["moe_over_dense_step_time"] == 1.3 and out["meets_time_target"]
    assert out["cases"]["dense"]["step_peak_rss_mib_per_rank"] == 101.0  # the larger rank's
    assert out["cases"]["moe"]["state_mib_per_rank"] == 61.0
    assert out["moe_over_dense_active_parameters"] == 1.004
    # moe median 2.7 over 2.0 = 1.35x: missed
    assert not summarize([_rank([2.0], [2.7])])["meets_time_target"]


def test_active_parameters_count_top_k_experts_only():
    from dynmoe_dist.bench.hf import active_parameters
    from dynmoe_dist.models.transformer import CausalLM
    from dynmoe_dist.moe import MoEConfig

    shape = SimpleNamespace(dim=8, num_heads=2, num_layers=1, ffn_dim=16, dropout=0.0, moe_layers=[0], patch_size=1)
    model = CausalLM(shape, MoEConfig(num_experts=4, router="top_k", top_k=1), 10, 6)
    total = sum(p.numel() for p in model.parameters())
    (layer,) = [m for m in model.modules() if type(m).__name__ == "MoELayer"]
    per_expert = sum(p.numel() for p in layer.experts.experts[0].parameters())
    assert active_parameters(model) == total - 3 * per_expert  # 4 experts, one active


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_layers": 0}, r"--num-layers \(0\) must be >= 1"),
        ({"num_experts": 1}, r"--num-experts \(1\) must be >= 2"),
        ({"moe_blocks": [0, 4]}, r"--moe-blocks \(\[0, 4\]\) must lie in 0..3"),
    ],
)
def test_bad_options_name_the_option_and_value(changes, message):
    args = SimpleNamespace(**{"num_layers": 4, "num_experts": 4, "moe_blocks": None, **changes})
    with pytest.raises(ValueError, match=message):
        check(args)


@pytest.mark.slow
def test_tiny_hf_bench_run_prints_the_comparison():
    pytest.importorskip("transformers")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynmoe_dist.bench",
            "hf",
            "--num-layers",
            "1",
            "--seq-len",
            "16",
            "--batch-per-rank",
            "1",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "hf" and result["world"] == 2
    assert abs(result["moe_over_dense_active_parameters"] - 1) < 1e-3  # k = 1 expert of the dense size
    for case in result["cases"].values():
        assert case["step_s_median"] > 0 and case["state_mib_per_rank"] > 0
    assert isinstance(result["meets_time_target"], bool)

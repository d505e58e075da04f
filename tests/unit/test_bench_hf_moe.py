"""bench hf-moe: the summary and the comparison (hand-worked), the two sides' steps on a tiny checkpoint in this
process (the same first loss: same weights, tokens and routing; the profile finds both models' MoE blocks),
and a tiny run of the whole benchmark (slow: 3 spawned processes)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dynmoe_dist.bench import hf_moe as bench  # noqa: E402
from dynmoe_dist.bench.moe_checkpoint import write_checkpoint  # noqa: E402
from dynmoe_dist.bench.step_profile import moe_parts, profile_steps  # noqa: E402


def _rank(wall, cpu, loss, state=10.0, peak=5.0):
    return {
        "wall": wall,
        "cpu": cpu,
        "first_loss": loss,
        "state_mib": state,
        "step_peak_rss_mib": peak,
        "profile": None,
    }


def test_a_side_takes_the_slowest_rank_per_step_and_sums_cpu_and_loss_shares():
    # wall per step: max(0.2, 0.3) = 0.3, max(0.5, 0.4) = 0.5, max(0.4, 0.1) = 0.4 -> median 0.4, min 0.3
    # cpu per step: 0.3, 0.7, 0.5 -> median 0.5; first loss 1.25 + 1.5 (each rank's share of the mean)
    side = bench.summarize_side(
        [_rank([0.2, 0.5, 0.4], [0.1, 0.3, 0.2], 1.25), _rank([0.3, 0.4, 0.1], [0.2, 0.4, 0.3], 1.5, state=12.0)]
    )
    assert (side["step_s_median"], side["step_s_min"], side["cpu_s_median"]) == (0.4, 0.3, 0.5)
    assert side["first_loss"] == 2.75 and side["state_mib_per_rank"] == 12.0 and side["ranks"] == 2


def test_the_comparison_puts_the_default_case_against_the_target_and_names_the_faster_mode():
    theirs = {"step_s_median": 0.5, "cpu_s_median": 1.0, "first_loss": 2.0}
    ours = {
        "ours": {"step_s_median": 0.55, "cpu_s_median": 0.9, "first_loss": 2.0002},
        "ours_grouped_mm": {"step_s_median": 0.45, "cpu_s_median": 0.8, "first_loss": 2.0},
    }
    out = bench.compare(theirs, ours)
    assert out["ours_over_transformers"] == 1.1 and not out["meets_target"]  # the default (auto) case decides
    assert out["ours_grouped_mm_over_transformers"] == 0.9 and out["ours_over_transformers_cpu"] == 0.9
    assert out["faster_expert_compute"] == "grouped_mm"
    assert out["first_loss_max_relative_difference"] == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    write_checkpoint(directory, bench.TINY, max_shard_bytes=1 << 20)
    return directory


def test_both_sides_start_from_the_same_loss_and_the_profile_finds_their_moe_blocks(tiny):
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.models.build import build_model
    from dynmoe_dist.tasks.base import ModelNeeds
    from dynmoe_dist.train.parts import build_parts

    tokens = bench.global_tokens({"seed": 0, "vocab": bench.TINY.vocab, "batch": 4, "seq_len": 16})
    config = bench.run_config(str(tiny), "auto")
    assert config.moe.router == "native" and config.moe.expert_compute == "auto"
    parts = build_parts(config, build_model(config.model, config.moe, ModelNeeds("causal-lm", bench.TINY.vocab)))
    ours = bench.ours_step(parts, tokens, num_predictions=4 * 15)
    theirs = AutoModelForCausalLM.from_pretrained(str(tiny)).train()
    with torch.no_grad():
        want = float(theirs(input_ids=tokens, labels=tokens).loss)
    assert ours() == pytest.approx(want, rel=1e-5)  # one process holds the whole batch: its share is the mean
    assert [len(m) for m in moe_parts(parts.model).values()] == [2, 2, 2]
    assert [len(m) for m in moe_parts(theirs).values()] == [2, 2, 2]
    profile = profile_steps(ours, parts.model, steps=1, top=5)
    moe = profile["moe_forward_ms"]
    assert moe["routing"] > 0 and moe["experts"] > 0 and moe["block"] >= moe["routing"] + moe["experts"]
    assert all(profile["phase_ms"][phase] > 0 for phase in ("forward", "backward", "optimizer"))
    assert len(profile["top_ops"]) == 5


@pytest.mark.slow  # transformers' process, then two ranks, each importing transformers: ~55 s on 2 busy cores
def test_tiny_run_compares_both_expert_compute_modes_with_transformers(tmp_path, capsys):
    out = tmp_path / "hf_moe.json"
    bench.main(["--tiny", "--steps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert set(result["cases"]) == {"transformers", "ours", "ours_grouped_mm"}
    assert result["cases"]["transformers"]["experts_implementation"] == "grouped_mm"
    assert result["cases"]["ours"]["ranks"] == 2 and result["cases"]["transformers"]["ranks"] == 1
    assert result["first_loss_max_relative_difference"] < 1e-5
    assert result["faster_expert_compute"] in ("auto", "grouped_mm") and isinstance(result["meets_target"], bool)
    for case in result["cases"].values():
        assert case["step_s_median"] > 0 and case["state_mib_per_rank"] > 0

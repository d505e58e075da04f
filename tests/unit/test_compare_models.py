"""The comparison's model list and overrides, and its statistics on hand-worked numbers."""

import math
import sys
from pathlib import Path

import pytest

from dynmoe_dist.experiments import compare, stats
from dynmoe_dist.experiments.models import FOUR_LOSSES, MODELS
from dynmoe_dist.experiments.summary import RunSummary, aggregate, paired_results, paired_table, skip_table


def _config(name, tmp_path, **kw):
    return compare.build_config("synthetic", MODELS[name], 0, 1, tmp_path, **kw)


def test_model_list_covers_the_issue():
    assert [n for n in MODELS if MODELS[n].family != "dynmoe"] == ["dense", "top1", "top2", "top4", "top8", "top-p0.4"]
    assert {
        f"dynmoe-{i}" for i in ("reuse_discarded", "average", "weighted_average", "most_activated", "random")
    } <= set(MODELS)
    assert {
        "dynmoe-losses-four",
        "dynmoe-losses-paper",
        "dynmoe-no-diverse",
        "dynmoe-no-simple",
        "dynmoe-no-load_balance",
        "dynmoe-no-efficiency",
    } <= set(MODELS)


def test_model_overrides_reach_the_config(tmp_path):
    dense = _config("dense", tmp_path)
    assert (dense.model.moe_layers, dense.adaptive.enabled) == ([], False)
    top_p = _config("top-p0.4", tmp_path)
    assert (top_p.moe.router, top_p.moe.top_p, top_p.moe.aux_losses) == ("top_p", 0.4, ("switch", "entropy"))
    assert _config("top8", tmp_path).moe.top_k == 8
    assert _config("dynmoe-losses-paper", tmp_path).moe.aux_losses == ("diverse", "simple")
    no_eff = _config("dynmoe-no-efficiency", tmp_path)
    assert (no_eff.moe.aux_losses, no_eff.adaptive.expert_init) == (
        ("diverse", "simple", "load_balance"),
        "reuse_discarded",
    )
    assert _config("dynmoe-no-diverse", tmp_path).moe.aux_losses == ("simple", "load_balance", "efficiency")
    assert _config("dynmoe-random", tmp_path).moe.aux_losses == ("diverse", "simple")  # the preset's losses
    # --dynmoe-set reaches every DynMoE model, but a loss model's own loss set wins over it
    one = ['moe.aux_losses=["diverse"]']
    assert _config("dynmoe-average", tmp_path, dynmoe_overrides=one).moe.aux_losses == ("diverse",)
    assert _config("dynmoe-no-simple", tmp_path, dynmoe_overrides=one).moe.aux_losses == (
        "diverse",
        "load_balance",
        "efficiency",
    )
    dense = _config("dense", tmp_path, dynmoe_overrides=one)
    assert dense.moe.aux_losses == FOUR_LOSSES and dense.moe.preset == "paper"  # untouched: its pinned preset


def test_default_models_drop_a_duplicate_config(tmp_path):
    # The project preset fills in the values dynmoe-losses-paper names (on preset 'paper'): the same
    # training under two preset names, run once. Under 'paper' it is dynmoe-losses-four's turn.
    kept = compare.without_duplicates(list(MODELS), lambda m: _config(m, tmp_path))
    assert "dynmoe-losses-paper" not in kept and "dynmoe-reuse_discarded" in kept
    assert len(kept) == len(MODELS) - 1
    paper = ["moe.preset='paper'"]
    kept = compare.without_duplicates(list(MODELS), lambda m: _config(m, tmp_path, dynmoe_overrides=paper))
    assert "dynmoe-losses-four" not in kept and "dynmoe-losses-paper" in kept
    assert len(kept) == len(MODELS) - 1
    # the preset's name alone does not make a different run; one value does
    base = _config("dynmoe-losses-paper", tmp_path)
    same = _config("dynmoe-reuse_discarded", tmp_path)
    other = _config("dynmoe-reuse_discarded", tmp_path, dynmoe_overrides=["adaptive.min_unrouted_share=0.01"])
    assert (base.moe.preset, same.moe.preset) == ("paper", "project")
    assert compare.training_key(base) == compare.training_key(same) != compare.training_key(other)


def test_loss_models_pin_the_reference_preset(tmp_path):
    # The loss ablation measures the losses on the reference settings, whatever --dynmoe-set or the
    # project's default preset say.
    config = _config("dynmoe-no-efficiency", tmp_path, dynmoe_overrides=["moe.preset='paper-v1'"])
    assert config.moe.preset == "paper"


def test_minilm_preset_is_the_shortened_quickstart(tmp_path):
    config = compare.build_config(
        "minilm-sentiment", MODELS["top2"], 0, compare.TASK_EPOCHS["minilm-sentiment"], tmp_path
    )
    assert (config.task.max_len, config.model.moe_layers, config.moe.num_experts, config.train.epochs) == (
        48,
        [4, 5],
        8,
        1.0,
    )
    assert config.model.freeze == ["embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert compare.ffn_shape(config) == (384, 1536)  # the pre-trained block, not model.dim / ffn_dim


# ----------------------------------------------------------------------------------------------------
# statistics


def test_paired_test_hand_worked():
    # differences 1, 2, 3: mean 2, sd 1, se 1/sqrt(3); t_{0.975, 2} = 4.3027 -> half width 2.4841;
    # t = 2 / (1/sqrt(3)) = 3.4641 on 2 df -> two-sided p = 0.0742
    result = stats.paired_test([11, 12, 13], [10, 10, 10])
    assert (result.num_pairs, result.mean_diff) == (3, 2.0)
    assert result.ci_low == pytest.approx(2 - 2.48414, abs=1e-4)
    assert result.ci_high == pytest.approx(2 + 2.48414, abs=1e-4)
    assert result.p_value == pytest.approx(0.07418, abs=1e-4)
    assert stats.paired_test([1.0], [0.0]) is None  # one pair has no spread
    same = stats.paired_test([2, 3], [1, 2])  # every seed +1: zero-width interval
    assert (same.ci_low, same.ci_high, same.p_value) == (1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="got 2 and 3"):
        stats.paired_test([1, 2], [1, 2, 3])


def test_t_distribution_without_scipy(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now raises ImportError
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-5)
    assert stats.t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-5)
    assert stats.t_two_sided_p(3.4641016, 2) == pytest.approx(0.0741799, abs=1e-6)
    assert stats.t_two_sided_p(0.0, 4) == pytest.approx(1.0, abs=1e-9)


def test_convergence_epoch():
    assert stats.convergence_epoch([50, 80, 79, 90], 80) == 2  # first epoch at or above the target
    assert stats.convergence_epoch([50, 60], 80) is None


def test_expert_flops_formula():
    # D = 64, F = 128: one expert on one token is 2 matmuls of 64 x 128 = 16384 multiply-adds = 32768 FLOPs
    assert stats.expert_flops_per_token([1.0], 64, 128) == 32768
    assert stats.expert_flops_per_token([2.0, 0.5], 64, 128) == 2.5 * 32768


def _runs(model, finals, **extra):
    return [
        RunSummary(
            model=model,
            seed=s,
            test_accuracy=[50.0, a],
            mean_k=1.0,
            final_k=1.0,
            mean_k_per_layer=[1.0],
            num_experts=[8],
            wall_s=1.0,
            num_steps=1,
            **extra,
        )
        for s, a in enumerate(finals)
    ]


def test_paired_table_against_best_top_k_dense_and_top_p():
    rows = [
        aggregate("top1", "MoE k=1", _runs("top1", [90, 90, 90]), "top_k"),
        aggregate("top2", "MoE k=2", _runs("top2", [91, 92, 93]), "top_k"),  # best top-k: 92 at the end
        aggregate("dense", "dense", _runs("dense", [88, 88, 88]), "dense"),
        aggregate(
            "dynmoe-average",
            "DynMoE (average)",
            _runs("dynmoe-average", [92, 94, 96], skip_accuracy=93.0, skip_share_per_layer=[0.25, 0.5]),
            "dynmoe",
        ),
    ]
    table = paired_table(rows).splitlines()
    assert table[0] == "| model | vs MoE k=2 | vs dense |"  # no top-p row: no column
    assert table[2].startswith("| DynMoE (average) | +2.00 [-0.48, +4.48], p = 0.074 | +6.00 [")
    assert paired_results(rows)["dynmoe-average"]["top2"]["mean_diff"] == 2.0
    assert skip_table(rows).splitlines()[2] == "| DynMoE (average) | 94.00 | 93.00 | -1.00 | 25.0 / 50.0 |"
    assert math.isnan(rows[0].skip_accuracy)


def test_attach_cost_dense_and_moe():
    dense = compare.attach_cost(aggregate("dense", "d", _runs("dense", [1, 2])), "dense", (64, 128), 2)
    assert dense.flops_train == dense.flops_eval == 2 * 32768  # one FFN at each of the 2 MoE positions
    runs = _runs("dyn", [1, 2])
    for r in runs:
        r.mean_k_per_layer, r.eval_k = [0.5, 1.5], 1.25
    dyn = compare.attach_cost(aggregate("dyn", "d", runs), "dynmoe", (64, 128), 2)
    assert (dyn.flops_train, dyn.flops_eval) == (2.0 * 32768, 2.5 * 32768)


def test_epochs_and_seeds_default_per_task(tmp_path):
    from tests.unit.test_experiments import compare_args

    plan = compare.make_plan(
        compare_args(
            ["--task", "synthetic", "--models", "top2", "--out", str(tmp_path), "--set", "task.num_samples=160"]
        )
    )
    assert (plan.epochs, plan.seeds) == (compare.TASK_EPOCHS["synthetic"], [0, 1, 2, 3, 4])
    assert Path(plan.config("top2", 4).output.out_dir).name == "seed4"


def test_plot_styles_keep_ten_dynmoe_models_apart():
    from dynmoe_dist.experiments.plots import _styles

    dyn = [aggregate(f"dynmoe-{i}", str(i), _runs("d", [1]), "dynmoe") for i in range(10)]
    rows = [
        aggregate("dense", "dense", _runs("dense", [1]), "dense"),
        aggregate("top2", "k", _runs("t", [1]), "top_k"),
        aggregate("top-p0.4", "p", _runs("p", [1]), "top_p"),
        *dyn,
    ]
    styles = _styles(rows)
    assert len({tuple(styles[r.model]["color"]) for r in dyn}) == 10
    assert (styles["dense"]["linestyle"], styles["top-p0.4"]["linestyle"], styles["top2"]["linestyle"]) == (
        ":",
        "-.",
        "--",
    )


def test_model_line_describes_the_models_of_both_tasks(tmp_path):
    vit = compare.build_config("vit-mnist", MODELS["top1"], 0, 1, tmp_path)
    assert compare.model_line(vit).startswith(
        "- model: dim 64, 4 blocks, 4 heads, FFN/expert dim 128, MoE in blocks [1, 3]"
    )
    minilm = compare.build_config("minilm-sentiment", MODELS["top1"], 0, 1, tmp_path)
    line = compare.model_line(minilm)
    assert "all-MiniLM-L6-v2 (dim 384, FFN/expert dim 1536), first 6 layers" in line and "layers.3" in line

"""moe-finetune's numbers on hand-made records: expert FLOPs, one run's summary, the spread over seeds, the
goal check, the combine choice and the markdown; and the one-line refusal of a --model that is no MoE."""

import math

import pytest

from dynmoe_dist.experiments import moe_finetune
from dynmoe_dist.experiments.moe_markdown import finetune_table, goal_lines, layer_table, paired_table, step0_table
from dynmoe_dist.experiments.moe_report import (
    FinetuneResult,
    Spread,
    aggregate_variant,
    expert_flops,
    flops_ratio,
    goal_check,
    removed_share,
    summarise_finetune,
)


def test_expert_flops_hand_worked():
    # two layers at k 1.5 and 2.5, D 4, F 3, gated experts (3 matmuls of D x F = 36 multiply-adds, 72 FLOPs):
    # (1.5 + 2.5) x 72 = 288
    assert expert_flops([1.5, 2.5], 4, 3) == 288
    assert expert_flops([1.5, 2.5], 4, 3, matmuls=2) == 192  # a plain FFN expert: 2 matmuls
    # against native top-2 on both layers: (1.5 + 2.5) / (2 + 2)
    assert flops_ratio([1.5, 2.5], 2) == 1.0
    assert flops_ratio([1.0, 0.7], 2) == pytest.approx(0.425)


def result(seed=0, loss=3.0, eval_k=(2.0, 2.0), start=(16, 16), end=(16, 16), variant="v", **extra):
    fields = dict(
        variant=variant,
        seed=seed,
        test_loss=loss,
        step0_loss=4.0,
        train_k=list(eval_k),
        end_k=list(eval_k),
        eval_k=list(eval_k),
        experts_start=list(start),
        experts_end=list(end),
        removed=[s - e for s, e in zip(start, end)],
        added=[0, 0],
        steps=10,
        wall_s=1.0,
    )
    return FinetuneResult(**{**fields, **extra})


def test_removed_experts_cost_nothing_less_when_k_stays():
    # layer 0 lost 6 of 16 experts, but its tokens still go to 2 each: the same FLOPs as native top-2
    pruned = result(end=(10, 16))
    assert flops_ratio(pruned.eval_k, 2) == 1.0
    assert removed_share(pruned) == pytest.approx(1 - 26 / 32)
    # experts added by the add rule count against the removed ones
    assert removed_share(result(end=(18, 16))) == pytest.approx(-2 / 32)


def _step(step, mean_k, experts):
    return {"kind": "step", "step": step, "epoch": step / 10, "mean_k": mean_k, "num_experts": experts}


def test_summarise_finetune_reads_k_experts_and_events():
    records = [_step(s, [2.0 + s, 1.0], [4, 4]) for s in range(1, 10)]
    records += [
        _step(10, [3.0, 9.0], [4, 4]),  # superseded by the resumed attempt's step 10, and so is its event
        {"kind": "event", "step": 10, "layer": 0, "removed": [0, 1, 2], "added": []},
        _step(10, [3.0, 1.0], [4, 4]),
        {"kind": "event", "step": 10, "layer": 0, "removed": [1, 2], "added": [{"expert": 2}]},
        {"kind": "event", "step": 10, "layer": 1, "removed": [0], "added": []},
        {"kind": "final", "step": 10, "epoch": 1.0, "test_loss": 2.5, "num_experts": [3, 3], "wall_s": 7.0},
    ]
    out = summarise_finetune("top-any-pruned", 4, records, [1.5, 1.0], step0_loss=5.0)
    # layer 0's training k: steps 1..9 at 3..11, step 10 at 3: (63 + 3) / 10
    assert out.train_k == pytest.approx([6.6, 1.0])
    assert out.end_k == pytest.approx([3.0, 1.0])  # the last tenth of 10 steps: step 10
    assert (out.experts_start, out.experts_end) == ([4, 4], [3, 3])  # the final record's count
    assert (out.removed, out.added) == ([2, 1], [1, 0])
    assert (out.test_loss, out.step0_loss, out.eval_k, out.steps, out.wall_s) == (2.5, 5.0, [1.5, 1.0], 10, 7.0)
    with pytest.raises(ValueError, match="0 final records"):
        summarise_finetune("native", 0, records[:3], [2.0, 2.0], 5.0)


def test_spread_mean_std_and_t_interval():
    s = Spread.of([1.0, 2.0, 3.0])
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) x std 1 / sqrt(3)
    assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)
    assert (s.ci_low, s.ci_high) == pytest.approx((2 - half, 2 + half))
    assert s.cell() == "2.000 ± 1.000" and s.interval(2) == "[-0.48, 4.48]"
    one = Spread.of([5.0, math.nan])
    assert (one.mean, one.std, one.cell(1), one.interval()) == (5.0, 0.0, "5.0", "-")
    assert Spread.of([]).cell() == "-"


def rows(pruned_losses, pruned_k, pruned_end):
    native = [result(s, loss, variant="native") for s, loss in enumerate((3.0, 3.2, 3.4))]
    pruned = [
        result(s, loss, eval_k=pruned_k, end=pruned_end, variant="top-any-pruned")
        for s, loss in enumerate(pruned_losses)
    ]
    return [
        aggregate_variant("native", "native top-k", native, 4, 3, 2),
        aggregate_variant("top-any-pruned", "top-any + pruning", pruned, 4, 3, 2),
    ]


def test_goal_met_and_missed_part_by_part():
    native, pruned = rows((3.1, 3.3, 3.6), (1.6, 1.6), (12, 12))
    goal = goal_check(native, pruned)
    # loss +0.133 against native's std 0.2; FLOPs 1.6 / 2 = 80 %; 8 of 32 experts gone = 25 %
    assert goal["loss_diff"] == pytest.approx(0.4 / 3)
    assert goal["flops_ratio"] == pytest.approx(0.8) and goal["removed_share"] == pytest.approx(0.25)
    assert goal["met"]
    native, pruned = rows((3.4, 3.6, 3.8), (1.8, 1.8), (14, 14))
    goal = goal_check(native, pruned)
    assert not goal["loss_within_native_spread"]  # +0.4 > 0.2
    assert not goal["flops_at_most_85_percent"]  # 90 %
    assert not goal["at_least_20_percent_removed"]  # 12.5 %
    assert not goal["met"]
    assert goal_lines(goal)[-1] == "- **goal not met**"


def test_tables_have_every_column():
    native, pruned = rows((3.1, 3.3, 3.6), (1.6, 1.6), (12, 12))
    table = finetune_table([native, pruned]).splitlines()
    assert table[0].count("|") == 12 and "| expert MFLOP/token | vs native |" in table[0]
    assert table[1] == "|---" * 11 + "|"
    # native: loss 3.2 ± 0.2, k 2 everywhere, 16/16 experts, 2 x 2 layers x 72 FLOPs = 288 = 0.00 MFLOP
    assert table[2].startswith("| native top-k | 3.200 ± 0.200 | [2.703, 3.697] | 4.000 ± 0.000 | 2.00 / 2.00 / 2.00")
    assert "| 16/16 | 0.0 / 0.0 |" in table[2] and table[2].endswith("| 1.00 ± 0.00 | - | - |")
    assert "| 12/12 | 8.0 / 0.0 |" in table[3] and "| 0.80 ± 0.00 |" in table[3]
    paired = paired_table([native, pruned]).splitlines()
    # pruned - native per seed: +0.1, +0.1, +0.2 -> mean +0.1333
    assert paired[2].startswith("| top-any-pruned - native | +0.1333 |")


def test_step0_table_and_combine_choice():
    step0 = {
        seed: {
            "native": {"test_loss": 3.0, "eval_k": [2.0, 2.0]},
            "top-any-equal": {"test_loss": 3.5 + seed, "eval_k": [2.0, 3.0]},
            "top-any-softmax": {"test_loss": 3.2 + 2 * seed, "eval_k": [2.0, 3.0]},
        }
        for seed in (0, 1)
    }
    # means: equal 4.0, softmax 4.2 -> equal
    assert moe_finetune.choose_combine(step0) == "equal"
    step0[1]["top-any-softmax"]["test_loss"] = 3.3
    assert moe_finetune.choose_combine(step0) == "softmax"  # 3.25 < 4.0
    lines = step0_table(step0, "softmax").splitlines()
    assert lines[2] == "| native top-k | 3.000 ± 0.000 | 2.00 ± 0.00 |"
    assert lines[3].startswith("| top-any, combine 'equal' (1/k) | 4.000 ± 0.707 | 2.50")
    assert lines[4].startswith("| top-any, combine 'softmax' (router probabilities) (chosen) | 3.250 ± 0.071")


def test_a_model_that_is_no_moe_is_one_line(tmp_path, capsys):
    from hf_tiny import save_tiny_with_tokenizer

    dense = save_tiny_with_tokenizer("llama", tmp_path / "llama")
    capsys.readouterr()  # save_pretrained's progress bar
    for model, message in (
        (dense, r"--model \('.*llama'\) is a 'llama' model with no experts: expected an MoE checkpoint"),
        (tmp_path / "nothing", r"--model \('.*nothing'\) has no config.json"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            moe_finetune.main(["--model", str(model), "--out", str(tmp_path / "out")], prog="moe-finetune")
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert err.startswith("moe-finetune: error: ")
        assert __import__("re").search(message, err)
    with pytest.raises(SystemExit):
        moe_finetune.main(["--model", str(dense), "--seeds", "0"], prog="moe-finetune")
    assert "--seeds (0) must be >= 1" in capsys.readouterr().err


def test_layer_table_says_where_k_and_experts_went():
    native, pruned = rows((3.1, 3.3, 3.6), (1.6, 1.2), (12, 14))
    step0 = {
        seed: {"native": {"eval_k": [2.0, 2.0]}, "top-any-softmax": {"eval_k": [2.0 + seed, 1.0]}} for seed in range(3)
    }
    lines = layer_table([native, pruned], step0, "softmax").splitlines()
    assert lines[2] == "| native top-k | 0 | 2.00 | 2.00 | 16 -> 16.0 | 0.0 | 0.0 |"
    # layer 0: step-0 k over seeds (2 + 3 + 4) / 3, at the end 1.6, 16 -> 12 by 4 removals
    assert lines[4] == "| top-any + pruning | 0 | 3.00 | 1.60 | 16 -> 12.0 | 4.0 | 0.0 |"
    assert lines[5] == "| top-any + pruning | 1 | 1.00 | 1.20 | 16 -> 14.0 | 2.0 | 0.0 |"

"""moe-frontier: the verdict rule on hand-made points, and the command end to end on a tiny random Qwen3-MoE (one
process, --tiny: seconds)."""

import json
import math
import re

import pytest

from dynmoe_dist.experiments import frontier_report, moe_frontier
from dynmoe_dist.experiments.frontier_report import Point, best_baselines, judge, verdicts


def point(name, family, flops, loss, loss_std=0.01):
    return Point(name, name, family, flops, 0.0, loss, loss_std)


def test_the_baselines_best_points_are_those_no_other_beats_on_both_axes():
    found = [
        point("k1", "native", 0.5, 5.0),
        point("k2", "native", 1.0, 4.8),
        point("p-low", "top_p", 0.8, 4.85),  # beaten by nothing: cheaper than k2, better than k1
        point("p-bad", "top_p", 1.2, 4.9),  # k2 is cheaper and better
        point("k3", "native", 1.5, 4.81),  # more FLOPs for more loss than k2: beaten
        point("any", "top_any", 0.7, 4.0),  # not a baseline: never on the line
    ]
    assert [p.name for p in best_baselines(found)] == ["k1", "p-low", "k2"]
    # beaten by no single baseline, but above the segment p-low - k2 (4.825 at 0.9): mixing those two beats it
    above = [*found, point("p-mid", "top_p", 0.9, 4.83)]
    assert [p.name for p in best_baselines(above)] == ["k1", "p-low", "k2"]
    assert [p.name for p in best_baselines([*found[:2], found[3], point("p-hi", "top_p", 0.9, 4.95)])] == ["k1", "k2"]


def test_top_any_pays_only_below_the_line_by_more_than_the_spread():
    best = [point("k1", "native", 0.5, 5.0, 0.01), point("k2", "native", 1.0, 4.8, 0.03)]
    # at 0.75 the line reads 4.9 with std 0.02 (both interpolated half way)
    clear = judge(point("any", "top_any", 0.75, 4.85, 0.005), best)
    assert (clear.left, clear.right) == ("k1", "k2")
    assert clear.line_loss == pytest.approx(4.9) and clear.line_std == pytest.approx(0.02)
    assert clear.gap == pytest.approx(0.05) and clear.pays is True
    within = judge(point("any", "top_any", 0.75, 4.88, 0.005), best)  # 0.02 below: inside 0.005 + 0.02
    assert within.pays is False and within.gap == pytest.approx(0.02)
    above = judge(point("any", "top_any", 0.75, 4.95, 0.0), best)
    assert above.pays is False and above.gap < 0
    on_a_point = judge(point("any", "top_any", 1.0, 4.7, 0.0), best)  # exactly at k2's FLOPs
    assert on_a_point.line_loss == pytest.approx(4.8) and on_a_point.pays is True


def test_a_budget_outside_the_baselines_range_is_not_judged():
    found = [point("k1", "native", 0.5, 5.0), point("k2", "native", 1.0, 4.8), point("any", "top_any", 0.4, 4.0)]
    (verdict,) = verdicts(found)
    assert verdict.pays is None and verdict.left is None and verdict.right == "k1"
    assert math.isnan(verdict.line_loss)
    assert "outside the baselines" in frontier_report.verdict_table([verdict])


def test_top_any_that_trains_every_token_through_an_expert_is_judged_too_and_configured_so():
    found = [point("k1", "native", 0.5, 5.0), point("k2", "native", 1.0, 4.8)]
    found += [point("any", "top_any", 0.7, 4.95), point("floor", "top_any_top1", 0.75, 4.85, 0.005)]
    assert [(v.name, v.pays) for v in verdicts(found)] == [("any", False), ("floor", True)]
    by_name = {v.name: v for v in moe_frontier.variants()}
    floor = by_name["top-any-top1-1.25"]
    assert floor.family == "top_any_top1" and floor.router == "top_any" and floor.adaptive
    assert {"moe.target_k=1.25", "moe.train_k0='top1'", "adaptive.max_adds_per_event=0"} <= set(floor.overrides)
    assert "moe.train_k0='top1'" not in by_name["top-any-1.25"].overrides


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dynmoe_dist.experiments import pretrain_moe

    root = tmp_path_factory.mktemp("frontier")
    roots = [pretrain_moe.default_roots()[0] / part for part in pretrain_moe.TINY.stdlib_parts]
    pretrain_moe.build_corpus(root / "corpus.jsonl", 30_000, roots)
    pretrain_moe.write_init(pretrain_moe.TINY, root / "corpus.jsonl", root / "model", seed=0)
    only = ["native-k1", "native-k2", "top-p-0.3", "top-any-1.5", "top-k2-aux", "top-k2-bias"]
    argv = ["--model", str(root / "model"), "--tiny", "--world-size", "1", "--seeds", "2", "--out", str(root / "out")]
    argv += ["--only", *only]
    moe_frontier.main(argv)
    return root, argv


def test_tiny_frontier_runs_every_router_at_its_budget(tiny):
    root, _ = tiny
    report = json.loads((root / "out" / "frontier.json").read_text())
    by_name = {v["variant"]: v for v in report["variants"]}
    assert set(by_name) == {"native-k1", "native-k2", "top-p-0.3", "top-any-1.5", "top-k2-aux", "top-k2-bias"}
    assert by_name["native-k1"]["eval_k"]["mean"] == pytest.approx(1.0)
    assert by_name["native-k1"]["flops_ratio"]["mean"] == pytest.approx(0.5)  # relative to the model's top-2
    assert by_name["native-k2"]["eval_k"]["mean"] == pytest.approx(2.0)
    for variant in by_name.values():
        assert len(variant["runs"]) == 2 and math.isfinite(variant["test_loss"]["mean"])
        assert 0 < variant["load_cv"]["mean"] < 5
    top_any = by_name["top-any-1.5"]["runs"]
    assert all(sum(run["added"]) == 0 for run in top_any)  # pruning only
    # the budget controller holds training k near the target (the tiny run is short: a loose bound)
    assert 1.2 < sum(top_any[0]["train_k"]) / len(top_any[0]["train_k"]) < 1.8
    # native top-1 ran the model's own rule from a view of the checkpoint with num_experts_per_tok = 1
    view = root / "out" / "models" / "k1"
    assert json.loads((view / "config.json").read_text())["num_experts_per_tok"] == 1
    assert (view / "model.safetensors").is_symlink()
    assert [v["name"] for v in report["verdicts"]] == ["top-any-1.5"]


def test_tiny_frontier_writes_its_tables_and_figure(tiny):
    root, _ = tiny
    md = (root / "out" / "frontier.md").read_text()
    for text in (
        "| variant | family | eval k | expert FLOPs vs top-2 | held-out loss | 95 % CI |",
        "| native top-1 | native | 1.00 ± 0.00 | 0.500 ± 0.000 |",
        "## Does top-any pay?",
        "| top-any-1.5 | ",
        "## Balance without an aux loss",
        "| top-k 2 + bias balance (no aux loss) | ",
        "Held-out loss, bias - aux, paired by seed: ",
    ):
        assert text in md
    assert (root / "out" / "frontier.png").stat().st_size > 10_000


def test_a_second_call_reuses_every_finished_run(tiny, capsys):
    _, argv = tiny
    moe_frontier.main(argv)
    err = capsys.readouterr().err
    assert err.count("reusing the finished run") == 12 and "held-out loss" not in err
    moe_frontier.main(argv + ["--seed-list", "1"])  # one seed of the same runs
    err = capsys.readouterr().err
    assert err.count("reusing the finished run") == 6 and "seed 1: reusing" in err and "seed 0" not in err


def test_bad_input_is_one_line(tiny, capsys):
    root, _ = tiny
    for argv, message in (
        (["--only", "top-k9"], r"--only \(top-k9\) names no variant; choose from native-k1, "),
        (["--seeds", "0"], r"--seeds \(0\) must be >= 1"),
        (["--seed-list", "1,x"], r"--seed-list \('1,x'\) must be seeds separated by commas"),
        (["--seed-list", "1,1"], r"--seed-list \('1,1'\) must be distinct seeds >= 0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            moe_frontier.main(["--model", str(root / "model"), "--out", str(root / "bad"), *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err)


def test_tiny_lora_shares_the_full_finetune_and_trains_adapters_only(tiny, capsys):
    from dynmoe_dist.experiments import moe_lora

    root, _ = tiny
    argv = ["--model", str(root / "model"), "--tiny", "--world-size", "1", "--seeds", "2", "--out", str(root / "out")]
    moe_lora.main(argv + ["--only", "native-k2", "native-k2-lora-r8"])
    err = capsys.readouterr().err
    assert err.count("native-k2 seed") == 2 and err.count("reusing the finished run") == 2  # the frontier's
    report = json.loads((root / "out" / "lora.json").read_text())
    full, lora = report["variants"]
    assert (full["variant"], lora["variant"]) == ("native-k2", "native-k2-lora-r8")
    for run in full["runs"]:  # the frontier's runs, reused
        saved = json.loads((root / "out" / "runs" / "native-k2" / f"seed{run['seed']}" / "result.json").read_text())
        assert run["test_loss"] == saved["test_loss"]
    assert lora["test_loss"]["mean"] != full["test_loss"]["mean"]
    for run in lora["runs"]:
        assert run["peak_mib"] > 0 and math.isfinite(run["test_loss"])
    config = (root / "out" / "runs" / "native-k2-lora-r8" / "seed0" / "config.toml").read_text()
    assert "rank = 8" in config and "alpha = 16.0" in config and "lr = 0.002" in config
    md = (root / "out" / "lora.md").read_text()
    assert "| native: LoRA r 8 | " in md and "| native: full finetune | " in md


def test_a_run_saved_before_an_option_existed_is_still_found_finished(tiny):
    """config.toml of an older version lacks the lines of options added since (at their defaults)."""
    from dynmoe_dist.experiments.moe_finetune import finished

    root, argv = tiny
    plan, chosen = moe_frontier.make_plan(
        moe_frontier.parser("moe-frontier", "").parse_args(argv), moe_frontier.variants()
    )
    config = moe_frontier.run_config(plan, next(v for v in chosen if v.name == "native-k2"), 0)
    saved = root / "out" / "runs" / "native-k2" / "seed0" / "config.toml"
    text = saved.read_text()
    assert finished(config) and "added_experts = " in text
    try:
        saved.write_text("".join(line for line in text.splitlines(True) if not line.startswith("added_experts")))
        assert finished(config)
        saved.write_text(text.replace("max_len = 16", "max_len = 17"))  # another config: not this run
        assert "max_len = 16" in text
        assert not finished(config)
    finally:
        saved.write_text(text)

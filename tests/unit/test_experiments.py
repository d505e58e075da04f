"""The paper comparison: table and plot builders on hand-made metrics, the routing probe on hand-made
routings, and one tiny end-to-end `compare` on the synthetic task."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dynmoe_dist.experiments import __main__ as experiments_main
from dynmoe_dist.experiments import compare
from dynmoe_dist.experiments.plots import draw_comparison
from dynmoe_dist.experiments.probe import FIELDS, RoutingProbe, _LayerHook, add_totals, routing_summary
from dynmoe_dist.experiments.summary import (
    RunSummary,
    accuracy_by_epoch,
    aggregate,
    markdown_table,
    summarise_run,
    table_epochs,
)
from dynmoe_dist.moe.routing import Routing
from dynmoe_dist.train.telemetry import read_metrics


def _step(step, mean_k):
    return {"kind": "step", "step": step, "epoch": step / 2, "mean_k": mean_k, "num_experts": [8, 8]}


# Two epochs of two steps. A crashed attempt logged step 3 with k 9 before the resumed run redid it:
# that record is superseded and must not count.
RECORDS = [
    _step(1, [1, 3]),
    {"kind": "eval", "step": 1, "epoch": 0.5, "test_accuracy": 0.1},  # mid-epoch: not a table column
    _step(2, [2, 2]),
    {"kind": "eval", "step": 2, "epoch": 1.0, "test_accuracy": 0.5},
    _step(3, [9, 9]),
    _step(3, [3, 3]),
    _step(4, [4, 4]),
    {"kind": "final", "step": 4, "epoch": 2.0, "test_accuracy": 0.75, "num_experts": [8, 9], "wall_s": 12.0},
]


def test_accuracy_by_epoch_takes_epoch_ends_from_eval_and_final_records():
    assert accuracy_by_epoch(RECORDS) == [50.0, 75.0]


def test_accuracy_by_epoch_names_a_missing_epoch():
    records = [r for r in RECORDS if not (r["kind"] == "eval" and r["step"] == 2)]
    with pytest.raises(ValueError, match=r"epoch\(s\) \[1\]"):
        accuracy_by_epoch(records)


def test_summarise_run():
    summary = summarise_run("top2", 3, RECORDS, {"eval_k": 1.5, "train_k0_share": 0.25})
    assert summary.test_accuracy == [50.0, 75.0]
    assert summary.mean_k == pytest.approx((2 + 2 + 3 + 4) / 4)  # per-step mean over the 2 layers
    assert summary.final_k == pytest.approx((3 + 4) / 2)  # steps 3 and 4: the last epoch
    assert summary.mean_k_per_layer == pytest.approx([2.5, 3.0])
    assert (summary.num_experts, summary.wall_s, summary.eval_k, summary.train_k0_share) == ([8, 9], 12.0, 1.5, 0.25)
    assert math.isnan(summary.last_epoch_k0_share)


def test_summarise_run_needs_a_final_record():
    with pytest.raises(ValueError, match="0 final"):
        summarise_run("top2", 0, RECORDS[:-1])


def _run(seed, accuracy, mean_k, experts, model="top2"):
    return RunSummary(
        model=model,
        seed=seed,
        test_accuracy=accuracy,
        mean_k=mean_k,
        final_k=mean_k,
        mean_k_per_layer=[mean_k],
        num_experts=experts,
        wall_s=10.0 + seed,
        eval_k=mean_k,
        last_epoch_k0_share=0.1 * seed,
        num_steps=20,
    )


def test_aggregate_mean_and_sample_std_over_seeds():
    row = aggregate("dynmoe-average", "DynMoE (average)", [_run(0, [50, 70], 2, [8, 9]), _run(1, [60, 90], 4, [8, 10])])
    assert row.accuracy_mean == [55.0, 80.0]
    assert row.accuracy_std == pytest.approx([10 / math.sqrt(2), 20 / math.sqrt(2)])  # ddof 1
    assert (row.mean_k, row.mean_k_std) == (3.0, pytest.approx(math.sqrt(2)))
    assert (row.num_experts, row.wall_s, row.last_epoch_k0_share) == ([8.0, 9.5], 10.5, pytest.approx(0.05))
    assert row.ms_per_step == pytest.approx(1000 * (10 / 20 + 11 / 20) / 2)  # 525 ms
    table = markdown_table([row])
    assert (
        "| DynMoE (average) | **55.00 ± 7.07** | **80.00 ± 14.14** | 3.00 ± 1.41 | 3.00 | 3.00 | 5.0 | 8/9.5 "
        "| - | - | 525 |" in table
    )  # no top-k row: nothing to reach


def test_aggregate_rejects_seeds_with_different_epochs():
    with pytest.raises(ValueError, match=r"number of epochs \(\[1, 2\]\)"):
        aggregate("top2", "MoE k=2", [_run(0, [50], 2, [8]), _run(1, [50, 60], 2, [8])])


def test_markdown_table_one_seed_bolds_the_best_of_each_column():
    rows = [
        aggregate("top2", "MoE k=2", [_run(0, [55.0, 80.0], 2, [8, 8])], "top_k"),
        aggregate("dynmoe-average", "DynMoE (average)", [_run(0, [50.0, 81.0], 1.25, [9, 6])], "dynmoe"),
    ]
    rows[1].flops_train, rows[1].flops_eval = 5000.0, 12000.0
    assert markdown_table(rows).splitlines() == [
        "| model | 1 | 2 | mean k | final k | eval k | k=0 % | experts | kFLOP/token train / eval "
        "| reaches best top-k | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| MoE k=2 | **55.00** | 80.00 | 2.00 | 2.00 | 2.00 | 0.0 | 8/8 | - | 2 | 500 |",
        "| DynMoE (average) | 50.00 | **81.00** | 1.25 | 1.25 | 1.25 | 0.0 | 9/6 | 5 / 12 | 2 | 500 |",
    ]
    with pytest.raises(ValueError, match=r"\[3\] outside \[1, 2\]"):
        markdown_table(rows, epochs=[1, 3])


def test_table_epochs():
    assert table_epochs(5) == [1, 2, 3, 4, 5]
    assert table_epochs(200, max_columns=5) == [40, 80, 120, 160, 200]  # the paper's spacing
    assert table_epochs(12) == [1, 2, 4, 5, 6, 7, 8, 10, 11, 12]  # round(1.2 * i), i = 1..10


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_draw_comparison_writes_a_png(tmp_path, num_seeds):
    rows = [
        aggregate("top2", "MoE k=2", [_run(s, [55.0, 80.0 + s], 2, [8, 8]) for s in range(num_seeds)]),
        aggregate(
            "dynmoe-average",
            "DynMoE (average)",
            [_run(s, [50.0, 81.0], 1.5, [9, 6], "dynmoe-average") for s in range(num_seeds)],
        ),
    ]
    out = draw_comparison(rows, tmp_path / "sub" / "comparison.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# ----------------------------------------------------------------------------------------------------
# Routing probe


def _routing(gates, num_selected):
    gates = torch.tensor(gates, dtype=torch.float32)
    return Routing(gates > 0, gates, torch.tensor(num_selected), gates)


def test_routing_probe_counts_k0_and_restarts_recent_counts_at_mode_changes():
    probe = RoutingProbe(num_layers=1)
    hook = _LayerHook(probe, 0)
    train, evaluate = SimpleNamespace(training=True), SimpleNamespace(training=False)
    one_empty = _routing([[1, 0, 0], [0, 0, 0], [1, 1, 0]], [1, 0, 2])  # token 1 selected nothing
    hook(train, None, one_empty)  # epoch 1: 3 tokens, 1 with k = 0
    hook(evaluate, None, _routing([[1, 1, 1]] * 3, [3, 3, 3]))  # superseded by the next evaluation
    hook(train, None, _routing([[1, 1, 0]] * 3, [2, 2, 2]))  # epoch 2: recent counts restart
    fallback = _routing([[1, 0, 0], [0, 0, 0], [1, 1, 0]], [1, 1, 2])  # eval: token 1 fell back to top-1
    hook(evaluate, None, fallback)
    hook(evaluate, None, fallback)  # consecutive eval batches add up
    totals = probe.totals()
    assert totals["train_tokens"] == [6.0] and totals["train_k0"] == [1.0]
    assert totals["recent_train_tokens"] == [3.0] and totals["recent_train_k0"] == [0.0]
    assert (totals["eval_tokens"], totals["eval_k_sum"], totals["eval_fallback"]) == ([6.0], [8.0], [2.0])
    shares = routing_summary(add_totals([totals, totals]))  # two identical ranks: same shares
    assert shares == pytest.approx(
        {"train_k0_share": 1 / 6, "last_epoch_k0_share": 0.0, "eval_k": 8 / 6, "eval_fallback_share": 2 / 6}
    )


# ----------------------------------------------------------------------------------------------------
# compare: options and one tiny end-to-end run


def test_option_errors_name_the_value():
    with pytest.raises(ValueError, match="unknown model.*'top3'"):
        compare.parse_models("top2,top3")
    assert compare.parse_models("default") == compare.DEFAULT_MODELS == list(compare.MODELS)
    with pytest.raises(ValueError, match=r"--seeds \('0,0'\)"):
        compare.parse_seeds("0,0")
    with pytest.raises(ValueError, match="moe.router is set by compare"):
        compare.check_overrides(["train.lr=0.1", "moe.router='top_p'"])
    with pytest.raises(ValueError, match=r"--task \('cifar'\)"):
        compare.build_config("cifar", compare.MODELS["top2"], 0, 1, Path("x"))


def test_build_config_gives_every_model_the_same_budget(tmp_path):
    top4 = compare.build_config("vit-mnist", compare.MODELS["top4"], 7, 3, tmp_path, ["train.lr=0.01"], eval_every=62)
    dyn = compare.build_config(
        "vit-mnist", compare.MODELS["dynmoe-most_activated"], 7, 3, tmp_path, ["train.lr=0.01"], eval_every=62
    )
    assert (top4.moe.router, top4.moe.top_k, top4.adaptive.enabled) == ("top_k", 4, False)
    assert (dyn.moe.router, dyn.adaptive.enabled, dyn.adaptive.expert_init) == ("top_any", True, "most_activated")
    for section in ("task", "model", "train"):
        assert top4.to_dict()[section] == dyn.to_dict()[section]
    assert (top4.train.lr, top4.train.seed, top4.train.epochs, top4.train.eval_every) == (0.01, 7, 3.0, 62)
    assert (top4.model.moe_layers, top4.moe.num_experts, top4.model.patch_size) == ([1, 3], 8, 7)
    assert top4.output.out_dir == (tmp_path / "runs" / "top4" / "seed7").as_posix()


def test_dynmoe_set_reaches_only_dynmoe_runs(tmp_path):
    paper_losses = ['moe.aux_losses=["diverse", "simple"]']
    top2, dyn = (
        compare.build_config("synthetic", compare.MODELS[name], 0, 1, tmp_path, dynmoe_overrides=paper_losses)
        for name in ("top2", "dynmoe-average")
    )
    assert (top2.moe.aux_losses, dyn.moe.aux_losses) == (("switch",), ("diverse", "simple"))
    with pytest.raises(ValueError, match="adaptive.expert_init is set by compare"):
        compare.build_config(
            "synthetic", compare.MODELS["top2"], 0, 1, tmp_path, dynmoe_overrides=["adaptive.expert_init='random'"]
        )


TINY = [
    "--task",
    "synthetic",
    "--epochs",
    "1",
    "--models",
    "top2,dense,dynmoe-average",
    "--seeds",
    "0,1",
    "--set",
    "task.num_samples=160",
    "--set",
    "model.dim=16",
    "--set",
    "model.ffn_dim=16",
    "--set",
    "train.global_batch_size=16",
]


def test_compare_end_to_end_on_the_synthetic_task(tmp_path, capsys):
    result = compare.main(TINY + ["--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert [m["model"] for m in results["models"]] == ["top2", "dense", "dynmoe-average"]
    assert results["settings"]["steps_per_epoch"] == 8  # 128 train samples / batch 16
    for model in results["models"]:
        for seed in (0, 1):
            records = read_metrics(tmp_path / "runs" / model["model"] / f"seed{seed}" / "metrics.jsonl")
            ends = [100 * r["test_accuracy"] for r in records if r["kind"] in ("eval", "final")]
            assert model["runs"][seed]["test_accuracy"] == pytest.approx(ends) and len(ends) == 1
    top2, dense, dyn = results["models"]
    assert (top2["mean_k"], top2["eval_k"], top2["last_epoch_k0_share"]) == (2.0, 2.0, 0.0)
    assert top2["flops_train"] == top2["flops_eval"] == 2 * 2 * 4 * 16 * 16  # 2 layers at k = 2, D = F = 16
    assert dense["flops_eval"] == 2 * 4 * 16 * 16 and dense["runs"][0]["num_experts"] == []
    assert math.isnan(dense["mean_k"]) and math.isnan(top2["skip_accuracy"])
    assert 'router = "top_any"' in (tmp_path / "runs" / "dynmoe-average" / "seed0" / "config.toml").read_text()
    assert dyn["eval_k"] >= 1.0  # the top-1 fallback: no token computes nothing at evaluation
    assert 0 <= dyn["skip_accuracy"] <= 100 and len(dyn["skip_share_per_layer"]) == 2
    assert dyn["ms_per_step"] > 0 and set(results["paired"]["dynmoe-average"]) == {"top2", "dense"}
    markdown = (tmp_path / "results.md").read_text()
    for text in (
        "| MoE k=2 |",
        "| dense (no MoE) |",
        "| DynMoE (average) |",
        "![comparison]",
        "reaches best top-k",
        "kFLOP/token",
        "ms/step",
        "| vs MoE k=2 | vs dense (no MoE) |",
        "acc, eval_k0 = skip",
    ):
        assert text in markdown
    assert (tmp_path / "comparison.png").stat().st_size > 0 and result["rows"][0].label == "MoE k=2"

    # A second call reuses every finished run; a changed option re-runs them.
    log = []
    plan = compare.make_plan(compare_args(TINY + ["--out", str(tmp_path)]))
    again = compare.run_plan(plan, log=log.append)
    assert [r.accuracy_mean for r in again] == [r.accuracy_mean for r in result["rows"]]
    assert again[2].skip_accuracy == result["rows"][2].skip_accuracy  # read back from routing.json
    assert sum("reusing" in line for line in log) == 6
    log.clear()
    plan = compare.make_plan(
        compare_args(TINY + ["--out", str(tmp_path), "--set", "train.lr=0.01", "--models", "top2", "--seeds", "0"])
    )
    compare.run_plan(plan, log=log.append)
    assert "reusing" not in log[0] and "top2 seed 0: done" in log[0]


def test_routing_json_of_an_earlier_version_is_still_read():
    bare = {name: [1.0, 1.0] for name in FIELDS}  # the probe counts alone, no skip evaluation
    assert compare.routing_of(bare)["eval_k"] == 1.0 and "skip_accuracy" not in compare.routing_of(bare)


def compare_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(argv)


def test_subcommands(capsys):
    assert experiments_main.main(["nope"]) == 2
    assert "unknown subcommand ('nope')" in capsys.readouterr().err
    for name in ("compare", "losses", "baseline", "drift", "pretrain-moe", "moe-finetune"):
        with pytest.raises(SystemExit) as exit_info:
            experiments_main.main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"dynmoe_dist.experiments {name}" in capsys.readouterr().out

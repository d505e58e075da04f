"""`pretrain-moe --tiny` and `moe-finetune --tiny` end to end, on 2 simulated gloo ranks (slow: each run
starts two processes).
"""

import json
import math

import pytest

from dynmoe_dist.experiments import moe_finetune, pretrain_moe

pytestmark = pytest.mark.slow


def _call(main, argv):
    """(exit status, the JSON line / markdown it printed): 0 when main returns."""
    try:
        main(argv)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "model"
    status = _call(pretrain_moe.main, ["--tiny", "--out", str(out)])
    return out, status


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """moe-finetune --tiny, 2 seeds, on a randomly initialised tiny Qwen3-MoE with pretrain-moe's tokenizer
    (what pretrain-moe starts from: this test does not need its export)."""
    root = tmp_path_factory.mktemp("finetune")
    roots = [pretrain_moe.default_roots()[0] / part for part in pretrain_moe.TINY.stdlib_parts]
    pretrain_moe.build_corpus(root / "corpus.jsonl", 30_000, roots)
    pretrain_moe.write_init(pretrain_moe.TINY, root / "corpus.jsonl", root / "model", seed=0)
    argv = ["--model", str(root / "model"), "--tiny", "--seeds", "2", "--out", str(root / "out")]
    return root, argv, _call(moe_finetune.main, argv)


def test_tiny_pretrain_trains_a_qwen3_moe_on_two_ranks(pretrained):
    from dynmoe_dist.train.telemetry import read_metrics

    out, _ = pretrained
    work = out / "pretrain"
    assert (work / "corpus.jsonl").stat().st_size > 30_000
    config = json.loads((work / "init" / "config.json").read_text())
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    assert config["output_router_logits"] and config["norm_topk_prob"] and config["vocab_size"] == 512
    records = read_metrics(work / "run" / "metrics.jsonl")
    final = [r for r in records if r["kind"] == "final"][-1]
    assert final["step"] == pretrain_moe.TINY_STEPS and math.isfinite(final["test_loss"])
    steps = [r for r in records if r["kind"] == "step"]
    assert all(k == pytest.approx(2.0) for r in steps for k in r["mean_k"])  # native top-2 in every layer
    assert len(list((work / "run" / "checkpoints").glob("step_*"))) == 1


def test_a_second_tiny_pretrain_does_not_train_again(pretrained, capsys):
    """With the model exported, the second call reuses it; with the export failed, it retries only that."""
    out, status = pretrained
    again = _call(pretrain_moe.main, ["--tiny", "--out", str(out)])
    err = capsys.readouterr().err
    assert again == status
    assert "reusing the model" in err if status == 0 else "reusing the trained run" in err
    assert "training" not in err


def test_tiny_pretrain_writes_a_stock_checkpoint_plain_transformers_loads(pretrained, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, status = pretrained
    assert status == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)  # no remote code
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 8
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.eos_token == "<|endoftext|>"
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["steps"] == pretrain_moe.TINY_STEPS and summary["model"] == str(out)
    for key in ("corpus_mb", "tokens", "tokens_trained", "wall_s", "test_loss"):
        assert summary[key] > 0
    # a second call with the same settings reuses the model and prints the same line
    assert _call(pretrain_moe.main, ["--tiny", "--out", str(out)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["reused"] and line["test_loss"] == summary["test_loss"]


def test_tiny_finetune_writes_every_table_and_column(finetuned):
    root, _, _ = finetuned
    md = (root / "out" / "results.md").read_text()
    for text in (
        "| native top-k | ",
        "| top-any, combine 'equal' (1/k)",
        "| top-any, combine 'softmax' (router probabilities)",
        "| held-out loss | 95 % CI | loss at step 0 | k train / end / eval | experts per layer (end) "
        "| removed / added | expert MFLOP/token | vs native | ms/token (export) | ms/token (pre-trained) |",
        "| top-any (converted) | ",
        "| top-any + pruning | ",
        "| top-any + pruning and adds | ",
        "| variant | layer | eval k at step 0 | eval k at the end | experts start -> end | removed | added |",
        "| top-any-pruned - native | ",
        "| top-any - native | ",
        "| top-any-adaptive - native | ",
        "held-out loss within the native finetune's seed spread",
    ):
        assert text in md
    report = json.loads((root / "out" / "results.json").read_text())
    assert report["combine"] in ("equal", "softmax") and report["shape"]["matmuls"] == 3
    assert set(report["step0"]) == {"0", "1"}
    runs = [run for variant in report["variants"] for run in variant["runs"]]
    assert len(runs) == 8
    # the same budget for all four: steps, and the held-out split behind every loss
    assert len({run["steps"] for run in runs}) == 1
    for run in runs:
        assert math.isfinite(run["test_loss"]) and len(run["eval_k"]) == 2
    native = report["variants"][0]
    assert native["variant"] == "native" and native["flops_ratio"]["mean"] == pytest.approx(1.0)
    assert all(p["result"] is not None for p in report["paired"])
    pruned = next(v for v in report["variants"] if v["variant"] == "top-any-pruned")
    assert all(sum(run["added"]) == 0 for run in pruned["runs"])  # pruning only: no adds


def test_tiny_finetune_runs_are_found_finished_for_reuse(finetuned):
    root, argv, _ = finetuned
    plan = moe_finetune.make_plan(moe_finetune.parser("moe-finetune").parse_args(argv))
    combine = json.loads((root / "out" / "results.json").read_text())["combine"]
    for seed in plan.seeds:
        for variant in moe_finetune.VARIANTS:
            assert moe_finetune.finished(plan.variant_config(variant, seed, combine))
        other = "softmax" if combine == "equal" else "equal"
        assert not moe_finetune.finished(plan.variant_config("top-any", seed, other))  # another config


def test_tiny_finetune_exports_and_times_every_run(finetuned):
    from transformers import AutoModelForCausalLM

    root, _, status = finetuned
    assert status == 0
    report = json.loads((root / "out" / "results.json").read_text())
    for variant in report["variants"]:
        for run in variant["runs"]:
            assert not run["export_error"] and not run["generate_error"]
            assert run["per_token_ms"] > 0 and run["base_per_token_ms"] > 0
            remote = variant["variant"] != "native"  # native: the stock layout, no remote code
            AutoModelForCausalLM.from_pretrained(run["export"], trust_remote_code=remote, local_files_only=True)

"""`dynmoe-train` command line: help lists every option, --print-config, clear errors, a tiny run."""

import json
import re

import pytest
from cli_runs import tiny_cli_args

from dynmoe_dist.config import SECTIONS
from dynmoe_dist.train.cli import main, parser

TINY = tiny_cli_args(120, 6, "adaptive.period_steps=3")


def test_help_lists_every_option():
    text = parser().format_help()
    import dataclasses

    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"{name}.{f.name} = " in text, f"{name}.{f.name} missing from --help"


def _help_block(text, option):
    """The lines of --help from `option = ...` up to the next option."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option} = "))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"  \S+ = |\[", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def test_help_lists_every_registered_task_model_source_and_path_form(monkeypatch):
    import dynmoe_dist.tasks as tasks
    import dynmoe_dist.tasks.base as tasks_base
    from dynmoe_dist.config import MODEL_PATH_FORMS, MODEL_SOURCES
    from dynmoe_dist.data.sources import BUILTIN_CORPORA, SUFFIXES

    specs = tasks.all_task_specs()
    assert {"synthetic", "minilm-sentiment", "vit-mnist", "jsonl", "causal-lm"} <= set(specs)
    # A task registered later is listed too; copies of the registries keep it out of the other tests.
    copies = {"TASK_SPECS": dict(tasks_base.TASK_SPECS), "TASKS": dict(tasks_base.TASKS)}
    for name, copy in copies.items():
        monkeypatch.setattr(tasks_base, name, copy)
        monkeypatch.setattr(tasks, name, copy)
    tasks.register(
        "added-later",
        model_kind="token-classifier",
        summary="a task registered after the help was written",
        path_forms="TEXT",
    )(None)
    text = parser().format_help()
    names = _help_block(text, "task.name")
    for name, spec in tasks.all_task_specs().items():
        assert spec.summary, f"task {name!r} has no summary for --help"
        assert f"{name}: {spec.summary}" in names, f"task {name!r} missing from --help"
        if "task.path" in (spec.reads or ()) or spec.path_forms:
            assert f"{name}: {spec.path_forms}" in _help_block(text, "task.path"), name
    assert "added-later: a task registered after" in names
    paths = _help_block(text, "task.path")
    assert all(suffix in paths for suffix in SUFFIXES) and all(name in paths for name in BUILTIN_CORPORA)
    assert all(f"{source}: " in _help_block(text, "model.source") for source in MODEL_SOURCES)
    assert all(f"{form}: " in _help_block(text, "model.path") for form in MODEL_PATH_FORMS)
    assert {"DIR", "FILE.gguf", "package:NAME"} <= set(MODEL_PATH_FORMS)
    assert "relative paths are read from the directory the command runs in" in text
    assert "default runs/latest" in text and "python -m dynmoe_dist.export" in text


def test_print_config(capsys):
    assert main(["--config", "launcher/configs/demo.toml", "--set", "train.lr=0.5", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "lr = 0.5" in out and 'name = "synthetic"' in out


def test_bad_option_is_a_clear_error(capsys):
    assert main(["--set", "train.learning_rate=1"]) == 2
    assert "unknown key train.learning_rate; valid keys of [train]:" in capsys.readouterr().err


def test_tiny_run_writes_metrics_and_prints_summary(tmp_path, capsys):
    assert main(TINY + ["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and str(tmp_path) in out
    assert f"checkpoint: {tmp_path}/checkpoints/step_000006" in out and (tmp_path / "checkpoints/step_000006").is_dir()
    assert "experts per MoE block at the end: block 1: " in out
    assert "export it:" not in out  # only model.source = 'hf' runs export to transformers
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "num_experts", "mean_k", "tokens_per_s"):
        assert key in steps[0]
    assert steps[0]["blocks"] == [1]  # model.moe_layers' default: the MoE layer sits in block 1
    assert all(r["block"] == 1 for r in records if r["kind"] == "event")
    assert records[-1]["kind"] == "final"


def test_end_of_run_summary_says_what_to_do_next():
    from dynmoe_dist.train.cli import summary

    final = {
        "step": 30,
        "wall_s": 155.0,
        "test_loss": 4.527,
        "test_accuracy": 0.31,
        "test_perplexity": 92.47,
        "num_experts": [5, 5],
        "blocks": [28, 29],
        "report": "runs/x/report.png",
        "checkpoint": "runs/x/checkpoints/step_000030",
        "export_command": "python -m dynmoe_dist.export runs/x/checkpoints/step_000030 --out runs/x/export",
    }
    assert summary(final, "runs/x").splitlines() == [
        "final (step 30, 155.0 s): held-out perplexity 92.47, test loss 4.5270 per token, next-token accuracy 0.3100",
        "experts per MoE block at the end: block 28: 5, block 29: 5",
        "metrics:    runs/x/metrics.jsonl",
        "report:     runs/x/report.png",
        "checkpoint: runs/x/checkpoints/step_000030",
        "export it:  python -m dynmoe_dist.export runs/x/checkpoints/step_000030 --out runs/x/export",
    ]
    classification = {"step": 6, "wall_s": 1.0, "test_loss": 0.5, "test_accuracy": 0.8, "num_experts": []}
    assert summary(classification, "o").splitlines() == [
        "final (step 6, 1.0 s): test accuracy 0.8000, test loss 0.5000",
        "metrics:    o/metrics.jsonl",
    ]


def test_language_models_are_scored_by_perplexity():
    import math
    from types import SimpleNamespace

    from dynmoe_dist.tasks.causal_lm import CausalLMTask
    from dynmoe_dist.tasks.synthetic import SyntheticTask
    from dynmoe_dist.train.run import evaluation

    scores = {"test_loss": 2.0, "test_accuracy": 0.5}
    for task, perplexity in ((CausalLMTask, math.exp(2.0)), (SyntheticTask, None)):
        trainer = SimpleNamespace(evaluate=lambda wait: dict(scores), task=task)
        assert evaluation(trainer).get("test_perplexity") == perplexity, task.name


def test_gradient_accumulation_matches_one_big_batch():
    """Without aux losses (which are per micro-batch by design) accumulating 2 micro-batches is the
    same optimizer step as one batch of twice the size."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer

    def losses(accum):
        cfg = load_config(
            None,
            [a for a in TINY if a != "--set"]
            + [
                f"train.grad_accum={accum}",
                "train.precision='float64'",
                "moe.aux_loss_weight=0.0",
                "adaptive.enabled=false",
            ],
        )
        t = Trainer(cfg)
        return [t.train_step()["loss"] for _ in range(4)]

    for a, b in zip(losses(1), losses(2)):
        assert a == pytest.approx(b, rel=1e-10)


def test_fresh_run_in_used_directory_archives_the_old_run(tmp_path, capsys):
    assert main(TINY + ["--out-dir", str(tmp_path)]) == 0
    assert main(TINY + ["--out-dir", str(tmp_path), "--set", "output.final_checkpoint=false"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4, 5, 6]
    archived = list((tmp_path / "previous").iterdir())
    assert len(archived) == 1 and (archived[0] / "metrics.jsonl").is_file() and (archived[0] / "checkpoints").is_dir()
    assert not (tmp_path / "checkpoints").exists()  # final_checkpoint=false wrote none this time


def test_moe_dim_is_refused_with_a_pointer_to_model_dim(capsys):
    assert main(["--set", "moe.ffn_dim=999"]) == 2
    assert "moe.ffn_dim is taken from the model" in capsys.readouterr().err

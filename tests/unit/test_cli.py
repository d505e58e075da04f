"""`dynmoe-train` command line: help lists every option, --print-config, clear errors, a tiny run."""

import json

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
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "num_experts", "mean_k", "tokens_per_s"):
        assert key in steps[0]
    assert steps[0]["blocks"] == [1]  # model.moe_layers' default: the MoE layer sits in block 1
    assert all(r["block"] == 1 for r in records if r["kind"] == "event")
    assert records[-1]["kind"] == "final"


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

"""The end of a Ray job prints what torchrun prints (train/cli.summary, from the files the workers left):
the scores, the experts, the report, the newest checkpoint and, for a transformers model, the command that
exports it. No Ray needed."""

import json

from dynmoe_dist.cluster.submit import run_summary

from dynmoe_dist.config import load_config
from dynmoe_dist.train.cli import summary

FINAL = {"kind": "final", "step": 4, "epoch": 1.0, "test_loss": 2.5, "test_accuracy": 0.25, "wall_s": 3.0}


def finished_run(out_dir, source):
    """A run directory as the workers leave it: metrics.jsonl, two complete checkpoints, a report."""
    (out_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (out_dir / "checkpoints" / "step_000004").mkdir()
    for step in ("step_000002", "step_000004"):
        (out_dir / "checkpoints" / step / "meta.pt").write_bytes(b"")
    (out_dir / "checkpoints" / "step_000006.tmp").mkdir()  # an unfinished one: not named
    (out_dir / "report.png").write_bytes(b"")
    records = [{"kind": "step", "step": 4}, {**FINAL, "num_experts": [3, 4], "blocks": [1, 2]}]
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config(None, [f"output.out_dir='{out_dir}'"])
    config.model.source = source
    return config


def test_the_job_ends_with_torchruns_summary(tmp_path):
    config = finished_run(tmp_path, "hf")
    text = run_summary(config)
    checkpoint = tmp_path / "checkpoints" / "step_000004"
    assert text.splitlines()[-3:] == [
        f"report:     {tmp_path / 'report.png'}",
        f"checkpoint: {checkpoint}",
        f"export it:  python -m dynmoe_dist.export {checkpoint} --out {tmp_path / 'export'}",
    ]
    files = {"report": str(tmp_path / "report.png"), "checkpoint": str(checkpoint)}
    files["export_command"] = text.splitlines()[-1].removeprefix("export it:  ")
    assert text == summary({**FINAL, "num_experts": [3, 4], "blocks": [1, 2], **files}, str(tmp_path))
    assert "experts per MoE block at the end: block 1: 3, block 2: 4" in text


def test_a_built_in_model_has_no_export_line(tmp_path):
    text = run_summary(finished_run(tmp_path, "builtin"))
    assert "export it:" not in text and text.splitlines()[-1].startswith("checkpoint: ")

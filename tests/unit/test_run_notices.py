"""What a run says at its start (rank 0): where checkpoints go, where it resumed from, a run length the
resume changed, an adaptive window it never reaches; and the resume's mark in metrics.jsonl."""

import json

from cli_runs import tiny_cli_args

from dynmoe_dist.train.cli import main


def _run(capsys, out_dir, max_steps, *extra):
    code = main(tiny_cli_args(120, max_steps, f"output.out_dir='{out_dir}'", *extra))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out, captured.err


def test_start_resume_and_length_lines(tmp_path, capsys):
    # 120 samples, 90% train: 12 steps of 8 per epoch; the first window ends after step 8 (2/3 of 12).
    out, err = _run(capsys, tmp_path, 3)
    assert (
        f"checkpoints: every 500 steps and every 30 min and at the end or a stop (Ctrl-C, SIGTERM), into {tmp_path}"
        in out
    )
    assert (
        "dynmoe-train: warning: no expert is added, removed or moved: the first adaptive window ends at step 8, "
        "after the run's last step 3 (one window per epoch of 12 steps); raise train.max_steps (or train.epochs) "
        "to at least 8"
    ) in err
    out, err = _run(capsys, tmp_path, 9, "adaptive.enabled=false", "output.resume='auto'")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_000003'} at step 3 of 9" in out
    assert (
        "dynmoe-train: warning: resumed with another length (train.max_steps 3 -> 9): the run now ends at step 9" in err
    )
    assert "adaptive window" not in err  # adaptive events off: nothing to reach
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resume = [r for r in records if r["kind"] == "resume"]
    assert resume == [
        {
            "kind": "resume",
            "step": 3,
            "epoch": 3 / 12,
            "checkpoint": str(tmp_path / "checkpoints" / "step_000003"),
            "total_steps": 9,
        }
    ]


def test_a_reachable_window_and_an_unchanged_length_say_nothing(tmp_path, capsys):
    _, err = _run(capsys, tmp_path, 4, "adaptive.period_steps=3")
    assert "warning" not in err
    _, err = _run(capsys, tmp_path, 4, "adaptive.period_steps=3", "output.resume='auto'")
    assert "warning" not in err
